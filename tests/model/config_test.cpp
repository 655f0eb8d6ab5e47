#include "model/config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "model/params.h"

namespace strata::model {
namespace {

using nlohmann::json;

constexpr const char* kSource = "models/test/config.json";

json llama_json() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 3,
    "num_attention_heads": 8, "num_key_value_heads": 4, "rms_norm_eps": 1e-05,
    "max_position_embeddings": 4096, "tie_word_embeddings": false, "rope_theta": 500000.0
  })");
}

void expect_error(const json& j, StatusCode code, const std::string& key) {
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_FALSE(c.ok()) << "expected an error naming " << key;
  EXPECT_EQ(c.status().code(), code) << c.status().to_string();
  EXPECT_NE(c.status().message().find(kSource), std::string::npos) << c.status().to_string();
  EXPECT_NE(c.status().message().find(key), std::string::npos) << c.status().to_string();
}

TEST(ModelConfigTest, ReadsHuggingFaceKeysWithTopLevelRopeTheta) {
  Result<ModelConfig> c = ModelConfig::from_json(llama_json(), kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->architecture, "LlamaForCausalLM");
  EXPECT_EQ(c->vocab_size, 1000);
  EXPECT_EQ(c->hidden_size, 256);
  EXPECT_EQ(c->intermediate_size, 688);
  EXPECT_EQ(c->num_hidden_layers, 3);
  EXPECT_EQ(c->num_attention_heads, 8);
  EXPECT_EQ(c->num_key_value_heads, 4);
  EXPECT_EQ(c->head_dim, 32);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_EQ(c->max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c->rope.theta, 500000.0);
  EXPECT_FALSE(c->rope.llama3_scaling);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_FALSE(c->attention_bias);
}

TEST(ModelConfigTest, KeyValueHeadsDefaultToAttentionHeads) {
  json j = llama_json();
  j.erase("num_key_value_heads");
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->num_key_value_heads, 8);
}

TEST(ModelConfigTest, ReadsRopeParametersObject) {
  json j = llama_json();
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1000000.0}};
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_DOUBLE_EQ(c->rope.theta, 1000000.0);
  EXPECT_FALSE(c->rope.llama3_scaling);
}

TEST(ModelConfigTest, RopeParametersWinOverTopLevelRopeTheta) {
  json j = llama_json();
  j["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 250000.0}, {"factor", 16.0},
                          {"low_freq_factor", 2.0}, {"high_freq_factor", 8.0},
                          {"original_max_position_embeddings", 2048}};
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_DOUBLE_EQ(c->rope.theta, 250000.0);
  EXPECT_TRUE(c->rope.llama3_scaling);
  EXPECT_DOUBLE_EQ(c->rope.factor, 16.0);
  EXPECT_DOUBLE_EQ(c->rope.low_freq_factor, 2.0);
  EXPECT_DOUBLE_EQ(c->rope.high_freq_factor, 8.0);
  EXPECT_EQ(c->rope.original_max_position_embeddings, 2048);
}

TEST(ModelConfigTest, ReadsLlama3RopeScaling) {
  json j = llama_json();
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 32.0}, {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->rope.llama3_scaling);
  EXPECT_DOUBLE_EQ(c->rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(c->rope.factor, 32.0);
  EXPECT_EQ(c->rope.original_max_position_embeddings, 8192);
}

TEST(ModelConfigTest, ReadsLegacyTypeKeyOfRopeScaling) {
  json j = llama_json();
  j["rope_scaling"] = {{"type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->rope.llama3_scaling);
  EXPECT_DOUBLE_EQ(c->rope.factor, 8.0);
}

TEST(ModelConfigTest, NullRopeScalingMeansNoScaling) {
  json j = llama_json();
  j["rope_scaling"] = nullptr;
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_FALSE(c->rope.llama3_scaling);
}

TEST(ModelConfigTest, UnknownRopeScalingTypeIsUnimplementedNamingTheKey) {
  json j = llama_json();
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}};
  expect_error(j, StatusCode::kUnimplemented, "rope_scaling.type");

  json k = llama_json();
  k["rope_parameters"] = {{"rope_type", "linear"}, {"rope_theta", 10000.0}, {"factor", 2.0}};
  expect_error(k, StatusCode::kUnimplemented, "rope_parameters.rope_type");
}

TEST(ModelConfigTest, HeadsNotDividingHiddenSizeNamesTheKey) {
  json j = llama_json();
  j["num_attention_heads"] = 7;
  j["num_key_value_heads"] = 7;
  expect_error(j, StatusCode::kInvalidArgument, "num_attention_heads");
}

TEST(ModelConfigTest, ExplicitHeadDimAllowsHeadsNotDividingHiddenSize) {
  json j = llama_json();
  j["num_attention_heads"] = 6;
  j["num_key_value_heads"] = 2;
  j["head_dim"] = 64;
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->q_dim(), 384);
  EXPECT_EQ(c->kv_dim(), 128);
}

