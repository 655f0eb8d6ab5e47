// Comm: the local backend and connect()'s checks in this process; the Gloo backend across
// processes, each rank a parallel_comm_worker (tests/parallel/comm_worker/main.cpp) that checks
// every operation against values it computes itself, at worlds of 2, 3 and 4; and what the
// survivors report when one rank exits or hangs mid-sequence.
#include "parallel/comm.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace strata::parallel {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

TEST(LocalComm, CopiesWhereDataMovesAndSumsAreTheInput) {
  Result<std::unique_ptr<Comm>> comm = connect(LaunchInfo{}, CommOptions{});
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  Comm& c = **comm;
  EXPECT_STREQ(c.backend(), "local");
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.world_size(), 1);
  std::vector<float> send = {1.f, -2.f, 3.5f}, recv(3, 0.f);
  ASSERT_TRUE(c.reduce_scatter_sum(send.data(), recv.data(), 3).ok());
  EXPECT_EQ(recv, send);
  ASSERT_TRUE(c.all_reduce_sum(recv.data(), 3).ok());
  EXPECT_EQ(recv, send);
  std::vector<uint8_t> bytes = {1, 2, 3, 4}, out(4, 0);
  ASSERT_TRUE(c.all_gather(bytes.data(), out.data(), 4).ok());
  EXPECT_EQ(out, bytes);
  std::vector<size_t> sizes = {4};
  std::fill(out.begin(), out.end(), 0);
  ASSERT_TRUE(c.all_to_all_v(bytes.data(), sizes, out.data(), sizes).ok());
  EXPECT_EQ(out, bytes);
  std::fill(out.begin(), out.end(), 0);
  ASSERT_TRUE(c.send_recv(bytes.data(), 0, out.data(), 0, 4).ok());  // a ring of one: to itself
  EXPECT_EQ(out, bytes);
  ASSERT_TRUE(c.broadcast(bytes.data(), 4, 0).ok());
  ASSERT_TRUE(c.all_gather_v(bytes.data(), sizes).ok());  // one rank's block: nothing moves
  EXPECT_EQ(bytes, (std::vector<uint8_t>{1, 2, 3, 4}));
  const std::vector<size_t> counts = {3};
  ASSERT_TRUE(c.reduce_scatter_v_sum(recv.data(), counts).ok());
  EXPECT_EQ(recv, send);
  ASSERT_TRUE(c.barrier().ok());
  Result<double> sum = sum_over_ranks(c, 2.5);
  ASSERT_TRUE(sum.ok());
  EXPECT_EQ(*sum, 2.5);
  EXPECT_EQ(c.bytes_sent(), 0u);
}

TEST(Connect, ABadBackendOrAMissingRendezvousIsACleanError) {
  CommOptions bad;
  bad.backend = "mpi";
  Result<std::unique_ptr<Comm>> comm = connect(LaunchInfo{}, bad);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(comm.status().message().find("\"mpi\""), std::string::npos) << comm.status().to_string();

  LaunchInfo two;
  two.world_size = 2;
  two.launcher = "torchrun";
  comm = connect(two, CommOptions{});
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(comm.status().message().find("parallel.rendezvous"), std::string::npos) << comm.status().to_string();

  CommOptions local;
  local.backend = "local";
  local.rendezvous_dir = "/tmp";
  comm = connect(two, local);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kInvalidArgument);
}

#if STRATA_HAVE_GLOO

