// Crash consistency of the real trainer: `strata train` saving a checkpoint every step is
// SIGKILLed at random moments, over and over in one run directory. After every kill the
// checkpoint directory must verify and the run must resume from it. Some of the kills must
// land in the middle of a save (a step-N.tmp directory left behind), or the test proves little.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

using strata::testing::read_text;

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

// Starts the strata binary with `args`, stdout and stderr into `log`. Returns the pid (or -1).
pid_t spawn_strata(const std::vector<std::string>& args, const fs::path& log) {
  const std::string exe = std::string(STRATA_BINARY_DIR) + "/strata";
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(exe.c_str()));
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  return rc == 0 ? pid : -1;
}

// Runs the strata binary to completion; returns its exit code (-1 if it did not exit normally).
int run_strata(const std::vector<std::string>& args, const fs::path& log) {
  pid_t pid = spawn_strata(args, log);
  if (pid < 0) return -1;
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The step-N.tmp directories in a checkpoint directory: saves that had begun but not committed.
std::vector<std::string> tmp_step_dirs(const fs::path& ckpt_dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(ckpt_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) == 0 && name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0)
      out.push_back(name);
  }
  return out;
}

// "step-N" -> N, or -1.
long step_of(const std::string& name) {
  if (name.rfind("step-", 0) != 0) return -1;
  char* end = nullptr;
  const long n = std::strtol(name.c_str() + 5, &end, 10);
  return (end != nullptr && *end == '\0' && n > 0) ? n : -1;
}