TEST(ModelConfigTest, KeyValueHeadsNotDividingHeadsNamesTheKey) {
  json j = llama_json();
  j["num_key_value_heads"] = 3;
  expect_error(j, StatusCode::kInvalidArgument, "num_key_value_heads");
}

TEST(ModelConfigTest, NonPositiveSizesNameTheKey) {
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "max_position_embeddings"}) {
    json j = llama_json();
    j[key] = 0;
    expect_error(j, StatusCode::kInvalidArgument, key);
  }
  json j = llama_json();
  j["rms_norm_eps"] = -1.0;
  expect_error(j, StatusCode::kInvalidArgument, "rms_norm_eps");
}

TEST(ModelConfigTest, MissingRequiredKeyIsNotFoundNamingTheKey) {
  json j = llama_json();
  j.erase("hidden_size");
  expect_error(j, StatusCode::kNotFound, "hidden_size");
}

TEST(ModelConfigTest, WrongValueTypeNamesTheKey) {
  json j = llama_json();
  j["intermediate_size"] = "large";
  expect_error(j, StatusCode::kInvalidArgument, "intermediate_size");
  json k = llama_json();
  k["tie_word_embeddings"] = 1;
  expect_error(k, StatusCode::kInvalidArgument, "tie_word_embeddings");
}

TEST(ModelConfigTest, UnsupportedActivationIsUnimplementedNamingTheKey) {
  json j = llama_json();
  j["hidden_act"] = "gelu";
  expect_error(j, StatusCode::kUnimplemented, "hidden_act");
}

TEST(ModelConfigTest, ToJsonRoundTripsThroughFromJson) {
  for (const char* name : {"tiny", "llama3.2-1b", "llama3-8b"}) {
    Result<ModelConfig> preset = ModelConfig::preset(name);
    ASSERT_TRUE(preset.ok()) << preset.status().to_string();
    Result<ModelConfig> back = ModelConfig::from_json(preset->to_json(), name);
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(back->to_json(), preset->to_json()) << name;
    EXPECT_EQ(back->num_parameters(), preset->num_parameters()) << name;
  }
}

TEST(ModelConfigTest, OverridingHiddenSizeOfAPresetRederivesHeadDim) {
  Result<ModelConfig> tiny = ModelConfig::preset("tiny");
  ASSERT_TRUE(tiny.ok());
  json j = tiny->to_json();
  j["hidden_size"] = 256;
  Result<ModelConfig> c = ModelConfig::from_json(j, "preset 'tiny' + overrides");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->head_dim, 64);
}

TEST(ModelConfigTest, TinyPresetIsTheDefaultCpuModel) {
  Result<ModelConfig> c = ModelConfig::preset("tiny");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->vocab_size, 256);
  EXPECT_EQ(c->hidden_size, 128);
  EXPECT_EQ(c->num_hidden_layers, 4);
  EXPECT_EQ(c->num_attention_heads, 4);
  EXPECT_EQ(c->num_key_value_heads, 2);
  EXPECT_EQ(c->intermediate_size, 384);
  EXPECT_EQ(c->max_position_embeddings, 1024);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_TRUE(c->validate("tiny").ok());
}

TEST(ModelConfigTest, UnknownPresetIsNotFound) {
  Result<ModelConfig> c = ModelConfig::preset("gpt-17");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_NE(c.status().message().find("gpt-17"), std::string::npos);
}

TEST(ModelConfigTest, NumParametersMatchesPublishedLlamaSizes) {
  // Published parameter counts of Meta's Llama 3 8B and Llama 3.2 1B (tied embeddings).
  EXPECT_EQ(ModelConfig::preset("llama3-8b")->num_parameters(), 8030261248);
  EXPECT_EQ(ModelConfig::preset("llama3.2-1b")->num_parameters(), 1235814400);
}

TEST(ModelConfigTest, NumParametersMatchesTheParameterLayout) {
  for (bool tied : {false, true}) {
    for (bool bias : {false, true}) {
      ModelConfig c = ModelConfig::preset("tiny").value();
      c.tie_word_embeddings = tied;
      c.attention_bias = bias;
      EXPECT_EQ(ParamLayout(c).num_parameters(), c.num_parameters()) << tied << bias;
    }
  }
}

TEST(ModelConfigTest, FromFileNamesMissingAndMalformedFiles) {
  const std::string missing = std::string(STRATA_BINARY_DIR) + "/no-such-dir/config.json";
  Result<ModelConfig> c = ModelConfig::from_file(missing);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_NE(c.status().message().find(missing), std::string::npos);

  const std::string dir = std::string(STRATA_BINARY_DIR) + "/tests/model_config";
  std::filesystem::create_directories(dir);
  const std::string bad = dir + "/bad.json";
  std::ofstream(bad) << "{\"vocab_size\": 12,";
  Result<ModelConfig> b = ModelConfig::from_file(bad);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find(bad), std::string::npos);

  const std::string good = dir + "/config.json";
  std::ofstream(good) << llama_json().dump();
  Result<ModelConfig> g = ModelConfig::from_file(good);
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_EQ(g->hidden_size, 256);
}

}  // namespace
}  // namespace strata::model
