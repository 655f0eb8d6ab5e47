// strata bench machine: the rates the planner predicts with, measured on this machine, each
// beside a reference, written as a hardware profile (train/machine_bench.h).
#pragma once

#include <string>
#include <vector>

namespace strata::tools {

// args are those after "bench machine". Returns 0 on success, 1 when a measurement failed (one
// line printed), 2 for a usage error.
int bench_machine_command(const std::vector<std::string>& args);

}  // namespace strata::tools
