// train.mtp_weight reaches the model config (ModelConfig::mtp_loss_weight), and the parallelism
// the multi-token prediction modules do not run with is refused naming the key, unless the
// modules are not trained.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "train/trainer.h"
#include "train_test_util.h"

namespace strata {
namespace {

Result<model::ModelConfig> resolve(const std::string& config_path, const std::vector<std::string>& overrides) {
  std::vector<std::string> all = {"model.config=" + config_path};
  all.insert(all.end(), overrides.begin(), overrides.end());
  Result<Config> config = load_train_config("", all);
  if (!config.ok()) return config.status();
  Result<TrainConfig> t = make_train_config(*config);
  if (!t.ok()) return t.status();
  return resolve_model_config(*t);
}

TEST(MtpConfig, TheWeightReachesTheModelAndUnsupportedParallelismIsRefusedByName) {
  model::ModelConfig mc = deepseek_config();
  mc.num_nextn_predict_layers = 1;
  const std::string path = ::testing::TempDir() + "/strata_mtp_config_" + std::to_string(::getpid()) + ".json";
  std::ofstream(path) << mc.to_json().dump();

  Result<model::ModelConfig> plain = resolve(path, {});
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  EXPECT_EQ(plain->num_nextn_predict_layers, 1);
  EXPECT_DOUBLE_EQ(plain->mtp_loss_weight, 0.1);
  Result<model::ModelConfig> weighted = resolve(path, {"train.mtp_weight=0.3"});
  ASSERT_TRUE(weighted.ok()) << weighted.status().to_string();
  EXPECT_DOUBLE_EQ(weighted->mtp_loss_weight, 0.3);

  for (const std::string key : {"parallel.context_parallel", "parallel.expert_parallel"}) {
    Result<model::ModelConfig> refused = resolve(path, {key + "=2"});
    ASSERT_FALSE(refused.ok()) << key;
    EXPECT_NE(refused.status().message().find(key + "=2"), std::string::npos) << refused.status().to_string();
    EXPECT_NE(refused.status().message().find("train.mtp_weight=0"), std::string::npos)
        << refused.status().to_string();
    Result<model::ModelConfig> untrained = resolve(path, {key + "=2", "train.mtp_weight=0"});
    EXPECT_TRUE(untrained.ok()) << key << ": " << untrained.status().to_string();
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace strata
