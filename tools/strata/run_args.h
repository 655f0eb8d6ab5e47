// The arguments of the benchmarks that run a training config: [CONFIG.yaml] [key=value ...]
// [--steps N] (bench_trace.cpp, bench_queue.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::tools {

struct RunArgs {
  std::string config_path;             // empty: the embedded demo
  std::vector<std::string> overrides;  // key=value
  int64_t steps = 0;
};

// Parses `args` of `command` ("strata bench trace"). --help prints `usage` and returns 0; a bad
// argument prints "COMMAND: error: ..." and returns 2; otherwise returns -1 with *out filled
// (steps defaults to out->steps and must be at least min_steps).
int parse_run_args(const std::vector<std::string>& args, const char* command, const char* usage, int64_t min_steps,
                   RunArgs* out);

}  // namespace strata::tools
