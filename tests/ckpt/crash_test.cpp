// Crash consistency: a child process saves checkpoints in a loop and is killed with SIGKILL, at
// chosen I/O requests and at random moments; after every kill DIR/latest must load and verify,
// and hold the values of the step its manifest names.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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

// Passes every call to `inner`; counts submitted requests and, with kill_at > 0, kills the
// process with SIGKILL as the kill_at-th is submitted: a crash at a chosen point inside a save,
// the same point on every machine whatever its speed.
class KillingEngine final : public IoEngine {
 public:
  KillingEngine(std::unique_ptr<IoEngine> inner, uint64_t kill_at, uint64_t* submitted)
      : inner_(std::move(inner)), kill_at_(kill_at), submitted_(submitted) {}
  const char* name() const override { return inner_->name(); }
  Result<int> register_file(int fd, const std::string& path) override { return inner_->register_file(fd, path); }
  Status register_buffer(void* base, uint64_t length) override { return inner_->register_buffer(base, length); }
  Result<IoTicket> submit(const IoRequest& request) override {
    if (++*submitted_ == kill_at_) raise(SIGKILL);
    return inner_->submit(request);
  }
  Status wait(IoTicket ticket) override { return inner_->wait(ticket); }
  bool done(IoTicket ticket) override { return inner_->done(ticket); }
  std::string file_path(int file) const override { return inner_->file_path(file); }

 private:
  std::unique_ptr<IoEngine> inner_;
  uint64_t kill_at_;
  uint64_t* submitted_;  // over all saves of the process
};

CheckpointWriterOptions writer_options(uint64_t kill_at, uint64_t* submitted) {
  CheckpointWriterOptions opt;
  opt.keep_last = 2;
  opt.staging_bytes = 1 * kMiB;
  opt.engine_factory = [kill_at, submitted]() -> Result<std::unique_ptr<IoEngine>> {
    ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> inner, make_io_engine({}));
    return std::unique_ptr<IoEngine>(std::make_unique<KillingEngine>(std::move(inner), kill_at, submitted));
  };
  return opt;
}

// One save of `step` as the child makes it: half of the saves see an optimizer step while they
// run.
bool save_one(CheckpointWriter& w, TrainState& state, const std::string& dir, int64_t step) {
  fill_for_step(&state, step);
  if (!w.begin_save(state.request(dir, step)).ok()) return false;
  if (step % 2 == 0) {
    for (int r = 0; r < 3; ++r) {
      w.before_modify(r, 0, state.regions[r].size);
      std::memset(state.buffers[r]->data(), 0x7f, state.regions[r].size);
    }
  }
  return w.wait().ok();
}

// Saves checkpoints in a loop from the step after DIR/latest's; with kill_at > 0 it dies at
// that I/O request, otherwise when the parent kills it.
[[noreturn]] void child_saves_forever(const std::string& dir, uint64_t kill_at) {
  spdlog::set_level(spdlog::level::off);
  TrainState state(4);
  uint64_t submitted = 0;
  CheckpointWriter w(writer_options(kill_at, &submitted));
  int64_t step = 1;
  if (auto r = CheckpointReader::open(dir); r.ok()) step = (*r)->step() + 1;
  for (;; ++step) {
    if (!save_one(w, state, dir, step)) _exit(3);
  }
}

