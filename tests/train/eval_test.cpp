// Evaluation during training (data.eval_paths, train.eval_every, train.eval_steps): the eval
// loss is the training loss's forward on held-out windows, through the same engine and paging.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/writer.h"
#include "core/config.h"
#include "train/train_config.h"
#include "train/trainer.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

class EvalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::fresh_test_dir("strata_eval");
    std::string text;
    for (int i = 0; i < 200; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
    std::ofstream(dir_ / "corpus.txt") << text;
    std::string held_out;
    for (int i = 0; i < 60; ++i) held_out += "a lazy dog sleeps under the brown fox " + std::to_string(i % 5) + "\n";
    std::ofstream(dir_ / "held_out.txt") << held_out;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string corpus() const { return (dir_ / "corpus.txt").string(); }
  std::string held_out() const { return (dir_ / "held_out.txt").string(); }

  // Trains in this process: a small model on the small corpus; returns run_training's status.
  Status train(const std::string& name, std::vector<std::string> overrides) {
    std::vector<std::string> all = {"data.paths=[" + corpus() + "]",
                                    "run.dir=" + (dir_ / name).string(),
                                    "train.micro_batch=2",
                                    "train.seq_len=32",
                                    "train.steps=4",
                                    "optim.warmup_steps=1",
                                    "run.log_every=100",
                                    "model.set=[num_hidden_layers=2,hidden_size=64,intermediate_size=96]"};
    all.insert(all.end(), overrides.begin(), overrides.end());
    Result<Config> config = load_train_config("", all);
    if (!config.ok()) return config.status();
    Result<TrainConfig> tc = make_train_config(*config);
    if (!tc.ok()) return tc.status();
    tc->resume = resume_;
    Result<TrainSummary> r = run_training(*tc, config->to_yaml());
    return r.status();
  }

  // train() resuming run `name` from its latest checkpoint (--resume auto).
  Status train_resumed(const std::string& name, std::vector<std::string> overrides) {
    resume_ = "auto";
    Status st = train(name, std::move(overrides));
    resume_.clear();
    return st;
  }

  // metrics.jsonl's step lines of run `name`: step -> the line (the last one of a step redone).
  std::map<int64_t, nlohmann::json> steps_of(const std::string& name) const {
    std::map<int64_t, nlohmann::json> out;
    std::ifstream in(dir_ / name / "metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("step")) out[j["step"].get<int64_t>()] = j;
    }
    return out;
  }

  fs::path dir_;
  std::string resume_;
};

// At lr = 0 nothing moves, so evaluating the windows the first step trained on (the eval data is
// the training data, read in the same order, one step's worth) gives that step's loss: the same
// forward, summed in the same order. Bitwise, in both recipes.
TEST_F(EvalTest, OnTheTrainingDataAtLrZeroItIsTheFirstStepsLossBitwise) {
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    const std::string name = std::string("lr0_") + precision;
    ASSERT_TRUE(train(name, {"optim.lr=0", "train.grad_accum=3", "data.eval_paths=[" + corpus() + "]",
                             "train.eval_every=2", "train.eval_steps=3", std::string("train.precision=") + precision})
                    .ok());
    const auto steps = steps_of(name);
    ASSERT_EQ(steps.size(), 4u);
    const double first = steps.at(1)["loss"].get<double>();
    for (int64_t s : {2, 4}) {
      ASSERT_TRUE(steps.at(s).contains("eval_loss")) << steps.at(s).dump();
      EXPECT_EQ(steps.at(s)["eval_loss"].get<double>(), first) << "step " << s;
      EXPECT_DOUBLE_EQ(steps.at(s)["eval_ppl"].get<double>(), std::exp(first));
    }
    // Only the steps train.eval_every names, and the last.
    EXPECT_FALSE(steps.at(1).contains("eval_loss"));
    EXPECT_FALSE(steps.at(3).contains("eval_loss"));
  }
}

// Evaluating changes nothing of training: the losses with and without evaluations are the same
// bits. And evaluation pages as training does: under budgets that push the weights through host
// memory and nvme, the eval losses are the roomy run's bits.
TEST_F(EvalTest, ChangesNoTrainingBitAndTightBudgetsEvaluateAsRoomyOnes) {
  const std::vector<std::string> eval = {"data.eval_paths=[" + held_out() + "]", "train.eval_every=1",
                                         "train.eval_steps=4", "train.grad_accum=2"};
  ASSERT_TRUE(train("plain", {"train.grad_accum=2"}).ok());
  std::vector<std::string> roomy = eval;
  roomy.insert(roomy.end(), {"memory.device=256MiB", "memory.host=256MiB"});
  ASSERT_TRUE(train("roomy", roomy).ok());
  std::vector<std::string> tight = eval;
  tight.insert(tight.end(), {"memory.device=1200KiB", "memory.host=1300KiB",
                             "memory.nvme.path=" + (dir_ / "nvme").string(), "memory.nvme.size=16MiB",
                             "memory.offload_activations=true"});
  ASSERT_TRUE(train("tight", tight).ok());
  const auto plain = steps_of("plain"), a = steps_of("roomy"), b = steps_of("tight");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (int64_t s = 1; s <= 4; ++s) {
    EXPECT_EQ(plain.at(s)["loss"].get<double>(), a.at(s)["loss"].get<double>()) << "step " << s;
    EXPECT_EQ(a.at(s)["loss"].get<double>(), b.at(s)["loss"].get<double>()) << "step " << s;
    ASSERT_TRUE(a.at(s).contains("eval_loss") && b.at(s).contains("eval_loss"));
    EXPECT_EQ(a.at(s)["eval_loss"].get<double>(), b.at(s)["eval_loss"].get<double>()) << "step " << s;
  }
  // The tight run really paged.
  EXPECT_GT(b.at(1)["nvme_bytes"].get<uint64_t>(), 0u);
  // The held-out loss is a loss of this model on other text: finite, and it falls as it trains.
  const double e1 = a.at(1)["eval_loss"].get<double>(), e4 = a.at(4)["eval_loss"].get<double>();
  EXPECT_TRUE(std::isfinite(e1) && e4 < e1) << e1 << " -> " << e4;
}

