// strata bench machine writes a hardware profile that strata plan reads with --hardware, and
// says where its rates came from; a profile with a key that is not a hardware key is refused.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tools/cli_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

using strata::testing::CmdResult;
using strata::testing::run_strata;

class BenchMachineCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::testing::fresh_test_dir("strata_bench_machine");
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(BenchMachineCli, WritesAProfileThatPlanReadsAndNames) {
  const std::string profile = (dir_ / "machine.yaml").string();
  const CmdResult bench = run_strata("bench machine --quick --widths 64,128 --dir " + dir_.string() + " --out " +
                                     profile + " model.preset=tiny train.micro_batch=1 train.seq_len=32");
  ASSERT_EQ(bench.exit_code, 0) << bench.output;
  for (const char* rate : {"compute", "compute@64", "compute@128", "copy_overlap", "h2d", "d2h", "both", "cpu_adam", "memcpy", "disk_read"})
    EXPECT_NE(bench.output.find(std::string("\n") + rate + " "), std::string::npos) << rate << "\n" << bench.output;
  std::ifstream in(profile);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("gpu_tflops:"), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("copy_overlap:"), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("cpu_tflops_by_width: [\"64:"), std::string::npos) << text.str();

  const CmdResult plan = run_strata("plan --hardware " + profile + " model.preset=tiny run.device=cpu");
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_NE(plan.output.find("rates: " + profile + " (strata bench machine --quick, cpu backend"), std::string::npos)
      << plan.output;
  EXPECT_NE(plan.output.find("per phase"), std::string::npos) << plan.output;
  // The tiny model's width, 128, is a measured one: the plan computes at its rate.
  EXPECT_NE(plan.output.find(" TFLOP/s at hidden 128 (hardware.cpu_tflops_by_width)"), std::string::npos)
      << plan.output;
  const CmdResult bad = run_strata("bench machine --quick --widths 64,100 --dir none");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--widths"), std::string::npos) << bad.output;
  const CmdResult defaults = run_strata("plan model.preset=tiny run.device=cpu");
  ASSERT_EQ(defaults.exit_code, 0) << defaults.output;
  EXPECT_NE(defaults.output.find("rates: built-in defaults"), std::string::npos) << defaults.output;
  const CmdResult keys = run_strata("plan model.preset=tiny run.device=cpu hardware.h2d_gbps=7");
  ASSERT_EQ(keys.exit_code, 0) << keys.output;
  EXPECT_NE(keys.output.find("rates: hardware.* keys (command line)"), std::string::npos) << keys.output;
}

// --save keeps the profile as this machine's for the device it measured; plans for runs on that
// device then use it without --hardware and name it, --hardware builtin goes back to the
// defaults, and a plan for the other device is not given it.
TEST_F(BenchMachineCli, ASavedProfileIsWhatPlansUseByDefault) {
  const fs::path cache = dir_ / "cache";
  const char* before = std::getenv("STRATA_CACHE_DIR");
  const std::string restore = before != nullptr ? before : "";
  ASSERT_EQ(setenv("STRATA_CACHE_DIR", cache.c_str(), 1), 0);
  const CmdResult none = run_strata("plan model.preset=tiny run.device=cpu");
  EXPECT_NE(none.output.find("rates: built-in defaults"), std::string::npos) << none.output;
  const CmdResult bench = run_strata("bench machine --quick --save --widths 64 --dir " + dir_.string() +
                                     " model.preset=tiny train.micro_batch=1 train.seq_len=32");
  ASSERT_EQ(bench.exit_code, 0) << bench.output;
  const std::string saved = (cache / "machine-cpu.yaml").string();
  EXPECT_NE(bench.output.find("saved as this machine's cpu profile: " + saved), std::string::npos) << bench.output;
  EXPECT_TRUE(fs::exists(saved));
  const CmdResult plan = run_strata("plan model.preset=tiny run.device=cpu");
  EXPECT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_NE(plan.output.find("rates: " + saved + " (strata bench machine --quick, cpu backend"), std::string::npos)
      << plan.output;
  // A default, not an order: hardware.* keys of the config file and of the command line keep
  // their values over the saved profile's.
  const std::string yaml = (dir_ / "run.yaml").string();
  std::ofstream(yaml) << "hardware:\n  h2d_gbps: 9.5\n";
  const CmdResult from_file = run_strata("train " + yaml + " --print-config run.device=cpu");
  EXPECT_NE(from_file.output.find("h2d_gbps: 9.5"), std::string::npos) << from_file.output;
  const CmdResult from_line = run_strata("train --print-config run.device=cpu hardware.h2d_gbps=7.5");
  EXPECT_NE(from_line.output.find("h2d_gbps: 7.5"), std::string::npos) << from_line.output;
  const CmdResult saved_only = run_strata("train --print-config run.device=cpu");
  EXPECT_NE(saved_only.output.find("profile: " + saved), std::string::npos) << saved_only.output;
  const CmdResult builtin = run_strata("plan --hardware builtin model.preset=tiny run.device=cpu");
  EXPECT_NE(builtin.output.find("rates: built-in defaults"), std::string::npos) << builtin.output;
  const CmdResult gpu = run_strata("plan model.preset=tiny run.device=cuda memory.device=24GiB memory.host=1GiB");
  EXPECT_NE(gpu.output.find("rates: built-in defaults"), std::string::npos) << gpu.output;
  ASSERT_EQ(setenv("STRATA_CACHE_DIR", restore.c_str(), 1), 0);
}

TEST_F(BenchMachineCli, AProfileWithOtherKeysIsRefusedNamingFileAndKey) {
  const std::string profile = (dir_ / "bad.yaml").string();
  std::ofstream(profile) << "hardware:\n  gpu_tflops: 3\n  h2d_gpbs: 10\n";
  const CmdResult plan = run_strata("plan --hardware " + profile + " model.preset=tiny run.device=cpu");
  EXPECT_EQ(plan.exit_code, 1) << plan.output;
  EXPECT_NE(plan.output.find("hardware profile " + profile), std::string::npos) << plan.output;
  EXPECT_NE(plan.output.find("h2d_gpbs"), std::string::npos) << plan.output;
}

}  // namespace
}  // namespace strata
