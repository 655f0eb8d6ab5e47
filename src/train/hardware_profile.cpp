#include "train/hardware_profile.h"

#include <cstdlib>
#include <filesystem>

#include "train/machine_bench.h"
#include "train/planning.h"
#include "train/train_config.h"

namespace strata {

std::string saved_profile_path(DeviceKind device) {
  namespace fs = std::filesystem;
  fs::path dir;
  if (const char* own = std::getenv("STRATA_CACHE_DIR"); own != nullptr) {
    if (*own == '\0') return "";
    dir = own;
  } else if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    dir = fs::path(xdg) / "strata";
  } else if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    dir = fs::path(home) / ".cache" / "strata";
  } else {
    return "";
  }
  return (dir / (device == DeviceKind::kCuda ? "machine-cuda.yaml" : "machine-cpu.yaml")).string();
}

Result<std::vector<std::string>> hardware_keys(const std::string& hardware, const std::string& config_path,
                                               const std::vector<std::string>& overrides) {
  if (hardware == kBuiltinHardware) return std::vector<std::string>{};
  if (!hardware.empty()) return hardware_overrides(hardware);
  // Which device's profile: where the run would compute, as strata train resolves run.device.
  // A config that does not load gets no profile here: the command reports it as it always has.
  Result<Config> config = load_train_config(config_path, overrides);
  if (!config.ok()) return std::vector<std::string>{};
  Result<TrainConfig> t = make_train_config(*config);
  if (!t.ok()) return std::vector<std::string>{};
  const std::string saved = saved_profile_path(planned_device(*t));
  std::error_code ec;
  if (saved.empty() || !std::filesystem::exists(saved, ec)) return std::vector<std::string>{};
  // A default, not an order: the config's own hardware.* keys (its file's or the command line's)
  // keep their values.
  ASSIGN_OR_RETURN(std::vector<std::string> keys, hardware_overrides(saved));
  std::vector<std::string> kept;
  for (const std::string& kv : keys) {
    const std::string name = kv.substr(0, kv.find('='));
    if (name == "hardware.profile" || !config->is_set(name)) kept.push_back(kv);
  }
  return kept;
}

}  // namespace strata
