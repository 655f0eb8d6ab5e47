// ModelLimits: absurd dimensions are refused by validate() with the key, the value as written and
// the limit, before anything is sized from them; every published model stays accepted.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "model/config.h"
#include "model/params.h"

namespace strata::model {
namespace {

using json = nlohmann::json;

constexpr const char* kBigSource = "models/big/config.json";

json big_llama_json() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 3,
    "num_attention_heads": 8, "num_key_value_heads": 4, "rms_norm_eps": 1e-05,
    "max_position_embeddings": 4096, "rope_theta": 500000.0
  })");
}

json big_mixtral_json() {
  json j = big_llama_json();
  j["architectures"] = {"MixtralForCausalLM"};
  j["model_type"] = "mixtral";
  j["num_local_experts"] = 8;
  j["num_experts_per_tok"] = 2;
  return j;
}

json qwen3_moe_json() {
  json j = big_llama_json();
  j["architectures"] = {"Qwen3MoeForCausalLM"};
  j["model_type"] = "qwen3_moe";
  j["num_experts"] = 8;
  j["num_experts_per_tok"] = 2;
  j["moe_intermediate_size"] = 64;
  return j;
}

// The error names the source, and each of `words` (key, value as written, limit).
void expect_refused(const json& j, const std::vector<std::string>& words) {
  Result<ModelConfig> c = ModelConfig::from_json(j, kBigSource);
  ASSERT_FALSE(c.ok()) << "accepted " << j.dump();
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().to_string();
  const std::string& m = c.status().message();
  EXPECT_NE(m.find(kBigSource), std::string::npos) << m;
  for (const std::string& w : words) EXPECT_NE(m.find(w), std::string::npos) << "missing '" << w << "' in: " << m;
}

TEST(ModelLimitsTest, AbsurdDimensionsNameTheKeyTheValueAndTheLimit) {
  struct Case {
    const char* key;
    json value;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"hidden_size", 1e15, {"'hidden_size'", "1000000000000000", "65536"}},
      {"vocab_size", int64_t{10000000000}, {"'vocab_size'", "10000000000", "16777216"}},
      {"num_hidden_layers", int64_t{1000000000}, {"'num_hidden_layers'", "1000000000", "1024"}},
      {"num_hidden_layers", int64_t{1} << 32, {"'num_hidden_layers'", "4294967296", "1024"}},
      {"intermediate_size", 4e12, {"'intermediate_size'", "4000000000000", "1048576"}},
      {"max_position_embeddings", int64_t{1} << 40, {"'max_position_embeddings'", "1099511627776"}},
      {"num_attention_heads", 1 << 20, {"'num_attention_heads'", "1048576", "4096"}},
  };
  for (const Case& c : cases) {
    json j = big_llama_json();
    j[c.key] = c.value;
    if (std::string(c.key) == "num_attention_heads") j["head_dim"] = 2;
    expect_refused(j, c.words);
  }
  json m = big_mixtral_json();
  m["num_local_experts"] = 100000000;
  expect_refused(m, {"'num_local_experts'", "100000000", "4096"});
  json q = qwen3_moe_json();
  q["moe_intermediate_size"] = 4e12;
  expect_refused(q, {"'moe_intermediate_size'", "4000000000000", "1048576"});
}

TEST(ModelLimitsTest, IntegersBeyondInt64AreReportedAsWritten) {
  json j = big_llama_json();
  j["hidden_size"] = uint64_t{18446744073709551615u};
  expect_refused(j, {"'hidden_size'", "18446744073709551615", "65536"});
  Result<ModelConfig> c = ModelConfig::from_json(j, kBigSource);
  EXPECT_EQ(c.status().message().find("-1"), std::string::npos) << c.status().message();

  json f = big_llama_json();
  f["vocab_size"] = 1e20;  // integral, but no int64 holds it
  expect_refused(f, {"'vocab_size'", "1e+20", "16777216"});

  json q = qwen3_moe_json();
  q["mlp_only_layers"] = {uint64_t{9223372036854775808u}};
  expect_refused(q, {"'mlp_only_layers'", "9223372036854775808"});
}

TEST(ModelLimitsTest, KeysWithinLimitsWhoseProductIsTooLargeAreRefused) {
  // Every key at its limit: 3 * 65536 * 2^20 * 1024 MLP parameters alone, far past 2^44.
  json j = big_llama_json();
  j["hidden_size"] = ModelLimits::kHiddenSize;
  j["intermediate_size"] = ModelLimits::kIntermediateSize;
  j["num_hidden_layers"] = ModelLimits::kLayers;
  j["vocab_size"] = ModelLimits::kVocabSize;
  j["num_attention_heads"] = 64;
  expect_refused(j, {"parameters", "17592186044416"});

  // 4096 experts in each of 1024 layers: 12.6M tensors.
  json q = qwen3_moe_json();
  q["num_experts"] = ModelLimits::kExperts;
  q["num_hidden_layers"] = ModelLimits::kLayers;
  q["hidden_size"] = 64;
  q["num_attention_heads"] = 2;
  q["num_key_value_heads"] = 2;
  q["moe_intermediate_size"] = 16;
  expect_refused(q, {"tensors", "num_experts 4096", "1048576"});
}

TEST(ModelLimitsTest, TheLargestPublishedShapesAreAccepted) {
  // Llama 3.1 405B (dense), and a large MoE shape in Qwen3-MoE's form.
  json llama = big_llama_json();
  llama.update(json::parse(R"({"vocab_size": 128256, "hidden_size": 16384, "intermediate_size": 53248,
      "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
      "max_position_embeddings": 131072})"));
  Result<ModelConfig> a = ModelConfig::from_json(llama, kBigSource);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(a->num_parameters(), 405853388800);  // the published count of Llama 3.1 405B

  json moe = qwen3_moe_json();
  moe.update(json::parse(R"({"vocab_size": 262144, "hidden_size": 7168, "intermediate_size": 18432,
      "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "head_dim": 128,
      "num_experts": 384, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
      "max_position_embeddings": 262144})"));
  Result<ModelConfig> b = ModelConfig::from_json(moe, kBigSource);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_GT(b->num_parameters(), int64_t{1000} * 1000 * 1000 * 1000);  // over a trillion
  EXPECT_EQ(ParamLayout(*b).num_parameters(), b->num_parameters());
}

TEST(ModelLimitsDeathTest, SizesOfAnUnvalidatedConfigStopInsteadOfWrapping) {
  ModelConfig c = ModelConfig::preset("tiny").value();
  c.vocab_size = int64_t{1} << 40;
  c.hidden_size = int64_t{1} << 30;
  c.num_hidden_layers = 1;
  EXPECT_FALSE(c.validate("test").ok());
  EXPECT_DEATH((void)c.num_parameters(), "overflows int64");
  EXPECT_DEATH((void)ParamLayout{c}, "overflows int64");
}

}  // namespace
}  // namespace strata::model