// ckpt.keep_best: CKPT_DIR/best names the step with the lowest eval loss of the run, with that
// loss, and keep_last=1 does not remove it; a resumed run only replaces it with a lower one.
// The same for a mixture-of-experts model, whose experts page in as the router picks them
// (forward only: no gradients, no routing statistics), and with the optimizer overlapped with
// backward, whose updates must be done before an evaluation reads the weights.
TEST_F(EvalTest, MoeAndOverlappedRunsEvaluateUnderTightBudgetsAsRoomyOnes) {
  const std::vector<std::string> eval = {"data.eval_paths=[" + held_out() + "]", "train.eval_every=2",
                                         "train.eval_steps=3"};
  const std::vector<std::vector<std::string>> variants = {
      {"model.set=[num_hidden_layers=2,hidden_size=64,model_type=mixtral,num_local_experts=4,"
       "num_experts_per_tok=2,intermediate_size=48]"},
      {"optim.overlap_backward=true", "optim.grad_clip=0"}};
  for (size_t v = 0; v < variants.size(); ++v) {
    SCOPED_TRACE(variants[v][0]);
    std::vector<std::string> roomy = eval, tight = eval;
    roomy.insert(roomy.end(), variants[v].begin(), variants[v].end());
    tight.insert(tight.end(), variants[v].begin(), variants[v].end());
    roomy.insert(roomy.end(), {"memory.device=256MiB", "memory.host=256MiB"});
    tight.insert(tight.end(), {"memory.device=1600KiB", "memory.host=1700KiB",
                               "memory.nvme.path=" + (dir_ / ("nvme" + std::to_string(v))).string(),
                               "memory.nvme.size=16MiB"});
    const std::string a_name = "roomy" + std::to_string(v), b_name = "tight" + std::to_string(v);
    Status a_ok = train(a_name, roomy);
    ASSERT_TRUE(a_ok.ok()) << a_ok.to_string();
    Status b_ok = train(b_name, tight);
    ASSERT_TRUE(b_ok.ok()) << b_ok.to_string();
    const auto a = steps_of(a_name), b = steps_of(b_name);
    ASSERT_EQ(a.size(), 4u);
    ASSERT_EQ(b.size(), 4u);
    for (int64_t s : {2, 4}) {
      ASSERT_TRUE(a.at(s).contains("eval_loss") && b.at(s).contains("eval_loss"));
      EXPECT_TRUE(std::isfinite(a.at(s)["eval_loss"].get<double>()));
      EXPECT_EQ(a.at(s)["eval_loss"].get<double>(), b.at(s)["eval_loss"].get<double>()) << "step " << s;
      EXPECT_EQ(a.at(s)["loss"].get<double>(), b.at(s)["loss"].get<double>()) << "step " << s;
    }
    EXPECT_GT(b.at(2)["moved_bytes"].get<uint64_t>(), 0u) << "the tight run did not page";
  }
}

