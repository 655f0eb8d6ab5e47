// A run's life on disk through the strata command: the demo runs twice (versioned folders), a
// named model leaves the demo's budgets behind, one writer per folder, a requeued job restarts,
// and failures at the end (a full checkpoint disk, a full run.dir, a failed export) exit 1
// without losing the trained state. The full-disk cases mount a small tmpfs and skip where that
// is not allowed.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/cli_util.h"

namespace {

namespace fs = std::filesystem;

using strata::testing::CmdResult;

// The step lines of a metrics.jsonl (event lines, such as the run's goodput, are not steps).
size_t lines_of(const fs::path& p) {
  std::ifstream in(p);
  size_t n = 0;
  for (std::string line; std::getline(in, line);) n += line.find("\"event\"") == std::string::npos ? 1 : 0;
  return n;
}

class RunLifecycleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::testing::fresh_test_dir("strata_life");
    std::string text;
    for (int i = 0; i < 200; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
    std::ofstream(dir_ / "corpus.txt") << text;
  }
  void TearDown() override {
    for (const auto& m : mounts_) ::umount2(m.c_str(), MNT_DETACH);
    fs::remove_all(dir_);
  }
  CmdResult run(const std::string& args) { return strata::testing::run_strata(args, dir_); }
  std::string small_run() {
    return "data.paths=[" + (dir_ / "corpus.txt").string() +
           "] model.preset=tiny train.micro_batch=2 train.seq_len=32 train.steps=6 optim.warmup_steps=2 "
           "'model.set=[num_hidden_layers=2,hidden_size=64,intermediate_size=96]'";
  }
  // A tmpfs of `bytes` at dir_/name, or "" where mounting is not allowed.
  std::string small_disk(const std::string& name, const std::string& size) {
    const fs::path p = dir_ / name;
    fs::create_directories(p);
    if (::mount("tmpfs", p.c_str(), "tmpfs", 0, ("size=" + size).c_str()) != 0) return "";
    mounts_.push_back(p.string());
    return p.string();
  }
  fs::path dir_;
  std::vector<std::string> mounts_;
};

// The quick start's command twice in a row: each run gets its own version folder and says so.
TEST_F(RunLifecycleTest, TheDemoRunsTwiceIntoVersionedFolders) {
  for (int v = 0; v < 2; ++v) {
    CmdResult r = run("train train.steps=2 optim.warmup_steps=1");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const fs::path version = fs::path("runs/default") / ("version_" + std::to_string(v));
    EXPECT_NE(r.output.find(version.string()), std::string::npos) << r.output;
    EXPECT_EQ(lines_of(dir_ / version / "metrics.jsonl"), 2u);
    EXPECT_TRUE(fs::is_directory(dir_ / version / "nvme")) << "the demo's nvme tier lives in its run's folder";
  }
  // --resume auto continues the newest version (here: nothing left to do at step 2).
  CmdResult resumed = run("train train.steps=2 optim.warmup_steps=1 ckpt.every=1 --resume auto");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("version_1"), std::string::npos) << resumed.output;
  EXPECT_FALSE(fs::exists(dir_ / "runs/default/version_2"));
}