class CommProcesses : public ::testing::Test {
 public:
  struct Rank {
    pid_t pid = -1;
    int status = 0;
    bool done = false;
    double seconds = 0;  // from the start until it exited
    std::string log;
  };

 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("strata_comm_" + std::to_string(getpid()) + "_" +
                                             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Starts `world` workers running `scenario`, each with its log (stdout and stderr) in the
  // test's folder, and waits until ranks 0 .. wait_for-1 have exited (all by default) or
  // `limit` passes; then kills whatever still runs.
  std::vector<Rank> run(int world, const std::string& scenario, std::chrono::seconds limit, int wait_for = -1) {
    if (wait_for < 0) wait_for = world;
    const std::string rendezvous = (dir_ / ("rdv_" + std::to_string(world))).string();
    std::vector<Rank> ranks(world);
    const auto start = Clock::now();
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> env;
      for (char** e = environ; *e != nullptr; ++e) {
        // The test's own launcher variables (a CI job under Slurm, say) must not leak in.
        std::string v = *e;
        if (v.rfind("RANK=", 0) == 0 || v.rfind("WORLD_SIZE=", 0) == 0 || v.rfind("LOCAL_", 0) == 0 ||
            v.rfind("OMPI_", 0) == 0 || v.rfind("PMI_", 0) == 0 || v.rfind("SLURM_", 0) == 0 ||
            v.rfind("GLOO_", 0) == 0) {
          continue;
        }
        env.push_back(v);
      }
      env.push_back("RANK=" + std::to_string(r));
      env.push_back("WORLD_SIZE=" + std::to_string(world));
      env.push_back("LOCAL_RANK=" + std::to_string(r));
      env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(world));
      env.push_back("STRATA_RENDEZVOUS=" + rendezvous);
      std::vector<char*> envp;
      for (auto& v : env) envp.push_back(v.data());
      envp.push_back(nullptr);
      std::string exe = STRATA_COMM_WORKER, arg = scenario;
      std::vector<char*> argv = {exe.data(), arg.data(), nullptr};
      const std::string log = (dir_ / (scenario + "_" + std::to_string(world) + "_" + std::to_string(r) + ".log"));
      posix_spawn_file_actions_t actions;
      posix_spawn_file_actions_init(&actions);
      posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      posix_spawn_file_actions_adddup2(&actions, 1, 2);
      int rc = posix_spawn(&ranks[r].pid, exe.c_str(), &actions, nullptr, argv.data(), envp.data());
      posix_spawn_file_actions_destroy(&actions);
      EXPECT_EQ(rc, 0) << "cannot start " << exe << ": " << std::strerror(rc);
      ranks[r].log = log;
    }
    for (;;) {
      bool all_done = true;
      for (int r = 0; r < world; ++r) {
        Rank& rank = ranks[r];
        if (rank.done || rank.pid < 0) continue;
        if (waitpid(rank.pid, &rank.status, WNOHANG) == rank.pid) {
          rank.done = true;
          rank.seconds = std::chrono::duration<double>(Clock::now() - start).count();
        } else if (r < wait_for) {
          all_done = false;
        }
      }
      if (all_done || Clock::now() - start > limit) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    for (Rank& rank : ranks) {
      if (!rank.done && rank.pid > 0) {
        kill(rank.pid, SIGKILL);
        waitpid(rank.pid, &rank.status, 0);
      }
      std::ifstream in(rank.log);
      rank.log = std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    return ranks;
  }

  fs::path dir_;
};

bool exited_ok(const CommProcesses::Rank& r) { return r.done && WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0; }

TEST_F(CommProcesses, ARendezvousThatNobodyJoinsTimesOut) {
  LaunchInfo first;
  first.world_size = 2;
  first.local_world_size = 2;
  CommOptions options;
  options.rendezvous_dir = (dir_ / "alone").string();
  options.timeout = std::chrono::milliseconds(500);
  const auto start = Clock::now();
  Result<std::unique_ptr<Comm>> comm = connect(first, options);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kIOError);
  EXPECT_NE(comm.status().message().find("rank 0 of 2"), std::string::npos) << comm.status().to_string();
  EXPECT_NE(comm.status().message().find(options.rendezvous_dir), std::string::npos) << comm.status().to_string();
  EXPECT_TRUE(seconds < 10) << "waited " << seconds << " s for a 0.5 s timeout";
}

TEST_F(CommProcesses, EveryOperationMatchesValuesComputedIndependently) {
  for (int world : {2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<Rank> ranks = run(world, "ops", std::chrono::seconds(60));
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(exited_ok(ranks[r])) << "rank " << r << " (status " << ranks[r].status << "):\n" << ranks[r].log;
      EXPECT_NE(ranks[r].log.find("ops ok"), std::string::npos) << ranks[r].log;
    }
  }
}

// The survivors of a rank that exits (or hangs) must fail within the 3 s timeout, naming their
// rank and the operation, and exit; the test allows 20 s for a loaded machine. Each names the
// rank whose connection closed, when one did (a survivor that failed first may exit before
// another notices, so a later one may name it instead), or says a rank (of two: the other) may
// have exited or hung.
// Returns how many survivors named the last rank.
int expect_survivors_report(const std::vector<CommProcesses::Rank>& ranks, double within_s) {
  const int world = static_cast<int>(ranks.size());
  int named_last = 0;
  for (int r = 0; r + 1 < world; ++r) {
    const std::string& log = ranks[r].log;
    EXPECT_TRUE(exited_ok(ranks[r])) << "rank " << r << " (status " << ranks[r].status << "):\n" << log;
    EXPECT_NE(log.find("expected failure"), std::string::npos) << log;
    const std::string who = "rank " + std::to_string(r) + " of " + std::to_string(world) + ": all_reduce_sum";
    EXPECT_NE(log.find(who), std::string::npos) << "no \"" << who << "\" in:\n" << log;
    EXPECT_TRUE(log.find("may have exited or hung") != std::string::npos ||
                log.find("closed its connection") != std::string::npos)
        << log;
    const std::string last = "rank " + std::to_string(world - 1) + " of " + std::to_string(world) +
                             " closed its connection";
    if (log.find(last) != std::string::npos) ++named_last;
    EXPECT_TRUE(ranks[r].seconds < within_s) << "rank " << r << " took " << ranks[r].seconds << " s";
  }
  return named_last;
}

TEST_F(CommProcesses, WhenARankExitsTheOthersFailNamingItTheirRankAndTheOperation) {
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<Rank> ranks = run(world, "exit", std::chrono::seconds(30));
    EXPECT_TRUE(exited_ok(ranks.back())) << ranks.back().log;
    // The first survivor to fail saw the only connection closed by then: the exited rank's.
    EXPECT_GE(expect_survivors_report(ranks, 20.0), 1) << "no survivor named the rank that exited";
  }
}

TEST_F(CommProcesses, WhenARankHangsTheOthersFailAtTheTimeout) {
  // The hanging rank sleeps a minute; it is killed once the others are done.
  std::vector<Rank> ranks = run(3, "hang", std::chrono::seconds(20), /*wait_for=*/2);
  EXPECT_FALSE(ranks.back().done) << "the hanging rank exited on its own:\n" << ranks.back().log;
  expect_survivors_report(ranks, 20.0);
  for (int r = 0; r + 1 < 3; ++r) {
    // The timeout is 3 s: not much sooner (something else failed) and not much later.
    EXPECT_TRUE(ranks[r].seconds >= 2.5) << "rank " << r << " failed after only " << ranks[r].seconds << " s";
  }
}

#endif  // STRATA_HAVE_GLOO

}  // namespace
}  // namespace strata::parallel
