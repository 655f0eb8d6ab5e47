// strata bench adam: host AdamW throughput against a STREAM triad on the same cores.
#pragma once

#include <string>
#include <vector>

namespace strata::tools {

// args are those after "bench adam". Returns 0 on success, 1 when the run failed (one line
// printed), 2 for a usage error.
int bench_adam_command(const std::vector<std::string>& args);

}  // namespace strata::tools
