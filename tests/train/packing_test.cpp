// data.packing and data.eos_id as a run reads them: a bad value is refused naming the key and the
// values it takes, document packing (or data.eval_fraction) without an EOS id is refused naming
// data.eos_id when the config is read, a run with document packing trains and evaluates through
// the engine, and the trainer hands each packed document its own positions and attention.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "core/config.h"
#include "train/train_config.h"
#include "train/trainer.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

class PackingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::fresh_test_dir("strata_packing");
    std::string text;  // documents of one line each: '\n' (byte 10) ends each
    for (int i = 0; i < 120; ++i) text += "document " + std::to_string(i) + " is short " + std::string(i % 9, 'x') + "\n";
    std::ofstream(dir_ / "docs.txt") << text;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The run's TrainConfig; yaml_ keeps its resolved YAML for run_training.
  Result<TrainConfig> config(std::vector<std::string> overrides) {
    std::vector<std::string> all = {"data.paths=[" + (dir_ / "docs.txt").string() + "]",
                                    "run.dir=" + (dir_ / "run").string(),
                                    "train.micro_batch=2",
                                    "train.seq_len=32",
                                    "train.steps=2",
                                    "optim.warmup_steps=1",
                                    "run.log_every=100",
                                    "model.set=[num_hidden_layers=2,hidden_size=64,intermediate_size=96]"};
    all.insert(all.end(), overrides.begin(), overrides.end());
    Result<Config> c = load_train_config("", all);
    if (!c.ok()) return c.status();
    yaml_ = c->to_yaml();
    return make_train_config(*c);
  }

  fs::path dir_;
  std::string yaml_;
};

TEST_F(PackingTest, ABadPackingIsRefusedNamingTheKeyAndTheValues) {
  Result<TrainConfig> bad = config({"data.packing=documents"});
  ASSERT_FALSE(bad.ok());
  const std::string m = bad.status().message();
  EXPECT_NE(m.find("data.packing"), std::string::npos) << m;
  EXPECT_NE(m.find("'documents'"), std::string::npos) << m;
  EXPECT_NE(m.find("concat, document"), std::string::npos) << m;

  Result<TrainConfig> no_eos = config({"data.packing=document"});
  ASSERT_FALSE(no_eos.ok());
  EXPECT_NE(no_eos.status().message().find("data.eos_id"), std::string::npos) << no_eos.status().to_string();

  // Holding out whole documents needs the token that ends them too, known before the run starts.
  Result<TrainConfig> held_out = config({"data.eval_fraction=0.2"});
  ASSERT_FALSE(held_out.ok());
  EXPECT_NE(held_out.status().message().find("'data.eval_fraction'"), std::string::npos) << held_out.status().to_string();
  EXPECT_NE(held_out.status().message().find("data.eos_id"), std::string::npos) << held_out.status().to_string();

  Result<TrainConfig> concat = config({});
  ASSERT_TRUE(concat.ok()) << concat.status().to_string();
  EXPECT_EQ(concat->data_packing, "concat");
}

TEST_F(PackingTest, ADocumentPackedRunTrainsAndEvaluates) {
  Result<TrainConfig> tc = config({"data.packing=document", "data.eos_id=10",
                                   "data.eval_paths=[" + (dir_ / "docs.txt").string() + "]", "train.eval_steps=2"});
  ASSERT_TRUE(tc.ok()) << tc.status().to_string();
  Result<TrainSummary> r = run_training(*tc, yaml_);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->steps_done, 2);
  EXPECT_TRUE(std::isfinite(r->last_loss)) << r->last_loss;
}

// The eval loss of RUN_DIR's metrics (its last eval line).
double eval_loss_of(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::string line;
  double loss = std::nan("");
  while (std::getline(in, line)) {
    const size_t at = line.find("\"eval_loss\":");
    if (at != std::string::npos) loss = std::stod(line.substr(at + 12));
  }
  return loss;
}

// The trainer hands the loader's document positions to the model: packed documents neither see
// each other nor their place in the row. A corpus of one document repeated, a model trained on
// it (concat, rows of 3 documents, so that every position is one it has seen) so that it uses
// what it sees, then its eval loss at lr=0 with rows of 2 and of 3
// whole documents: with document packing every document is alone, so the two are the same loss
// up to rounding; with concat the documents after the first in a row see the ones before (a
// third more of them at 3), and the losses differ, which shows the check can fail. The same holds
// for the training step's loss.
TEST_F(PackingTest, EachPackedDocumentIsAloneWhateverRowItSharesWithOthers) {
  const std::string doc = "strata packs documents\n";  // 23 bytes, '\n' ends it
  const int64_t d = static_cast<int64_t>(doc.size());
  std::string text;
  for (int i = 0; i < 400; ++i) text += doc;
  std::ofstream(dir_ / "same.txt") << text;
  const std::string data = "data.paths=[" + (dir_ / "same.txt").string() + "]";
  const fs::path exported = dir_ / "trained";
  {
    Result<TrainConfig> tc = config({data, "train.steps=30", "optim.lr=0.01", "train.seq_len=" + std::to_string(3 * d),
                                     "run.export=" + exported.string(), "run.dir=" + (dir_ / "train").string()});
    ASSERT_TRUE(tc.ok()) << tc.status().to_string();
    Result<TrainSummary> r = run_training(*tc, yaml_);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
  }
  std::map<std::string, double> loss;
  for (const std::string packing : {"document", "concat"}) {
    for (int64_t docs : {2, 3}) {
      const std::string name = packing + std::to_string(docs);
      Result<TrainConfig> tc = config({data, "model.from=" + exported.string(), "train.steps=1", "optim.lr=0",
                                       "train.seq_len=" + std::to_string(docs * d), "data.packing=" + packing,
                                       "data.eos_id=10", "data.eval_paths=[" + (dir_ / "same.txt").string() + "]",
                                       "train.eval_every=1", "train.eval_steps=2", "run.dir=" + (dir_ / name).string()});
      ASSERT_TRUE(tc.ok()) << tc.status().to_string();
      Result<TrainSummary> r = run_training(*tc, yaml_);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      loss[name] = eval_loss_of(dir_ / name / "metrics.jsonl");
      loss["train " + name] = r->first_loss;  // the step's, at lr=0 on the same weights
      ASSERT_TRUE(std::isfinite(loss[name])) << name;
    }
  }
  const double alone = std::abs(loss["document2"] - loss["document3"]) / loss["document2"];
  const double together = std::abs(loss["concat2"] - loss["concat3"]) / loss["concat2"];
  EXPECT_LE(alone, 1e-5) << loss["document2"] << " against " << loss["document3"];
  EXPECT_GE(together, 1e-3) << loss["concat2"] << " against " << loss["concat3"];
  // Training's micro-batches too (other windows of the same text).
  const double trained_alone = std::abs(loss["train document2"] - loss["train document3"]) / loss["train document2"];
  const double trained_together = std::abs(loss["train concat2"] - loss["train concat3"]) / loss["train concat2"];
  EXPECT_LE(trained_alone, 1e-5) << loss["train document2"] << " against " << loss["train document3"];
  EXPECT_GE(trained_together, 1e-3) << loss["train concat2"] << " against " << loss["train concat3"];
}

}  // namespace
}  // namespace strata
