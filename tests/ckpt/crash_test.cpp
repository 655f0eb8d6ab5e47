// Crash consistency: a child process saves checkpoints in a loop and is killed with SIGKILL at
// random moments; after every kill DIR/latest must load and verify, and hold the values of the
// step its manifest names.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <set>
#include <thread>

#include "ckpt_test_util.h"
#include "core/log.h"

namespace strata::ckpt::testing {
namespace {

// The value of element i of region r at `step`: every step differs from every other.
float pattern(int64_t step, int r, uint64_t i) { return static_cast<float>(step * 7919 + r * 104729 + int64_t(i % 100003)); }

void fill_for_step(TrainState* state, int64_t step) {
  for (int r = 0; r < 3; ++r) {
    float* f = state->buffers[r]->f32();
    for (uint64_t i = 0; i < state->buffers[r]->size() / 4; ++i) f[i] = pattern(step, r, i);
  }
}

[[noreturn]] void child_saves_forever(const std::string& dir) {
  spdlog::set_level(spdlog::level::off);
  TrainState state(4);
  CheckpointWriterOptions opt;
  opt.keep_last = 2;
  opt.staging_bytes = 1 * kMiB;
  CheckpointWriter w(opt);
  int64_t step = 1;
  if (auto r = CheckpointReader::open(dir); r.ok()) step = (*r)->step() + 1;
  for (;; ++step) {
    fill_for_step(&state, step);
    if (!w.begin_save(state.request(dir, step)).ok()) _exit(3);
    // Half of the saves see an optimizer step while they run.
    if (step % 2 == 0) {
      for (int r = 0; r < 3; ++r) {
        w.before_modify(r, 0, state.regions[r].size);
        std::memset(state.buffers[r]->data(), 0x7f, state.regions[r].size);
      }
    }
    if (!w.wait().ok()) _exit(4);
  }
}

TEST_F(CkptTest, KillingASaveAtRandomNeverBreaksLatest) {
  std::mt19937 rng(2024);
  int kills = 0, verified = 0;
  std::set<int64_t> steps_seen;
  int mid_save = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (kills < 24 && std::chrono::steady_clock::now() < deadline) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) child_saves_forever(dir());
    std::this_thread::sleep_for(std::chrono::microseconds(5000 + rng() % 120000));
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the child stopped by itself with status " << WEXITSTATUS(status);
    ++kills;
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().extension() == ".tmp" && e.path().filename() != "latest.tmp") {
        ++mid_save;  // the kill landed inside a save
        break;
      }
    }
    if (!fs::exists(dir_ / "latest")) continue;  // killed before the first commit
    auto r = CheckpointReader::open(dir(), ReaderOpenOptions{true});
    ASSERT_TRUE(r.ok()) << "after kill " << kills << ": " << r.status().to_string();
    const int64_t step = (*r)->step();
    std::vector<float> got;
    for (const SavedTensor& t : (*r)->tensors()) {
      got.resize(t.numel);
      ASSERT_TRUE((*r)->read_f32(t.name, got.data(), t.numel).ok());
    }
    // Spot-check values against the step's pattern: the first tensor of each kind.
    TrainState layout(4);
    for (int reg = 0; reg < 3; ++reg) {
      const RegionTensor& t = layout.regions[reg].tensors[0];
      const std::string q = qualified_name(layout.regions[reg].kind, t.name);
      got.resize(uint64_t(t.shape[0]));
      ASSERT_TRUE((*r)->read_f32(q, got.data(), got.size()).ok());
      for (uint64_t i = 0; i < got.size(); i += 997) {
        ASSERT_EQ(got[i], pattern(step, reg, t.offset / 4 + i)) << q << " of step " << step << " at " << i;
      }
    }
    ++verified;
    steps_seen.insert(step);
  }
  EXPECT_GE(kills, 20);
  EXPECT_GE(verified, 15) << "too few kills landed after a commit to prove anything";
  EXPECT_GE(steps_seen.size(), 5u) << "the kills should land in many different saves";
  EXPECT_GE(mid_save, 5) << "too few kills landed inside a save";
  std::printf("%d kills (%d inside a save), %d verified, %zu distinct latest steps\n", kills, mid_save, verified,
              steps_seen.size());
  // Leftovers of the last kill are cleaned by the next save.
  TrainState state(1);
  CheckpointWriter w;
  ASSERT_TRUE(w.begin_save(state.request(dir(), 1000000)).ok());
  ASSERT_TRUE(w.wait().ok());
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();
  }
}

}  // namespace
}  // namespace strata::ckpt::testing
