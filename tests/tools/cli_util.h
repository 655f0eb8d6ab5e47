// Running the strata binary from tests: its exit code and output, and a scratch folder per
// test that parallel runs of the suite do not share.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "test_util.h"

namespace strata::testing {

// Whether this build runs under AddressSanitizer or ThreadSanitizer, whose shadow memory is in
// the process's resident memory but not in the program's plan (RSS checks skip then).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

struct CmdResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs `strata ARGS` (shell words), in folder `cwd` when given, with `env` (shell assignments,
// "NAME=value ...") added to its environment.
inline CmdResult run_strata(const std::string& args, const std::filesystem::path& cwd = {},
                            const std::string& env = {}) {
  const std::string in = cwd.empty() ? std::string() : "cd '" + cwd.string() + "' && ";
  const std::string vars = env.empty() ? std::string() : "env " + env + " ";
  const std::string cmd = in + vars + std::string(STRATA_BINARY_DIR) + "/strata " + args + " 2>&1";
  CmdResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace strata::testing
