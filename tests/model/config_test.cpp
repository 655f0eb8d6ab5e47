#include "model/config.h"
#include "kernels/rope.h"

#include <gtest/gtest.h>

#include <cmath>

#include <filesystem>
#include <fstream>
#include <string>

#include "model/params.h"

namespace strata::model {
namespace {

using json = nlohmann::json;

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
  EXPECT_EQ(c->rope.scaling, kernels::RopeScaling::kNone);
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
  EXPECT_EQ(c->rope.scaling, kernels::RopeScaling::kNone);
}

TEST(ModelConfigTest, RopeParametersWinOverTopLevelRopeTheta) {
  json j = llama_json();
  j["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 250000.0}, {"factor", 16.0},
                          {"low_freq_factor", 2.0}, {"high_freq_factor", 8.0},
                          {"original_max_position_embeddings", 2048}};
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_DOUBLE_EQ(c->rope.theta, 250000.0);
  EXPECT_EQ(c->rope.scaling, kernels::RopeScaling::kLlama3);
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
  EXPECT_EQ(c->rope.scaling, kernels::RopeScaling::kLlama3);
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
  EXPECT_EQ(c->rope.scaling, kernels::RopeScaling::kLlama3);
  EXPECT_DOUBLE_EQ(c->rope.factor, 8.0);
}

TEST(ModelConfigTest, NullRopeScalingMeansNoScaling) {
  json j = llama_json();
  j["rope_scaling"] = nullptr;
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->rope.scaling, kernels::RopeScaling::kNone);
}

TEST(ModelConfigTest, UnknownRopeScalingTypeIsUnimplementedNamingTheKey) {
  json j = llama_json();
  j["rope_scaling"] = {{"type", "su"}, {"factor", 4.0}};
  expect_error(j, StatusCode::kUnimplemented, "rope_scaling.type");

  json k = llama_json();
  k["rope_parameters"] = {{"rope_type", "longrope"}, {"rope_theta", 10000.0}, {"factor", 2.0}};
  expect_error(k, StatusCode::kUnimplemented, "rope_parameters.rope_type");
}

// Linear scaling (position interpolation): read under either key, written back as read, and a
// factor that is not positive is refused by name.
TEST(ModelConfigTest, ReadsLinearRopeScaling) {
  json j = llama_json();
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->rope.scaling, kernels::RopeScaling::kLinear);
  EXPECT_EQ(c->rope.factor, 4.0);
  Result<ModelConfig> again = ModelConfig::from_json(c->to_json(), kSource);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(again->rope.scaling, kernels::RopeScaling::kLinear);
  EXPECT_EQ(again->rope.factor, 4.0);
  j["rope_scaling"]["factor"] = 0.0;
  expect_error(j, StatusCode::kInvalidArgument, "rope_scaling.factor");
}

// Dynamic NTK scaling: read under either key, written back under "type" (which every
// transformers release reads), a factor that is not positive refused by name.
TEST(ModelConfigTest, ReadsDynamicRopeScaling) {
  for (const char* key : {"type", "rope_type"}) {
    json j = llama_json();
    j["rope_scaling"] = {{key, "dynamic"}, {"factor", 2.0}};
    Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_EQ(c->rope.scaling, kernels::RopeScaling::kDynamic);
    EXPECT_EQ(c->rope.factor, 2.0);
    const json written = c->to_json();
    EXPECT_EQ(written["rope_scaling"], json({{"type", "dynamic"}, {"factor", 2.0}}));
    Result<ModelConfig> again = ModelConfig::from_json(written, kSource);
    ASSERT_TRUE(again.ok()) << again.status().to_string();
    EXPECT_EQ(again->rope.scaling, kernels::RopeScaling::kDynamic);
    j["rope_scaling"]["factor"] = -1.0;
    expect_error(j, StatusCode::kInvalidArgument, "rope_scaling.factor");
  }
}

