// CHECK: the one macro for programmer errors. It prints the failed statement, file, line,
// device and rank, then aborts. Errors the environment can cause return Status instead.
#pragma once

#include <string>

namespace strata {

// Process identity shown by CHECK failures and log lines. Set once at start-up.
struct ProcessIdentity {
  int rank = 0;
  int world_size = 1;
  std::string device = "cpu";
};
void set_process_identity(const ProcessIdentity& id);
const ProcessIdentity& process_identity();

[[noreturn]] void check_failed(const char* expr, const char* file, int line, const std::string& msg);

}  // namespace strata

#define CHECK(cond)                                                  \
  do {                                                               \
    if (!(cond)) ::strata::check_failed(#cond, __FILE__, __LINE__, ""); \
  } while (0)

// CHECK_MSG(cond, "text " + std::to_string(x)): the message is only built on failure.
#define CHECK_MSG(cond, msg)                                            \
  do {                                                                  \
    if (!(cond)) ::strata::check_failed(#cond, __FILE__, __LINE__, (msg)); \
  } while (0)