TEST_F(EvalTest, KeepBestNamesAndKeepsTheLowestEvalLossAcrossAResume) {
  const std::vector<std::string> common = {"data.eval_paths=[" + held_out() + "]", "train.eval_every=1",
                                           "train.eval_steps=2", "ckpt.keep_best=true", "ckpt.keep_last=1",
                                           "ckpt.every=4", "optim.lr=0.02"};
  std::vector<std::string> first = common;
  first.push_back("train.steps=4");
  ASSERT_TRUE(train("best", first).ok());
  // Resumed with a learning rate far too high, the eval loss rises: the best stays an older
  // step than the last, which keep_last=1 alone would remove.
  std::vector<std::string> resumed = common;
  resumed.insert(resumed.end(), {"train.steps=8", "optim.lr=0.5", "optim.schedule=constant"});
  Status again = train_resumed("best", resumed);
  ASSERT_TRUE(again.ok()) << again.to_string();
  const auto steps = steps_of("best");
  ASSERT_EQ(steps.size(), 8u);
  int64_t argmin = 0;
  double lowest = std::numeric_limits<double>::infinity();
  for (const auto& [step, j] : steps) {
    ASSERT_TRUE(j.contains("eval_loss")) << j.dump();
    if (j["eval_loss"].get<double>() < lowest) lowest = j["eval_loss"].get<double>(), argmin = step;
  }
  std::ifstream in(dir_ / "best" / "checkpoints" / "best");
  std::string name, key;
  double saved = 0;
  ASSERT_TRUE(std::getline(in, name) && (in >> key >> saved)) << "no readable CKPT_DIR/best";
  EXPECT_EQ(name, "step-" + std::to_string(argmin));
  EXPECT_EQ(key, "eval_loss");
  EXPECT_EQ(saved, lowest);
  EXPECT_TRUE(fs::exists(dir_ / "best" / "checkpoints" / name / "manifest.json")) << name;
  EXPECT_TRUE(fs::exists(dir_ / "best" / "checkpoints" / "step-8" / "manifest.json"));
  EXPECT_LE(argmin, 4) << "the resumed steps' eval losses were meant to rise";
  // keep_last=1 keeps the last and the best, nothing else.
  std::set<std::string> kept;
  for (const auto& e : fs::directory_iterator(dir_ / "best" / "checkpoints"))
    if (e.is_directory()) kept.insert(e.path().filename().string());
  EXPECT_EQ(kept, (std::set<std::string>{name, "step-8"}));
}

// A run resumed from before the step CKPT_DIR/best names redoes that branch: its first
// evaluation becomes the new best, whatever the old branch's loss was.
TEST_F(EvalTest, ResumingFromBeforeTheBestStepStartsANewBest) {
  const std::vector<std::string> common = {"data.eval_paths=[" + held_out() + "]", "train.eval_every=1",
                                           "train.eval_steps=2", "ckpt.keep_best=true", "ckpt.keep_last=0",
                                           "ckpt.every=2", "optim.lr=0.02", "train.steps=6"};
  ASSERT_TRUE(train("redo", common).ok());
  ASSERT_EQ(ckpt::read_best_step((dir_ / "redo" / "checkpoints").string()), "step-6");
  resume_ = (dir_ / "redo" / "checkpoints" / "step-2").string();
  std::vector<std::string> again = common;
  again.push_back("optim.lr=0.5");  // the redone steps' evaluations get worse than the old branch's
  Status st = train("redo", again);
  resume_.clear();
  ASSERT_TRUE(st.ok()) << st.to_string();
  const auto steps = steps_of("redo");  // the redone steps' lines come last
  std::ifstream in(dir_ / "redo" / "checkpoints" / "best");
  std::string name, key;
  double saved = 0;
  ASSERT_TRUE(std::getline(in, name) && (in >> key >> saved));
  EXPECT_EQ(name, "step-3") << "the first evaluation after the resume";
  EXPECT_EQ(saved, steps.at(3)["eval_loss"].get<double>());
}

TEST_F(EvalTest, KeysWithoutEvalDataAndEvalDataTooSmallAreRefused) {
  Status no_data = train("no_data", {"train.eval_every=5"});
  ASSERT_FALSE(no_data.ok());
  EXPECT_NE(no_data.message().find("data.eval_paths is empty"), std::string::npos) << no_data.to_string();
  EXPECT_NE(no_data.message().find("train.eval_every"), std::string::npos) << no_data.to_string();

  std::ofstream(dir_ / "tiny.txt") << "too short for a window";
  Status small = train("small", {"data.eval_paths=[" + (dir_ / "tiny.txt").string() + "]"});
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.message().find("data.eval_paths"), std::string::npos) << small.to_string();
  EXPECT_FALSE(fs::exists(dir_ / "small" / "metrics.jsonl")) << "a refused start writes no run dir";
}

// data.eval_fraction: evaluations on documents of data.paths held out of training (the split
// itself is tested in tests/data/document_split_test.cpp); it and data.eval_paths exclude each
// other, and it needs the token that ends a document.
TEST_F(EvalTest, AHeldOutFractionOfTheDocumentsIsEvaluated) {
  ASSERT_TRUE(train("fraction", {"data.eval_fraction=0.2", "data.eos_id=10", "train.eval_steps=2"}).ok());
  const std::map<int64_t, nlohmann::json> steps = steps_of("fraction");
  ASSERT_EQ(steps.count(4), 1u);
  ASSERT_TRUE(steps.at(4).contains("eval_loss")) << steps.at(4).dump();
  EXPECT_TRUE(std::isfinite(steps.at(4)["eval_loss"].get<double>()));

  Status both = train("both", {"data.eval_fraction=0.2", "data.eos_id=10", "data.eval_paths=[" + held_out() + "]"});
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.message().find("data.eval_fraction"), std::string::npos) << both.to_string();
  EXPECT_NE(both.message().find("data.eval_paths"), std::string::npos) << both.to_string();

  Status no_eos = train("no_eos", {"data.eval_fraction=0.2"});
  ASSERT_FALSE(no_eos.ok());
  EXPECT_NE(no_eos.message().find("data.eos_id"), std::string::npos) << no_eos.to_string();
}

}  // namespace
}  // namespace strata