// YaRN as Qwen2.5 and DeepSeek configs write it: read under either key, its optional keys
// (null where a config leaves them to transformers' defaults), written back so that it reads the
// same, and out-of-range keys refused by name.
TEST(ModelConfigTest, ReadsYarnRopeScaling) {
  json j = llama_json();
  j["max_position_embeddings"] = 131072;
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768},
                       {"attention_factor", nullptr}, {"beta_fast", nullptr}};
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->rope.scaling, kernels::RopeScaling::kYarn);
  EXPECT_EQ(c->rope.factor, 4.0);
  EXPECT_EQ(c->rope.original_max_position_embeddings, 32768);
  EXPECT_TRUE(c->rope.truncate);
  EXPECT_DOUBLE_EQ(kernels::rope_attention_factor(c->rope), 0.1 * std::log(4.0) + 1.0);

  json d = llama_json();
  d["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 40.0}, {"mscale", 1.0}, {"mscale_all_dim", 0.707},
                       {"beta_fast", 32}, {"beta_slow", 1}, {"truncate", false}};
  Result<ModelConfig> deep = ModelConfig::from_json(d, kSource);
  ASSERT_TRUE(deep.ok()) << deep.status().to_string();
  EXPECT_EQ(deep->rope.original_max_position_embeddings, 0) << "unset: max_position_embeddings stands for it";
  EXPECT_FALSE(deep->rope.truncate);
  for (const ModelConfig& read : {*c, *deep}) {
    Result<ModelConfig> again = ModelConfig::from_json(read.to_json(), kSource);
    ASSERT_TRUE(again.ok()) << again.status().to_string();
    EXPECT_EQ(again->rope.scaling, kernels::RopeScaling::kYarn);
    std::vector<float> a(64), b(64);
    kernels::RopeConfig ra = read.rope, rb = again->rope;
    ra.max_position_embeddings = read.max_position_embeddings;
    rb.max_position_embeddings = again->max_position_embeddings;
    kernels::rope_inv_freq(a.data(), 128, ra);
    kernels::rope_inv_freq(b.data(), 128, rb);
    EXPECT_EQ(a, b);
    EXPECT_EQ(kernels::rope_attention_factor(ra), kernels::rope_attention_factor(rb));
  }
  // transformers' readings at the edges: no factor is an error, a null truncate does not
  // truncate, an attention factor of 0 would zero cos and sin.
  json no_factor = llama_json();
  no_factor["rope_scaling"] = {{"rope_type", "yarn"}};
  expect_error(no_factor, StatusCode::kInvalidArgument, "rope_scaling.factor");
  json null_truncate = llama_json();
  null_truncate["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}, {"truncate", nullptr}};
  Result<ModelConfig> untruncated = ModelConfig::from_json(null_truncate, kSource);
  ASSERT_TRUE(untruncated.ok()) << untruncated.status().to_string();
  EXPECT_FALSE(untruncated->rope.truncate);
  json zero = llama_json();
  zero["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}, {"attention_factor", 0.0}};
  expect_error(zero, StatusCode::kInvalidArgument, "rope_scaling.attention_factor");
  j["rope_scaling"]["beta_slow"] = -1.0;
  expect_error(j, StatusCode::kInvalidArgument, "rope_scaling.beta_slow");
  j["rope_scaling"]["beta_slow"] = 1.0;
  j["rope_scaling"]["factor"] = 0.0;
  expect_error(j, StatusCode::kInvalidArgument, "rope_scaling.factor");
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

json mixtral_json() {
  return json::parse(R"({
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
    "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
    "max_position_embeddings": 4096, "rope_theta": 1000000.0, "sliding_window": null,
    "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
    "output_router_logits": true, "router_jitter_noise": 0.0, "tie_word_embeddings": false
  })");
}

json qwen_moe_json(bool qwen3) {
  json j = json::parse(R"({
    "hidden_act": "silu", "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 160,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "rope_theta": 1000000.0, "use_sliding_window": false,
    "sliding_window": 4096, "num_experts": 6, "num_experts_per_tok": 2,
    "moe_intermediate_size": 48, "norm_topk_prob": true, "decoder_sparse_step": 1,
    "mlp_only_layers": [2], "router_aux_loss_coef": 0.001, "output_router_logits": false
  })");
  if (qwen3) {
    j["architectures"] = {"Qwen3MoeForCausalLM"};
    j["model_type"] = "qwen3_moe";
    j["head_dim"] = 64;
    j["attention_bias"] = false;
  } else {
    j["architectures"] = {"Qwen2MoeForCausalLM"};
    j["model_type"] = "qwen2_moe";
    j["shared_expert_intermediate_size"] = 80;
  }
  return j;
}