// Naming a model drops the demo's tiny budgets and its nvme tier: what --help says.
TEST_F(RunLifecycleTest, NamingAModelLeavesTheDemosBudgetsBehind) {
  CmdResult demo = run("train --print-config");
  ASSERT_EQ(demo.exit_code, 0) << demo.output;
  EXPECT_NE(demo.output.find("24.00 MiB"), std::string::npos) << demo.output;
  EXPECT_NE(demo.output.find("path: nvme"), std::string::npos) << demo.output;
  for (const std::string& model : {std::string("model.preset=tiny"), "model.config=" + (dir_ / "config.json").string()}) {
    CmdResult r = run("train --print-config " + model);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.find("24.00 MiB"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("size: 64.00 MiB"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("path: nvme"), std::string::npos) << r.output;
  }
  CmdResult help = run("train --help");
  EXPECT_NE(help.output.find("80% of the memory this machine has available"), std::string::npos) << help.output;
}

TEST_F(RunLifecycleTest, ASecondRunOnALockedFolderIsRefusedWithTheHolder) {
  const fs::path run_dir = dir_ / "run";
  fs::create_directories(run_dir);
  const int fd = ::open((run_dir / ".strata.lock").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  const std::string holder = "pid 4242 on host elsewhere, since 2026-01-01T00:00:00Z\n";
  ASSERT_EQ(::write(fd, holder.data(), holder.size()), static_cast<ssize_t>(holder.size()));
  CmdResult r = run("train " + small_run() + " run.dir=" + run_dir.string() + " --resume auto");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("is in use by another strata run (pid 4242 on host elsewhere"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(run_dir / "metrics.jsonl"));
  ::close(fd);  // the holder is gone: the lock goes with it
  CmdResult after = run("train " + small_run() + " run.dir=" + run_dir.string());
  EXPECT_EQ(after.exit_code, 0) << after.output;
}

// The preemption pattern: killed (-9) before its first checkpoint, requeued with the same
// command and --resume auto, the job trains from step 1 and keeps the earlier metrics.
TEST_F(RunLifecycleTest, ARequeuedJobKilledBeforeItsFirstSaveStartsAgain) {
  const std::string run_dir = (dir_ / "job").string();
  const std::string job = "train " + small_run() + " run.dir=" + run_dir + " ckpt.every=1000 --resume auto";
  const std::string cmd = "cd '" + dir_.string() + "' && " + STRATA_BINARY_DIR + "/strata " + job +
                          " train.steps=100000 > log.txt 2>&1 & echo $!";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  int pid = 0;
  ASSERT_EQ(fscanf(p, "%d", &pid), 1);
  pclose(p);
  const fs::path metrics = fs::path(run_dir) / "metrics.jsonl";
  for (int i = 0; i < 600 && lines_of(metrics) < 2; ++i) usleep(100 * 1000);
  ASSERT_GE(lines_of(metrics), 2u) << "training did not start";
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  for (int i = 0; i < 100 && kill(pid, 0) == 0; ++i) usleep(100 * 1000);
  const size_t before = lines_of(metrics);
  CmdResult again = run(job);
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("metrics.restart-1.jsonl"), std::string::npos) << again.output;
  EXPECT_EQ(lines_of(metrics), 6u);
  EXPECT_GE(lines_of(fs::path(run_dir) / "metrics.restart-1.jsonl"), before);
  // The steps the killed job had recorded were done again: the requeued run's goodput says so.
  std::ifstream in(metrics);
  std::string line, last;
  while (std::getline(in, line)) last = line;
  const nlohmann::json goodput = nlohmann::json::parse(last, nullptr, false);
  ASSERT_TRUE(goodput.is_object() && goodput.contains("restart_s")) << last;
  EXPECT_GT(goodput["restart_s"].get<double>(), 0.0) << last;
  EXPECT_NE(again.output.find("goodput "), std::string::npos) << again.output;
}

TEST_F(RunLifecycleTest, AFinalSaveOnAFullDiskExitsOne) {
  const std::string disk = small_disk("ckptfs", "64k");
  if (disk.empty()) GTEST_SKIP() << "cannot mount a tmpfs here (needs root)";
  const std::string run_dir = (dir_ / "run").string();
  CmdResult r = run("train " + small_run() + " run.dir=" + run_dir + " ckpt.dir=" + disk + " ckpt.every=6");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("the final checkpoint (step 6) was not written"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(fs::path(disk) / "latest"));
  EXPECT_EQ(lines_of(fs::path(run_dir) / "metrics.jsonl"), 6u);
}

TEST_F(RunLifecycleTest, AFullRunDirStillCheckpointsTheLastStepBeforeExitingOne) {
  const std::string disk = small_disk("runfs", "12k");
  if (disk.empty()) GTEST_SKIP() << "cannot mount a tmpfs here (needs root)";
  const std::string ckpt = (dir_ / "ckpt").string();
  CmdResult r = run("train " + small_run() + " run.dir=" + disk + " ckpt.dir=" + ckpt + " train.steps=100000");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("cannot write metrics file"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("whose checkpoint is in '" + ckpt + "'"), std::string::npos) << r.output;
  ASSERT_TRUE(fs::exists(fs::path(ckpt) / "latest")) << r.output;
  CmdResult verify = run("ckpt verify " + ckpt);
  EXPECT_EQ(verify.exit_code, 0) << verify.output;
}

TEST_F(RunLifecycleTest, AFailedExportKeepsTheTrainedStateAndLeavesNoTmp) {
  const std::string disk = small_disk("exportfs", "64k");
  if (disk.empty()) GTEST_SKIP() << "cannot mount a tmpfs here (needs root)";
  const std::string run_dir = (dir_ / "run").string();
  const std::string out = disk + "/model";
  CmdResult r = run("train " + small_run() + " run.dir=" + run_dir + " run.export=" + out);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("run.export"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("strata convert --from"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(run_dir) / "checkpoints" / "step-6")) << r.output;
  EXPECT_FALSE(fs::exists(out + ".tmp"));
  EXPECT_FALSE(fs::exists(out));
  // The saved state exports once there is room.
  CmdResult convert = run("convert --from " + run_dir + "/checkpoints --to " + (dir_ / "model").string());
  EXPECT_EQ(convert.exit_code, 0) << convert.output;
}

// Host memory: only what the state can occupy is reserved (the demo's 0.85M parameters under a
// 3 GiB budget with an nvme tier stay far below it), and a budget the plan would fill beyond
// what the machine has is refused before anything is allocated.
TEST_F(RunLifecycleTest, HostMemoryIsReservedAsThePlanNeedsAndRefusedBeyondTheMachine) {
  CmdResult small = run("train train.steps=2 optim.warmup_steps=1 memory.host=3GiB");
  ASSERT_EQ(small.exit_code, 0) << small.output;
  std::ifstream metrics(dir_ / "runs/default/version_0/metrics.jsonl");
  std::string line;
  ASSERT_TRUE(static_cast<bool>(std::getline(metrics, line)));
  const size_t at = line.find("\"rss_bytes\":");
  ASSERT_NE(at, std::string::npos) << line;
  const double rss = std::stod(line.substr(at + 12));
  EXPECT_LT(rss, 512.0 * (1 << 20)) << "a 3 GiB host budget was reserved whole: " << line;
  // Llama-3-8B's fp32 state (about 128 GB) placed in host memory by a 1 TiB budget.
  const std::string big = "train model.preset=llama3-8b data.paths=[" + (dir_ / "corpus.txt").string() +
                          "] train.micro_batch=1 train.seq_len=32 memory.device=16GiB memory.host=1TiB run.dir=" +
                          (dir_ / "big").string();
  CmdResult refused = run(big);
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("memory.host: the plan keeps"), std::string::npos) << refused.output;
  EXPECT_NE(refused.output.find("available"), std::string::npos) << refused.output;
  EXPECT_FALSE(fs::exists(dir_ / "big")) << "a refused run left its run.dir behind";
  // strata plan says the same, naming the peak and what is available, and still plans: a plan
  // may be for a machine with more memory than this one.
  CmdResult plan = run("plan model.preset=llama3-8b train.micro_batch=1 train.seq_len=32 run.device=cpu "
                       "memory.device=16GiB memory.host=1TiB");
  EXPECT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_NE(plan.output.find("not on this machine"), std::string::npos) << plan.output;
  EXPECT_NE(plan.output.find("host RAM: peak "), std::string::npos) << plan.output;
  EXPECT_NE(plan.output.find("at its peak but this machine has"), std::string::npos) << plan.output;
}

}  // namespace
