// `strata ckpt inspect|verify|bench`: look into, check and benchmark checkpoints. Returns the
// process exit code: 0 on success, 1 when the work failed (one line saying why), 2 for a
// usage error.
#pragma once

#include <string>
#include <vector>

namespace strata::tools {

int ckpt_command(const std::vector<std::string>& args);

}  // namespace strata::tools