// Qwen3-0.6B's config.json as published (Qwen/Qwen3-0.6B): a dense decoder with per-head q/k
// norms and tied embeddings, 596,049,920 parameters (0.44B without the embedding); it exports
// with model_type qwen3 again.
TEST(ModelConfigTest, ReadsQwen3DenseAsPublished) {
  const json j = json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
  })");
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->architecture, "Qwen3ForCausalLM");
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_FALSE(c->is_moe());
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->sliding_window, 0);
  EXPECT_EQ(c->num_parameters(), 596049920);
  EXPECT_EQ(c->to_json()["model_type"], "qwen3");
  json with_bias = j;
  with_bias["attention_bias"] = true;
  Result<ModelConfig> b = ModelConfig::from_json(with_bias, kSource);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_TRUE(b->attention_bias) << "Qwen3 reads attention_bias (Qwen2 forces it on)";
}

TEST(ModelConfigTest, UnknownArchitectureIsUnimplementedNamingFileAndValue) {
  json j = llama_json();
  j["architectures"] = {"GPTNeoXForCausalLM"};
  j.erase("model_type");
  expect_error(j, StatusCode::kUnimplemented, "GPTNeoXForCausalLM");
  expect_error(j, StatusCode::kUnimplemented, "architectures");
  json k = llama_json();
  k["model_type"] = "gpt_neox";
  expect_error(k, StatusCode::kUnimplemented, "gpt_neox");
}

// DeepSeek-V3's config.json as published (deepseek-ai/DeepSeek-V3; its quantization_config
// left out): latent attention, 256 sigmoid-scored experts in 8 groups with the selection bias,
// an ungated shared expert and three dense layers first.
json deepseek_v3_json() {
  return json::parse(R"({
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": true,
    "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": true, "v_head_dim": 128, "vocab_size": 129280
  })");
}

