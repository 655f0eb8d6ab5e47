// data.packing and data.eos_id as a run reads them: a bad value is refused naming the key and the
// values it takes, document packing (or data.eval_fraction) without an EOS id is refused naming
// data.eos_id when the config is read, and a run
// with document packing trains and evaluates through the engine.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/config.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

class PackingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("strata_packing_" + std::to_string(::getpid()) + "_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
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

}  // namespace
}  // namespace strata
