// strata bench trace: the cost of tracing with it on and off (bench_trace.cpp).
#pragma once

#include <string>
#include <vector>

namespace strata::tools {

int bench_trace_command(const std::vector<std::string>& args);

}  // namespace strata::tools
