// Goodput: the parts of a run's wall time sum to it, none is negative, and each lands where it
// belongs (checkpoint stalls with periodic saves, restart for steps a previous run had done).
#include "train/goodput.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "train/train_config.h"
#include "train/planning.h"
#include "train/trainer.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

TEST(GoodputTest, PartsSumToTheWallTimeAndIdleIsTheRest) {
  const auto before = std::chrono::steady_clock::now();
  GoodputAccountant g;
  {
    GoodputAccountant::Timer t = g.time(GoodputPart::kCompute);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  g.add(GoodputPart::kMemoryStall, 0.005);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // nobody's: idle
  const GoodputReport r = g.report();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - before).count();
  double sum = 0;
  for (double s : r.seconds) {
    EXPECT_GE(s, 0.0);
    sum += s;
  }
  EXPECT_NEAR(sum, r.wall_s, 1e-6);
  EXPECT_LE(r.wall_s, wall);
  EXPECT_GE(r[GoodputPart::kCompute], 0.030);
  EXPECT_GE(r[GoodputPart::kIdle], 0.010);
  EXPECT_NEAR(r[GoodputPart::kMemoryStall], 0.005, 1e-9);
  EXPECT_GT(r.goodput(), 0.0);
  EXPECT_LT(r.goodput(), 1.0);
}

TEST(GoodputTest, PartsTimedBeyondTheWallClockLeaveNoNegativeIdle) {
  GoodputAccountant g;
  g.add(GoodputPart::kCompute, 100);  // e.g. a stall measured on another thread
  const GoodputReport r = g.report();
  EXPECT_EQ(r[GoodputPart::kIdle], 0.0);
  EXPECT_NEAR(r.wall_s, 100, 1e-6);
  EXPECT_EQ(r.goodput(), 1.0);
}

TEST(GoodputTest, LineAndEventNameEveryPart) {
  GoodputReport r;
  r.wall_s = 48.0;
  r.seconds = {41.2, 3.1, 1.0, 2.2, 0.0, 0.1, 0.0, 0.0, 0.4};
  EXPECT_EQ(format_goodput_line(r),
            "goodput 85.8%: compute 41.2 s, memory stalls 3.1 s, checkpoints 1.0 s, start-up 2.2 s, restart 0 s, "
            "data 0.1 s, export 0 s, evaluation 0 s, idle 0.4 s of 48.0 s");
  const nlohmann::json j = goodput_json(r);
  EXPECT_EQ(j["event"], "goodput");
  EXPECT_FALSE(j.contains("step"));
  EXPECT_EQ(j["compute_s"], 41.2);
  EXPECT_EQ(j["memory_stall_s"], 3.1);
  EXPECT_EQ(j["idle_s"], 0.4);
  EXPECT_EQ(j["wall_s"], 48.0);
}

TEST(GoodputTest, HighestRecordedStepSkipsEventsAndTornLines) {
  const fs::path p = fs::path(::testing::TempDir()) / ("strata_goodput_" + std::to_string(::getpid()) + ".jsonl");
  std::ofstream(p) << "{\"step\":3}\n{\"step\":7}\n{\"event\":\"goodput\",\"wall_s\":1}\n{\"step\":5}\n{\"step\":9";
  EXPECT_EQ(highest_recorded_step(p.string()), 7);
  EXPECT_EQ(highest_recorded_step((p.string() + ".missing")), 0);
  fs::remove(p);
}

class GoodputRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::fresh_test_dir("strata_goodput");
    std::string text;
    for (int i = 0; i < 200; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
    std::ofstream(dir_ / "corpus.txt") << text;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Trains in this process (the embedded default's budgets, a smaller model on a small corpus);
  // *wall_s: the call's wall time, measured here.
  Result<TrainSummary> train(const std::string& run_dir, std::vector<std::string> overrides, const std::string& resume,
                             double* wall_s) {
    std::vector<std::string> all = {"data.paths=[" + (dir_ / "corpus.txt").string() + "]",
                                    "run.dir=" + run_dir,
                                    "train.micro_batch=2",
                                    "train.seq_len=32",
                                    "train.steps=80",
                                    "optim.warmup_steps=2",
                                    "run.log_every=100",
                                    "model.set=[num_hidden_layers=2,hidden_size=64,intermediate_size=96]"};
    all.insert(all.end(), overrides.begin(), overrides.end());
    Result<Config> config = load_train_config("", all);
    EXPECT_TRUE(config.ok()) << config.status().message();
    Result<TrainConfig> tc = make_train_config(*config);
    EXPECT_TRUE(tc.ok()) << tc.status().message();
    tc->resume = resume;
    const auto start = std::chrono::steady_clock::now();
    Result<TrainSummary> r = run_training(*tc, config->to_yaml());
    *wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return r;
  }

  // The goodput event: the last line of the run's metrics.jsonl.
  static nlohmann::json goodput_of(const std::string& run_dir) {
    std::ifstream in(fs::path(run_dir) / "metrics.jsonl");
    std::string line, last;
    while (std::getline(in, line)) last = line;
    return nlohmann::json::parse(last, nullptr, /*allow_exceptions=*/false);
  }

  // Every part is >= 0, and they sum to wall_s, which is the run's wall time within 1%.
  static void expect_whole(const nlohmann::json& g, double measured_wall_s) {
    ASSERT_TRUE(g.is_object() && g.value("event", "") == "goodput") << g.dump();
    double sum = 0;
    for (const char* part :
         {"compute_s", "memory_stall_s", "checkpoint_s", "startup_s", "restart_s", "data_s", "export_s", "eval_s", "idle_s"}) {
      ASSERT_TRUE(g.contains(part)) << part << " missing: " << g.dump();
      const double s = g[part].get<double>();
      EXPECT_TRUE(s >= 0) << part << " = " << s;
      sum += s;
    }
    const double wall = g["wall_s"].get<double>();
    EXPECT_TRUE(std::abs(sum - wall) <= 0.01 * wall) << "parts sum to " << sum << " s of " << wall << " s";
    EXPECT_TRUE(std::abs(wall - measured_wall_s) <= 0.01 * measured_wall_s)
        << "goodput's wall time " << wall << " s, measured " << measured_wall_s << " s";
    EXPECT_GT(g["startup_s"].get<double>(), 0.0);
  }

  fs::path dir_;
};

TEST_F(GoodputRunTest, APlainRunAccountsItsWholeWallTime) {
  const std::string run_dir = (dir_ / "plain").string();
  double wall = 0;
  const Result<TrainSummary> trained = train(run_dir, {}, "", &wall);
  ASSERT_TRUE(trained.ok()) << trained.status().message();
  const nlohmann::json g = goodput_of(run_dir);
  expect_whole(g, wall);
  EXPECT_EQ(trained->goodput.wall_s, g["wall_s"].get<double>()) << "the caller gets the numbers metrics.jsonl has";
  EXPECT_GT(g["compute_s"].get<double>(), 0.0);
  EXPECT_EQ(g["restart_s"].get<double>(), 0.0) << "a run that continues none redoes nothing";
  EXPECT_EQ(g["checkpoint_s"].get<double>(), 0.0) << "no save, nothing to wait for";
  EXPECT_EQ(g["export_s"].get<double>(), 0.0);
}

// metrics.jsonl's model_tflops is the step's tokens/s at the model's FLOPs per token (6N +
// 12*L*H*T, planning.h), which `strata bench train-gpu` reports as the run's TFLOP/s.
TEST_F(GoodputRunTest, EveryStepRecordsItsModelFlopRate) {
  const std::string run_dir = (dir_ / "flops").string();
  double wall = 0;
  ASSERT_TRUE(train(run_dir, {"train.steps=3"}, "", &wall).ok());
  Result<Config> config = load_train_config(
      "", {"train.seq_len=32", "model.set=[num_hidden_layers=2,hidden_size=64,intermediate_size=96]"});
  ASSERT_TRUE(config.ok()) << config.status().message();
  Result<TrainConfig> tc = make_train_config(*config);
  ASSERT_TRUE(tc.ok()) << tc.status().message();
  Result<model::ModelConfig> mc = resolve_model_config(*tc);
  ASSERT_TRUE(mc.ok()) << mc.status().message();
  const double flops_per_token = model_flops_per_token(*mc, 32);
  std::ifstream in(fs::path(run_dir) / "metrics.jsonl");
  std::string line;
  int steps = 0;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("step")) continue;
    ++steps;
    const double expected = j["tokens_per_s"].get<double>() * flops_per_token / 1e12;
    EXPECT_GT(expected, 0.0) << line;
    EXPECT_TRUE(std::abs(j["model_tflops"].get<double>() - expected) <= 1e-12 * expected) << line;
  }
  EXPECT_EQ(steps, 3);
}

TEST_F(GoodputRunTest, PeriodicSavesAreCheckpointTimeAndAResumeRedoingStepsIsRestart) {
  const std::string run_dir = (dir_ / "run").string();
  double wall = 0;
  ASSERT_TRUE(train(run_dir, {"ckpt.every=20", "ckpt.keep_last=5"}, "", &wall).ok());
  const nlohmann::json first = goodput_of(run_dir);
  expect_whole(first, wall);
  EXPECT_GT(first["compute_s"].get<double>(), 0.0);
  EXPECT_GT(first["checkpoint_s"].get<double>(), 0.0);
  EXPECT_EQ(first["restart_s"].get<double>(), 0.0);

  // From step 20 in the same run.dir: steps 21-80 were recorded by the first run and are done again.
  const std::string step20 = (fs::path(run_dir) / "checkpoints" / "step-20").string();
  const Result<TrainSummary> again = train(run_dir, {"ckpt.dir=" + (dir_ / "again").string()}, step20, &wall);
  ASSERT_TRUE(again.ok()) << again.status().message();
  const nlohmann::json resumed = goodput_of(run_dir);
  expect_whole(resumed, wall);
  EXPECT_GT(resumed["restart_s"].get<double>(), 0.0);
  EXPECT_EQ(resumed["compute_s"].get<double>(), 0.0) << "every step of the resumed run was done before";
}

}  // namespace
}  // namespace strata