TEST(CrashConsistency, SigkillDuringTrainingAlwaysLeavesAVerifiableResumableCheckpoint) {
  // Our own directory: other runs of this test (other build trees) may be going at the same time.
  const fs::path dir = fs::path(::testing::TempDir()) / ("strata_crash_consistency." + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream corpus(dir / "corpus.txt", std::ios::binary);
    for (int i = 0; i < 200; ++i) corpus << "the quick brown fox jumps over the lazy dog " << (i % 7) << "\n";
  }
  const fs::path run = dir / "run";
  const fs::path ckpt = run / "checkpoints";
  const fs::path latest = ckpt / "latest";
  const std::vector<std::string> common = {
      "data.paths=[" + (dir / "corpus.txt").string() + "]",
      "train.micro_batch=2",
      "train.seq_len=32",
      "optim.warmup_steps=1",
      "model.set=[num_hidden_layers=2,hidden_size=128,intermediate_size=512]",
      "run.dir=" + run.string(),
      "ckpt.every=1",
      "ckpt.keep_last=2",
      "memory.nvme.path=" + (dir / "nvme").string(),
  };

  uint32_t seed = 20240611;
  if (const char* s = std::getenv("STRATA_CRASH_SEED")) seed = static_cast<uint32_t>(std::strtoul(s, nullptr, 10));
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> delay_ms(50, 400);
  std::uniform_int_distribution<int> jitter_ms(0, 40);

  constexpr int kKills = 24;
  int mid_save = 0, mid_save_aimed = 0;  // kills at a purely random moment / aimed at a save
  std::vector<long> killed_at;
  const auto t0 = Clock::now();
  for (int i = 0; i < kKills; ++i) {
    SCOPED_TRACE("kill #" + std::to_string(i) + " (seed " + std::to_string(seed) + ")");
    const std::string latest_before = fs::exists(latest) ? trim(read_text(latest)) : "";
    std::vector<std::string> args = {"train"};
    args.insert(args.end(), common.begin(), common.end());
    args.push_back("train.steps=100000");
    if (!latest_before.empty()) {
      args.push_back("--resume");
      args.push_back(ckpt.string());
    }
    const fs::path log = dir / ("train" + std::to_string(i) + ".log");
    const pid_t pid = spawn_strata(args, log);
    ASSERT_GT(pid, 0) << "cannot start " << STRATA_BINARY_DIR << "/strata";

    // Wait until this process has committed a checkpoint of its own (latest names a new step),
    // so every save from here on runs in the process we are about to kill.
    bool committed = false, exited = false;
    int status = 0;
    for (const auto until = Clock::now() + std::chrono::seconds(30); Clock::now() < until;) {
      if (waitpid(pid, &status, WNOHANG) == pid) {
        exited = true;
        break;
      }
      if (fs::exists(latest) && trim(read_text(latest)) != latest_before && !trim(read_text(latest)).empty()) {
        committed = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (!committed && !exited) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
    }
    ASSERT_FALSE(exited) << "training exited early:\n" << read_text(log);
    ASSERT_TRUE(committed) << "no checkpoint committed within 30 s:\n" << read_text(log);

    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(rng)));
    // Every other kill is aimed at a save: wait for a step-N.tmp directory to appear, then a
    // little more, so kills land in all phases of a save (file writes, fsyncs, the rename).
    const bool aimed = i % 2 == 1;
    if (aimed) {
      for (const auto until = Clock::now() + std::chrono::seconds(5); Clock::now() < until;) {
        if (!tmp_step_dirs(ckpt).empty()) break;
        std::this_thread::sleep_for(std::chrono::microseconds(500));
      }
      // Half of them at once: then the kill lands inside the save whatever the machine's speed
      // (a save takes milliseconds, the poll half of one), so the count below holds anywhere.
      if (i % 4 == 3) std::this_thread::sleep_for(std::chrono::milliseconds(jitter_ms(rng)));
    }
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "training ended by itself:\n" << read_text(log);
    // The nvme tier's files have no names while in use, so a killed run leaves none behind.
    EXPECT_TRUE(fs::is_empty(dir / "nvme")) << "a killed run left files in " << (dir / "nvme");

    // Each save removes stale step-N.tmp directories before it starts, and this process
    // committed at least one save, so any left now were being written when it died.
    const auto tmps = tmp_step_dirs(ckpt);
    if (!tmps.empty()) ++(aimed ? mid_save_aimed : mid_save);

    // The directory verifies...
    const fs::path vlog = dir / ("verify" + std::to_string(i) + ".log");
    const int v = run_strata({"ckpt", "verify", ckpt.string()}, vlog);
    ASSERT_EQ(v, 0) << "ckpt verify failed after the kill (tmp dirs: " << tmps.size() << "):\n" << read_text(vlog);

    // ...and names a committed step, which the run resumes from for exactly one more step.
    ASSERT_TRUE(fs::exists(latest)) << "no latest after the kill";
    const std::string name = trim(read_text(latest));
    const long step = step_of(name);
    ASSERT_GT(step, 0) << "latest names '" << name << "'";
    ASSERT_TRUE(fs::is_directory(ckpt / name)) << "latest names " << name << ", which does not exist";
    killed_at.push_back(step);
    args = {"train"};
    args.insert(args.end(), common.begin(), common.end());
    args.push_back("train.steps=" + std::to_string(step + 1));
    args.push_back("--resume");
    args.push_back(ckpt.string());
    const fs::path rlog = dir / ("resume" + std::to_string(i) + ".log");
    const int r = run_strata(args, rlog);
    ASSERT_EQ(r, 0) << "resume from " << name << " failed:\n" << read_text(rlog);
    const std::string rtext = read_text(rlog);
    EXPECT_NE(rtext.find("(step " + std::to_string(step) + ","), std::string::npos)
        << "the resume did not start from " << name << ":\n" << rtext;
    EXPECT_EQ(trim(read_text(latest)), "step-" + std::to_string(step + 1)) << rtext;
    EXPECT_TRUE(tmp_step_dirs(ckpt).empty()) << "a completed run left a step-N.tmp directory";
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();

  std::ostringstream steps;
  for (long s : killed_at) steps << ' ' << s;
  std::printf(
      "[crash] %d kills in %.1f s (seed %u), %d of them mid-save (%d of %d random, %d of %d aimed); "
      "latest after each kill:%s\n",
      kKills, secs, seed, mid_save + mid_save_aimed, mid_save, (kKills + 1) / 2, mid_save_aimed, kKills / 2,
      steps.str().c_str());
  EXPECT_GE(mid_save + mid_save_aimed, 3) << "too few kills landed during a save; the test is not exercising saves";
  fs::remove_all(dir);
}

}  // namespace
