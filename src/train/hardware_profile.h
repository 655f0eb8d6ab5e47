// Where the planner's hardware.* rates come from for one command: a profile file named with
// --hardware, or this machine's own profile saved by `strata bench machine --save`, or the
// built-in defaults (an H200 box). strata plan, strata train and strata profile all start from
// hardware_keys(); key=value on their command line still wins.
#pragma once

#include <string>
#include <vector>

#include "core/device.h"
#include "core/status.h"

namespace strata {

// The file `strata bench machine --save` writes for `device` and the commands read:
// $STRATA_CACHE_DIR/machine-<cpu|cuda>.yaml, else $XDG_CACHE_HOME/strata/..., else
// $HOME/.cache/strata/...; empty (no saved profile) when STRATA_CACHE_DIR is set but empty or
// no home is known.
std::string saved_profile_path(DeviceKind device);

// --hardware's value that asks for the built-in defaults even where a saved profile exists.
inline constexpr const char* kBuiltinHardware = "builtin";

// The hardware.* key=value overrides a command puts before its own: those of the profile file
// `hardware` names (kBuiltinHardware: none), or when `hardware` is empty, those of the saved
// profile for the device the config (`config_path` with `overrides`) would run on, if there is
// one, less the hardware.* keys the config sets itself (a saved profile is a default) (a config that does not load has none: the command then reports it). Errors: a profile
// that cannot be read or holds other keys (hardware_overrides).
Result<std::vector<std::string>> hardware_keys(const std::string& hardware, const std::string& config_path,
                                               const std::vector<std::string>& overrides);

}  // namespace strata
