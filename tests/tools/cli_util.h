// Running the strata binary from tests: its exit code and output, and a scratch folder per
// test that parallel runs of the suite do not share.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

namespace strata::testing {

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

// An empty folder for the running test: TempDir()/PREFIX_TESTNAME_PID.
inline std::filesystem::path fresh_test_dir(const std::string& prefix) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    (prefix + "_" + info->name() + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace strata::testing
