// read_peft_adapter_config on adapter_config.json files as PEFT writes them: target_modules as a
// list of module names (matched by suffix) or as one expression the whole module name must match
// (PEFT's re.fullmatch), the expressions strata itself writes among them; and the refusals, each
// naming the file and the key.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include "model/config.h"
#include "model/lora.h"
#include "model/params.h"
#include "model/peft_io.h"
#include "test_util.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

class PeftConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::fresh_test_dir("peft_config");
  }
  void TearDown() override { fs::remove_all(dir_); }

  // adapter_config.json with rank 8, alpha 16 and `targets` as target_modules (and `extra` keys).
  Result<LoraConfig> read(const nlohmann::json& targets, const nlohmann::json& extra = nlohmann::json::object()) {
    nlohmann::json j = {{"peft_type", "LORA"}, {"r", 8}, {"lora_alpha", 16}, {"target_modules", targets}};
    for (const auto& [k, v] : extra.items()) j[k] = v;
    std::ofstream(dir_ / "adapter_config.json") << j.dump();
    return read_peft_adapter_config(dir_.string());
  }
  uint32_t targets_of(const nlohmann::json& targets) {
    Result<LoraConfig> c = read(targets);
    EXPECT_TRUE(c.ok()) << targets.dump() << ": " << c.status().to_string();
    return c.ok() ? c->targets : 0;
  }

  fs::path dir_;
};

TEST_F(PeftConfigTest, ListsNameModulesAndMixtralsExpertNamesMeanTheExperts) {
  EXPECT_EQ(targets_of({"q_proj", "v_proj"}), kLoraQ | kLoraV);
  EXPECT_EQ(targets_of({"w1", "w2", "w3", "o_proj"}), kLoraExperts | kLoraO);
  EXPECT_EQ(targets_of("all-linear"), kLoraQ | kLoraK | kLoraV | kLoraO | kLoraGate | kLoraUp | kLoraDown);
  Result<LoraConfig> c = read({"q_proj", "lm_head"});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("lm_head"), std::string::npos) << c.status().to_string();
}

TEST_F(PeftConfigTest, ExpressionsAdaptTheModulesTheirWholeNameMatches) {
  EXPECT_EQ(targets_of(".*\\.(q_proj|v_proj)"), kLoraQ | kLoraV);
  EXPECT_EQ(targets_of("model\\.layers\\.\\d+\\.self_attn\\.[qkvo]_proj"), kLoraQ | kLoraK | kLoraV | kLoraO);
  // A group inside an alternative: the routed experts' projections, and the attention's.
  EXPECT_EQ(targets_of(".*\\.mlp\\.experts\\.\\d+\\.(gate_proj|up_proj|down_proj)|.*self_attn\\.(q_proj|k_proj)"),
            kLoraExperts | kLoraQ | kLoraK);
  // Mixtral's experts; Qwen2-MoE's shared expert (gate/up/down_proj in an MoE layer).
  EXPECT_EQ(targets_of(".*block_sparse_moe\\.experts\\.\\d+\\.(w1|w2|w3)"), kLoraExperts);
  EXPECT_EQ(targets_of(".*mlp\\.shared_expert\\.(gate_proj|up_proj)"), kLoraGate | kLoraUp);
  // A name without the layers' path matches no whole module name, as in PEFT.
  Result<LoraConfig> c = read("q_proj");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("matches none"), std::string::npos) << c.status().to_string();
  EXPECT_NE(c.status().message().find("target_modules"), std::string::npos) << c.status().to_string();
  // Python's named groups are not ECMAScript: refused, naming the key.
  c = read("(?P<m>.*q_proj)");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("cannot read"), std::string::npos) << c.status().to_string();
}

// What strata writes for an MoE model (one expression listing the adapted modules) reads back as
// the same adapters.
TEST_F(PeftConfigTest, TheExpressionStrataWritesReadsBackAsItsTargets) {
  for (const uint32_t targets : {kLoraQ | kLoraV | kLoraExperts, kLoraO | kLoraGate | kLoraUp | kLoraDown | kLoraExperts,
                                 uint32_t{kLoraExperts}}) {
    for (const char* arch : {"MixtralForCausalLM", "Qwen2MoeForCausalLM"}) {
      nlohmann::json j = {{"architectures", {arch}}, {"vocab_size", 64}, {"hidden_size", 32},
                          {"intermediate_size", 48}, {"num_hidden_layers", 2}, {"num_attention_heads", 2},
                          {"num_key_value_heads", 1}, {"max_position_embeddings", 64}};
      if (std::string(arch) == "MixtralForCausalLM") {
        j["num_local_experts"] = 4;
        j["num_experts_per_tok"] = 2;
      } else {
        j["num_experts"] = 4;
        j["num_experts_per_tok"] = 2;
        j["moe_intermediate_size"] = 16;
        j["shared_expert_intermediate_size"] = 24;
      }
      Result<ModelConfig> config = ModelConfig::from_json(j, "test");
      ASSERT_TRUE(config.ok()) << config.status().to_string();
      config->lora.rank = 4;
      config->lora.targets = targets;
      const ParamLayout layout(*config);
      const fs::path out = dir_ / "written";
      fs::remove_all(out);
      const Status st = export_peft_adapter(out.string(), layout, [](const TensorSpec& t, float* out) {
        std::fill(out, out + t.numel, 0.0f);
        return Status::OK();
      });
      ASSERT_TRUE(st.ok()) << st.to_string();
      Result<LoraConfig> back = read_peft_adapter_config(out.string());
      ASSERT_TRUE(back.ok()) << back.status().to_string();
      // The same adapters (targets that adapt nothing in this model, as gate_proj in Mixtral's
      // layers, may read back unset).
      ModelConfig again = *config;
      again.lora.targets = back->targets;
      const auto adapters = [](const ParamLayout& l) {
        std::vector<std::string> names;
        for (const TensorSpec& t : l.tensors())
          if (t.adapts >= 0) names.push_back(t.name);
        return names;
      };
      EXPECT_EQ(adapters(ParamLayout(again)), adapters(layout)) << arch << " targets " << targets;
      EXPECT_FALSE(adapters(layout).empty());
    }
  }
}

TEST_F(PeftConfigTest, WhatStrataDoesNotComputeIsRefusedNamingTheKey) {
  for (const char* key : {"use_dora", "use_rslora"}) {
    Result<LoraConfig> c = read({"q_proj"}, {{key, true}});
    ASSERT_FALSE(c.ok()) << key;
    EXPECT_NE(c.status().message().find(key), std::string::npos) << c.status().to_string();
  }
  Result<LoraConfig> c = read({"q_proj"}, {{"layers_to_transform", {0}}});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("layers_to_transform"), std::string::npos) << c.status().to_string();
}

}  // namespace
}  // namespace strata::model
