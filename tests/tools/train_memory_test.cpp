// The planned peak of host memory against a real run's: the peak resident set of a `strata
// train` process (its rusage maximum, which the kernel keeps) stays within the plan, and not
// far below it.
//
// On the cpu backend (the CUDA runtime's host memory is an estimate these tests do not check),
// the bound held is between 70% and 100% of the planned peak. The plan counts whole reservations
// that a run touches only as far as its state moves through them (the host tier's slots, the
// cpu device's arena, the checkpoint staging at its fullest) and a process baseline with room
// for more threads than this machine has, so it sits above the real peak; allocator arenas and
// library buffers that it does not itemise are what keep the real peak from being lower still.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/host_memory.h"

#include "tools/cli_util.h"

namespace {

namespace fs = std::filesystem;

struct Ran {
  int exit_code = -1;
  uint64_t peak_rss = 0;  // bytes
  std::string output;
};

// Runs strata with `args` in `cwd`, its output in a file; the child's peak RSS from wait4.
Ran run_strata(const fs::path& cwd, const std::vector<std::string>& args) {
  const fs::path log = cwd / "log.txt";
  const std::string binary = std::string(STRATA_BINARY_DIR) + "/strata";
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(binary.c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  Ran r;
  const pid_t pid = fork();
  if (pid == 0) {
    if (chdir(cwd.c_str()) != 0) _exit(126);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) _exit(126);
    dup2(fd, 1);
    dup2(fd, 2);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  int status = 0;
  rusage usage{};
  if (pid < 0 || wait4(pid, &status, 0, &usage) != pid) return r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.peak_rss = static_cast<uint64_t>(usage.ru_maxrss) * 1024;  // KiB on Linux
  std::ifstream in(log);
  r.output.assign(std::istreambuf_iterator<char>(in), {});
  return r;
}

uint64_t planned_peak(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::string line;
  if (!std::getline(in, line)) return 0;
  return nlohmann::json::parse(line).value("rss_planned_bytes", uint64_t{0});
}

class TrainMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::testing::fresh_test_dir("strata_memory");
    std::string text;
    for (int i = 0; i < 200; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
    std::ofstream(dir_ / "corpus.txt") << text;
  }
  void TearDown() override { fs::remove_all(dir_); }

  void expect_within_plan(const std::string& what, const std::vector<std::string>& args) {
    const Ran r = run_strata(dir_, args);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const uint64_t planned = planned_peak(dir_ / "run" / "metrics.jsonl");
    ASSERT_GT(planned, 0u) << what << ": no rss_planned_bytes in metrics.jsonl";
    const double ratio = static_cast<double>(r.peak_rss) / static_cast<double>(planned);
    // The plan's "process" item is a fixed estimate of the program's own pages; which of them a
    // small run touches (thread stacks, allocator arenas, BLAS buffers) varies with scheduling
    // by a few MiB from run to run: 28.0-30.0 MiB for the MoE run below against 29.8 planned.
    const uint64_t slack = 4ull << 20;
    EXPECT_TRUE(r.peak_rss <= planned + slack && ratio >= 0.7)
        << what << ": peak RSS " << r.peak_rss << " bytes is " << ratio << " of the planned " << planned << "\n"
        << r.output;
    EXPECT_NE(r.output.find(" planned"), std::string::npos) << "the step line shows rss against the plan";
  }

  fs::path dir_;
};

TEST_F(TrainMemoryTest, TheDefaultRunStaysWithinItsPlannedHostMemory) {
  if (strata::testing::kSanitized) GTEST_SKIP() << "sanitizers' shadow memory is not the program's";
  expect_within_plan("the embedded default", {"train", "run.dir=run", "run.device=cpu", "train.steps=12",
                                              "optim.warmup_steps=2", "ckpt.every=5", "run.log_every=4"});
}

TEST_F(TrainMemoryTest, AMoeRunStaysWithinItsPlannedHostMemory) {
  if (strata::testing::kSanitized) GTEST_SKIP() << "sanitizers' shadow memory is not the program's";
  expect_within_plan("a MoE run",
                     {"train", "run.dir=run", "run.device=cpu", "data.paths=[corpus.txt]", "train.micro_batch=2",
                      "train.seq_len=32", "train.steps=12", "optim.warmup_steps=2", "ckpt.every=5",
                      "model.set=[num_hidden_layers=2,hidden_size=64,intermediate_size=96,model_type=mixtral,"
                      "num_local_experts=4,num_experts_per_tok=2,router_bias_update_rate=0.05]"});
}

// Llama-3-8B's fp32 state held in the cpu device's memory (a 1 TiB budget) is 124 GiB of host
// memory besides a 3 GiB host tier that fits (it holds the 2.45 GiB embedding group while the
// weights load): the host tier alone passes its own checks, the whole run does not, and it is
// refused before its run.dir exists, naming both numbers and the part to shrink.
TEST_F(TrainMemoryTest, ARunWhosePeakTheMachineLacksIsRefusedBeforeItsRunDir) {
  const strata::HostMemory machine = strata::available_host_memory();
  if (!machine.known || machine.available > (120ull << 30))
    GTEST_SKIP() << "this machine has room for the run; nothing to refuse";
  const Ran r = run_strata(
      dir_, {"train", "model.preset=llama3-8b", "run.device=cpu", "memory.device=1TiB", "memory.host=3GiB",
             "memory.nvme.path=", "data.paths=[corpus.txt]", "train.micro_batch=1", "train.seq_len=32", "run.dir=run"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  // Refused by the whole run's host-memory check, or before it by the cpu device's own (which
  // alone already exceeds what is available), each naming the part to shrink.
  const bool whole_run = r.output.find("host memory: the run needs 129.") != std::string::npos &&
                         r.output.find("the largest part is device") != std::string::npos;
  const bool device_tier = r.output.find("memory.device: the plan keeps") != std::string::npos;
  EXPECT_TRUE(whole_run || device_tier) << r.output;
  EXPECT_NE(r.output.find("available (" + machine.source), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "run")) << "a refused run left its run.dir behind";
  EXPECT_LT(r.peak_rss, uint64_t{256} << 20) << "refused only after allocating";
}

}  // namespace
