// strata bench queue: what queueing the CPU backend's ops on a compute stream costs against
// running them in the caller (bench_queue.cpp).
#pragma once

#include <string>
#include <vector>

namespace strata::tools {

int bench_queue_command(const std::vector<std::string>& args);

}  // namespace strata::tools