class KillTest : public CkptTest {
 protected:
  // Kills a child (at an I/O request when kill_at > 0, after `delay` otherwise) and checks
  // that DIR/latest, if any, loads, verifies and holds its step's values. Returns that step,
  // or -1 when nothing is committed yet; `mid_save` tells whether a save was under way.
  int64_t kill_and_verify(uint64_t kill_at, std::chrono::microseconds delay, bool* mid_save) {
    const pid_t pid = fork();
    EXPECT_GE(pid, 0);
    if (pid == 0) child_saves_forever(dir(), kill_at);
    if (kill_at == 0) {
      std::this_thread::sleep_for(delay);
      EXPECT_EQ(kill(pid, SIGKILL), 0);
    }
    int status = 0;
    EXPECT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "the child stopped otherwise, status " << status;
    *mid_save = false;
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().extension() == ".tmp" && e.path().filename() != "latest.tmp") *mid_save = true;
    }
    if (!fs::exists(dir_ / "latest")) return -1;  // killed before the first commit
    auto r = CheckpointReader::open(dir(), ReaderOpenOptions{true});
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (!r.ok()) return -2;
    const int64_t step = (*r)->step();
    std::vector<float> got;
    for (const SavedTensor& t : (*r)->tensors()) {
      got.resize(t.numel);
      EXPECT_TRUE((*r)->read_f32(t.name, got.data(), t.numel).ok()) << t.name;
    }
    // Spot-check values against the step's pattern: the first tensor of each kind.
    TrainState layout(4);
    for (int reg = 0; reg < 3; ++reg) {
      const RegionTensor& t = layout.regions[reg].tensors[0];
      const std::string q = qualified_name(layout.regions[reg].kind, t.name);
      got.resize(uint64_t(t.shape[0]));
      EXPECT_TRUE((*r)->read_f32(q, got.data(), got.size()).ok()) << q;
      for (uint64_t i = 0; i < got.size(); i += 997) {
        if (got[i] != pattern(step, reg, t.offset / 4 + i)) {
          ADD_FAILURE() << q << " of step " << step << " at " << i;
          return -2;
        }
      }
    }
    return step;
  }

  // Leftovers of the last kill are cleaned by the next save.
  void expect_next_save_cleans_up() {
    TrainState state(1);
    CheckpointWriter w;
    ASSERT_TRUE(w.begin_save(state.request(dir(), 1000000)).ok());
    ASSERT_TRUE(w.wait().ok());
    for (const auto& e : fs::directory_iterator(dir_)) {
      EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();
    }
  }
};

// Kills at chosen I/O requests: the same points inside saves on every machine, however fast.
// The requests of one save are counted first; the kills then fall anywhere in a child's first
// three saves, so that some land before its first commit and some after one or two.
TEST_F(KillTest, KillingASaveAtAnyIoRequestNeverBreaksLatest) {
  uint64_t per_save = 0;  // the most requests a save makes (with and without a step during it)
  {
    uint64_t submitted = 0;
    TrainState state(4);
    CheckpointWriter w(writer_options(0, &submitted));
    const fs::path scratch = dir_ / "count";
    for (int64_t step : {1, 2, 3}) {
      const uint64_t before = submitted;
      ASSERT_TRUE(save_one(w, state, scratch.string(), step));
      per_save = std::max(per_save, submitted - before);
    }
    fs::remove_all(scratch);
  }
  ASSERT_GT(per_save, 2u);
  std::mt19937_64 rng(2024);
  std::set<int64_t> steps_seen;
  int64_t last_step = -1;
  for (int kill = 0; kill < 16; ++kill) {
    const uint64_t kill_at = 1 + rng() % (3 * per_save);
    bool mid_save = false;
    const int64_t step = kill_and_verify(kill_at, {}, &mid_save);
    ASSERT_GE(step, -1) << "after kill " << kill << " at request " << kill_at << " of " << per_save << " a save";
    EXPECT_TRUE(mid_save) << "kill " << kill << " at request " << kill_at << " found no save under way";
    if (kill_at > per_save) {
      // The child committed at least one save of its own first.
      ASSERT_GT(step, last_step) << "kill " << kill << " at request " << kill_at;
    }
    if (step >= 0) steps_seen.insert(step);
    last_step = step;
  }
  EXPECT_GE(steps_seen.size(), 5u) << "the kills should land in many different saves";
  std::printf("16 kills at I/O requests (%llu a save), %zu distinct latest steps\n",
              static_cast<unsigned long long>(per_save), steps_seen.size());
  expect_next_save_cleans_up();
}

// Kills at random moments also land between the I/O requests: in the fsyncs, renames and
// retention of a commit. Which moments they hit depends on the machine's speed, so this test
// asserts only that every kill leaves `latest` whole, not how many kills land where (the test
// above holds that).
TEST_F(KillTest, KillingASaveAtRandomMomentsNeverBreaksLatest) {
  std::mt19937 rng(2024);
  int kills = 0, verified = 0, mid_save_kills = 0;
  for (; kills < 12; ++kills) {
    bool mid_save = false;
    const int64_t step = kill_and_verify(0, std::chrono::microseconds(5000 + rng() % 120000), &mid_save);
    ASSERT_GE(step, -1) << "after kill " << kills;
    verified += step >= 0;
    mid_save_kills += mid_save;
  }
  std::printf("%d kills (%d inside a save), %d verified\n", kills, mid_save_kills, verified);
  expect_next_save_cleans_up();
}

}  // namespace
}  // namespace strata::ckpt::testing
