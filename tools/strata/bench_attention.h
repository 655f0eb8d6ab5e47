// strata bench attention: the CPU attention's key tiles against one tile of every key.
#pragma once

#include <string>
#include <vector>

namespace strata::tools {

// args are those after "bench attention". Returns 0 on success, 2 for a usage error.
int bench_attention_command(const std::vector<std::string>& args);

}  // namespace strata::tools