TEST(ModelConfigTest, ReadsDeepseekV3AsPublishedWithItsMtpModule) {
  json j = deepseek_v3_json();
  {
    // One MTP module, as published: block 61, an MoE block like the layers after the third.
    Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_EQ(c->num_nextn_predict_layers, 1);
    EXPECT_EQ(c->num_blocks(), 62);
    EXPECT_TRUE(c->is_mtp_block(61));
    EXPECT_TRUE(c->is_moe_layer(61));
    EXPECT_EQ(c->num_moe_layers(), 58);  // the model's layers only
    // 682.6B parameters with the module: DeepSeek's 685B (671B + 14B) counts the module's own
    // copies of the embedding and LM head besides (2 x 129280 x 7168 = 1.85B), which it shares.
    EXPECT_GT(c->num_parameters(), int64_t{682'000'000'000});
    EXPECT_LT(c->num_parameters(), int64_t{683'000'000'000});
    const ParamLayout layout(*c);
    EXPECT_EQ(c->num_parameters(), layout.num_parameters());
    EXPECT_EQ(c->num_tensors(), static_cast<int64_t>(layout.tensors().size()));
    ASSERT_NE(layout.find("model.layers.61.eh_proj.weight"), nullptr);
    EXPECT_EQ(layout.find("model.layers.61.eh_proj.weight")->shape, (std::vector<int64_t>{7168, 14336}));
    EXPECT_NE(layout.find("model.layers.61.shared_head.norm.weight"), nullptr);
    EXPECT_NE(layout.find("model.layers.61.mlp.experts.255.down_proj.weight"), nullptr);
    EXPECT_EQ(layout.find("model.layers.61.embed_tokens.weight"), nullptr);  // shared, not a tensor of its own
    EXPECT_EQ(c->to_json()["num_nextn_predict_layers"], 1);
    // Not trained (train.mtp_weight=0): its tensors are frozen, the others not.
    ModelConfig frozen = *c;
    frozen.mtp_loss_weight = 0;
    const ParamLayout kept(frozen);
    EXPECT_TRUE(kept.find("model.layers.61.eh_proj.weight")->frozen);
    EXPECT_TRUE(kept.find("model.layers.61.mlp.gate.weight")->frozen);
    EXPECT_FALSE(kept.find("model.layers.60.mlp.gate.weight")->frozen);
    EXPECT_FALSE(layout.find("model.layers.61.eh_proj.weight")->frozen);
  }
  {
    // More modules follow as further blocks.
    json k = j;
    k["num_nextn_predict_layers"] = 2;
    Result<ModelConfig> c = ModelConfig::from_json(k, kSource);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_EQ(c->num_blocks(), 63);
    EXPECT_NE(ParamLayout(*c).find("model.layers.62.eh_proj.weight"), nullptr);
  }
  j["num_nextn_predict_layers"] = -1;
  expect_error(j, StatusCode::kInvalidArgument, "num_nextn_predict_layers");
  j["num_nextn_predict_layers"] = 0;
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->is_mla());
  EXPECT_EQ(c->head_dim, 192);
  EXPECT_EQ(c->num_key_value_heads, 128);
  EXPECT_EQ(c->q_dim(), 128 * 192);
  EXPECT_EQ(c->att_dim(), 128 * 128);
  EXPECT_EQ(c->rope_dim(), 64);
  EXPECT_EQ(c->num_experts, 256);
  EXPECT_EQ(c->shared_expert_intermediate_size, 2048);
  EXPECT_FALSE(c->shared_expert_gated);
  EXPECT_TRUE(c->router_selection_bias);
  EXPECT_EQ(c->router_scoring, kernels::RouterScoring::kSigmoidThenTopK);
  EXPECT_EQ(c->group_score, kernels::GroupScore::kTopTwoSum);
  EXPECT_EQ(c->n_group, 8);
  EXPECT_EQ(c->topk_group, 4);
  EXPECT_DOUBLE_EQ(c->routed_scale, 2.5);
  EXPECT_EQ(c->num_moe_layers(), 58);
  EXPECT_FALSE(c->is_moe_layer(2));
  EXPECT_TRUE(c->is_moe_layer(3));
  // 671B parameters without the MTP module, as DeepSeek counts them (671B of 685B).
  EXPECT_GT(c->num_parameters(), int64_t{670'000'000'000});
  EXPECT_LT(c->num_parameters(), int64_t{672'000'000'000});
  EXPECT_EQ(c->num_parameters(), ParamLayout(*c).num_parameters());
  EXPECT_EQ(c->num_tensors(), static_cast<int64_t>(ParamLayout(*c).tensors().size()));
  // to_json gives the same model back.
  Result<ModelConfig> again = ModelConfig::from_json(c->to_json(), "again");
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(again->to_json(), c->to_json());
  EXPECT_EQ(again->num_parameters(), c->num_parameters());
}

// DeepSeek-V2-Lite's (deepseek-ai/DeepSeek-V2-Lite): no low-rank q, softmax scores, greedy
// top-6 of 64 experts and two shared ones; its sequence-wise auxiliary loss is refused by name.
TEST(ModelConfigTest, ReadsDeepseekV2LiteAndRefusesItsAuxiliaryLossByName) {
  json j = json::parse(R"({
    "architectures": ["DeepseekV2ForCausalLM"], "aux_loss_alpha": 0.001, "bos_token_id": 100000,
    "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v2", "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1,
    "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": false, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": null,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": true,
    "tie_word_embeddings": false, "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128,
    "vocab_size": 102400
  })");
  expect_error(j, StatusCode::kUnimplemented, "aux_loss_alpha");
  j["aux_loss_alpha"] = 0.0;
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->q_lora_rank, 0);
  EXPECT_EQ(c->shared_expert_intermediate_size, 2 * 1408);
  EXPECT_EQ(c->n_group, 1);
  EXPECT_FALSE(c->router_selection_bias);
  EXPECT_EQ(c->router_scoring, kernels::RouterScoring::kSoftmaxThenTopK);
  // 15.7B parameters, as published.
  EXPECT_GT(c->num_parameters(), int64_t{15'600'000'000});
  EXPECT_LT(c->num_parameters(), int64_t{15'800'000'000});
  EXPECT_EQ(c->num_parameters(), ParamLayout(*c).num_parameters());
  EXPECT_EQ(c->num_tensors(), static_cast<int64_t>(ParamLayout(*c).tensors().size()));
}

TEST(ModelConfigTest, DeepseekKeysOutsideWhatStrataComputesAreRefusedByName) {
  json j = deepseek_v3_json();
  j["num_nextn_predict_layers"] = 0;
  {
    json k = j;
    k["scoring_func"] = "sqrtsoftplus";
    expect_error(k, StatusCode::kUnimplemented, "scoring_func");
  }
  {
    json k = j;
    k["topk_method"] = "random";
    expect_error(k, StatusCode::kUnimplemented, "topk_method");
  }
  {
    json k = j;
    k["attention_bias"] = true;
    expect_error(k, StatusCode::kUnimplemented, "attention_bias");
  }
  {
    json k = j;
    k["n_group"] = 7;  // does not divide 256
    expect_error(k, StatusCode::kInvalidArgument, "n_group");
  }
  {
    json k = j;
    k["topk_group"] = 9;
    expect_error(k, StatusCode::kInvalidArgument, "topk_group");
  }
  {
    json k = j;
    k["qk_rope_head_dim"] = 63;
    expect_error(k, StatusCode::kInvalidArgument, "qk_rope_head_dim");
  }
  {
    json k = j;
    k["kv_lora_rank"] = int64_t{1} << 20;
    expect_error(k, StatusCode::kInvalidArgument, "kv_lora_rank");
  }
  {
    json k = j;
    k["kv_lora_rank"] = 0;
    expect_error(k, StatusCode::kInvalidArgument, "kv_lora_rank");
  }
}

TEST(ModelConfigTest, ArchitectureFollowsModelTypeWhenArchitecturesIsAbsent) {
  json j = mixtral_json();
  j.erase("architectures");
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->architecture, "MixtralForCausalLM");
  EXPECT_TRUE(c->is_moe());
}

TEST(ModelConfigTest, MistralSlidingWindowMustCoverTheSequence) {
  json j = llama_json();
  j["architectures"] = {"MistralForCausalLM"};
  j["model_type"] = "mistral";
  j["sliding_window"] = 1024;
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->sliding_window, 1024);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_TRUE(c->check_sequence_length(1024, kSource).ok());
  Status longer = c->check_sequence_length(1025, kSource);
  EXPECT_EQ(longer.code(), StatusCode::kUnimplemented);
  EXPECT_NE(longer.message().find("sliding_window"), std::string::npos) << longer.to_string();
  EXPECT_NE(longer.message().find(kSource), std::string::npos) << longer.to_string();

  j["sliding_window"] = nullptr;
  c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->sliding_window, 0);
  EXPECT_TRUE(c->check_sequence_length(1 << 20, kSource).ok());
}

TEST(ModelConfigTest, Qwen2HasAttentionBiasesAndIgnoresTheWindowUnlessUsed) {
  json j = llama_json();
  j["architectures"] = {"Qwen2ForCausalLM"};
  j["model_type"] = "qwen2";
  j["use_sliding_window"] = false;
  j["sliding_window"] = 16;
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->attention_bias);
  EXPECT_EQ(c->sliding_window, 0);
  j["use_sliding_window"] = true;
  c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->sliding_window, 16);
}

TEST(ModelConfigTest, ReadsMixtralExpertKeys) {
  Result<ModelConfig> c = ModelConfig::from_json(mixtral_json(), kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->num_experts_per_tok, 2);
  EXPECT_EQ(c->moe_intermediate_size, 96);  // Mixtral experts use intermediate_size
  EXPECT_EQ(c->shared_expert_intermediate_size, 0);
  EXPECT_EQ(c->router_scoring, kernels::RouterScoring::kTopKThenSoftmax);
  EXPECT_DOUBLE_EQ(c->router_aux_loss_coef, 0.02);
  EXPECT_TRUE(c->output_router_logits);
  EXPECT_TRUE(c->uses_mixtral_tensor_names());
  EXPECT_TRUE(c->is_moe_layer(0));
  EXPECT_TRUE(c->is_moe_layer(1));
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->sliding_window, 0);

  const ParamLayout layout(*c);
  EXPECT_NE(layout.find("model.layers.1.block_sparse_moe.gate.weight"), nullptr);
  const TensorSpec* w2 = layout.find("model.layers.0.block_sparse_moe.experts.7.w2.weight");
  ASSERT_NE(w2, nullptr);
  EXPECT_EQ(w2->shape, (std::vector<int64_t>{128, 96}));
  EXPECT_EQ(layout.find("model.layers.0.mlp.gate_proj.weight"), nullptr);
}

TEST(ModelConfigTest, RouterJitterIsUnimplemented) {
  json j = mixtral_json();
  j["router_jitter_noise"] = 0.1;
  expect_error(j, StatusCode::kUnimplemented, "router_jitter_noise");
}

TEST(ModelConfigTest, ReadsQwenMoeKeysAndDenseLayers) {
  for (bool qwen3 : {false, true}) {
    Result<ModelConfig> c = ModelConfig::from_json(qwen_moe_json(qwen3), kSource);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_EQ(c->num_experts, 6);
    EXPECT_EQ(c->moe_intermediate_size, 48);
    EXPECT_EQ(c->shared_expert_intermediate_size, qwen3 ? 0 : 80);
    EXPECT_EQ(c->router_scoring, kernels::RouterScoring::kSoftmaxThenTopK);
    EXPECT_TRUE(c->norm_topk_prob);
    EXPECT_EQ(c->attention_bias, !qwen3);
    EXPECT_EQ(c->qk_norm, qwen3);
    EXPECT_FALSE(c->output_router_logits);
    EXPECT_EQ(c->num_moe_layers(), 3);
    EXPECT_FALSE(c->is_moe_layer(2));  // mlp_only_layers
    EXPECT_EQ(c->dense_mlp_width(), 160);

    const ParamLayout layout(*c);
    EXPECT_NE(layout.find("model.layers.2.mlp.gate_proj.weight"), nullptr);
    EXPECT_NE(layout.find("model.layers.3.mlp.experts.5.down_proj.weight"), nullptr);
    EXPECT_EQ(layout.find("model.layers.2.mlp.gate.weight"), nullptr);
    EXPECT_EQ(layout.find("model.layers.0.mlp.shared_expert_gate.weight") != nullptr, !qwen3);
    EXPECT_EQ(layout.find("model.layers.0.self_attn.q_norm.weight") != nullptr, qwen3);
    EXPECT_EQ(layout.find("model.layers.0.self_attn.q_proj.bias") != nullptr, !qwen3);
    if (qwen3) {
      EXPECT_EQ(layout.find("model.layers.0.self_attn.k_norm.weight")->shape, (std::vector<int64_t>{64}));
      EXPECT_EQ(layout.find("model.layers.0.self_attn.q_proj.weight")->shape, (std::vector<int64_t>{256, 128}));
    }
  }
  // decoder_sparse_step 2: layers 1 and 3 have experts.
  json j = qwen_moe_json(false);
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = json::array();
  Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_FALSE(c->is_moe_layer(0));
  EXPECT_TRUE(c->is_moe_layer(1));
  EXPECT_FALSE(c->is_moe_layer(2));
  EXPECT_TRUE(c->is_moe_layer(3));
  EXPECT_EQ(c->dense_mlp_width(), 160);
}

TEST(ModelConfigTest, BadExpertKeysNameTheKey) {
  json j = mixtral_json();
  j["num_experts_per_tok"] = 9;
  expect_error(j, StatusCode::kInvalidArgument, "num_experts_per_tok");
  json k = qwen_moe_json(true);
  k["mlp_only_layers"] = {7};
  expect_error(k, StatusCode::kInvalidArgument, "mlp_only_layers");
  json m = qwen_moe_json(false);
  m["decoder_sparse_step"] = 0;
  expect_error(m, StatusCode::kInvalidArgument, "decoder_sparse_step");
  json n = qwen_moe_json(false);
  n["router_aux_loss_coef"] = -1.0;
  expect_error(n, StatusCode::kInvalidArgument, "router_aux_loss_coef");
}

TEST(ModelConfigTest, EveryArchitectureRoundTripsAndCountsItsParameters) {
  std::vector<json> configs = {mixtral_json(), qwen_moe_json(false), qwen_moe_json(true)};
  for (const char* arch : {"MistralForCausalLM", "Qwen2ForCausalLM"}) {
    json j = llama_json();
    j["architectures"] = {arch};
    j.erase("model_type");
    configs.push_back(j);
  }
  for (const json& j : configs) {
    Result<ModelConfig> c = ModelConfig::from_json(j, kSource);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    Result<ModelConfig> back = ModelConfig::from_json(c->to_json(), "to_json");
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(back->to_json(), c->to_json()) << c->architecture;
    EXPECT_EQ(back->num_parameters(), c->num_parameters()) << c->architecture;
    EXPECT_EQ(ParamLayout(*c).num_parameters(), c->num_parameters()) << c->architecture;
  }
}

}  // namespace
}  // namespace strata::model
