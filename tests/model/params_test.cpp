#include "model/params.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace strata::model {
namespace {

ModelConfig tiny(bool tied, bool bias) {
  ModelConfig c = ModelConfig::preset("tiny").value();
  c.tie_word_embeddings = tied;
  c.attention_bias = bias;
  return c;
}

TEST(ParamLayoutTest, TensorsAreInFirstUseOrderWithHuggingFaceNames) {
  const ParamLayout layout(tiny(false, false));
  const auto& t = layout.tensors();
  ASSERT_EQ(t.size(), 1u + 4u * 9u + 2u);
  EXPECT_EQ(t.front().name, "model.embed_tokens.weight");
  const std::vector<std::string> layer0 = {
      "model.layers.0.input_layernorm.weight",  "model.layers.0.self_attn.q_proj.weight",
      "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
      "model.layers.0.self_attn.o_proj.weight", "model.layers.0.post_attention_layernorm.weight",
      "model.layers.0.mlp.gate_proj.weight",    "model.layers.0.mlp.up_proj.weight",
      "model.layers.0.mlp.down_proj.weight"};
  for (size_t i = 0; i < layer0.size(); ++i) EXPECT_EQ(t[1 + i].name, layer0[i]);
  EXPECT_EQ(t[t.size() - 2].name, "model.norm.weight");
  EXPECT_EQ(t.back().name, "lm_head.weight");
  EXPECT_EQ(layout.find("model.layers.3.mlp.down_proj.weight")->shape, (std::vector<int64_t>{128, 384}));
  EXPECT_EQ(layout.find("model.layers.1.self_attn.k_proj.weight")->shape, (std::vector<int64_t>{64, 128}));
  EXPECT_EQ(layout.find("model.layers.4.mlp.down_proj.weight"), nullptr);
}

TEST(ParamLayoutTest, OffsetsAreAlignedIncreasingAndDisjoint) {
  const ParamLayout layout(tiny(false, true));
  int64_t end = 0;
  for (const TensorSpec& t : layout.tensors()) {
    EXPECT_EQ(t.offset % kParamAlignment, 0) << t.name;
    EXPECT_GE(t.offset, end) << t.name;
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    EXPECT_EQ(t.numel, numel) << t.name;
    end = t.offset + t.numel;
  }
  EXPECT_GE(layout.total_size(), end);
  EXPECT_LT(layout.total_size(), end + kParamAlignment);
}

TEST(ParamLayoutTest, WeightDecayOnMatricesOnly) {
  const ParamLayout layout(tiny(false, true));
  for (const TensorSpec& t : layout.tensors()) {
    EXPECT_EQ(t.weight_decay, t.shape.size() == 2) << t.name;
  }
  EXPECT_TRUE(layout.find("model.embed_tokens.weight")->weight_decay);
  EXPECT_FALSE(layout.find("model.layers.0.self_attn.q_proj.bias")->weight_decay);
  EXPECT_FALSE(layout.find("model.norm.weight")->weight_decay);
}

TEST(ParamLayoutTest, TiedEmbeddingsShareTheLmHead) {
  const ParamLayout layout(tiny(true, false));
  EXPECT_EQ(layout.find("lm_head.weight"), nullptr);
  EXPECT_EQ(layout.lm_head(), layout.embed_tokens());
  const ParamLayout untied(tiny(false, false));
  EXPECT_EQ(untied.lm_head(), untied.find("lm_head.weight")->offset);
}

TEST(ParamLayoutTest, LayerViewsPointAtTheNamedTensors) {
  const ParamLayout layout(tiny(false, true));
  std::vector<float> buffer(static_cast<size_t>(layout.total_size()));
  const LayerParams p = LayerParams::bind(buffer.data(), layout.layer(2));
  auto at = [&](const char* name) { return buffer.data() + layout.find(name)->offset; };
  EXPECT_EQ(p.input_layernorm, at("model.layers.2.input_layernorm.weight"));
  EXPECT_EQ(p.q_proj, at("model.layers.2.self_attn.q_proj.weight"));
  EXPECT_EQ(p.k_bias, at("model.layers.2.self_attn.k_proj.bias"));
  EXPECT_EQ(p.o_proj, at("model.layers.2.self_attn.o_proj.weight"));
  EXPECT_EQ(p.down_proj, at("model.layers.2.mlp.down_proj.weight"));
  const ParamLayout no_bias(tiny(false, false));
  EXPECT_EQ(LayerParams::bind(buffer.data(), no_bias.layer(0)).q_bias, nullptr);
}

TEST(InitWeightsTest, DeterministicNormalMatricesUnitNormsZeroBiases) {
  const ParamLayout layout(tiny(false, true));
  std::vector<float> a(static_cast<size_t>(layout.total_size())), b(a.size()), other(a.size());
  init_weights(layout, a.data(), 5);
  init_weights(layout, b.data(), 5);
  init_weights(layout, other.data(), 6);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  EXPECT_NE(std::memcmp(a.data(), other.data(), a.size() * sizeof(float)), 0);
  for (const TensorSpec& t : layout.tensors()) {
    const float* p = a.data() + t.offset;
    if (t.kind == TensorKind::kMatrix) {
      double sum = 0, sq = 0;
      for (int64_t i = 0; i < t.numel; ++i) {
        ASSERT_TRUE(std::isfinite(p[i])) << t.name;
        sum += p[i];
        sq += double(p[i]) * p[i];
      }
      const double mean = sum / t.numel, std = std::sqrt(sq / t.numel - mean * mean);
      EXPECT_NEAR(mean, 0.0, 0.002) << t.name;
      EXPECT_NEAR(std, 0.02, 0.001) << t.name;
    } else {
      const float expected = t.kind == TensorKind::kNormWeight ? 1.0f : 0.0f;
      for (int64_t i = 0; i < t.numel; ++i) ASSERT_EQ(p[i], expected) << t.name;
    }
  }
}

TEST(InitWeightsTest, ATensorsValuesDependOnItsNameNotItsPosition) {
  // Tying removes lm_head but must not change any other tensor's values.
  const ParamLayout untied(tiny(false, false)), tied(tiny(true, false));
  std::vector<float> a(static_cast<size_t>(untied.total_size())), b(static_cast<size_t>(tied.total_size()));
  init_weights(untied, a.data(), 3);
  init_weights(tied, b.data(), 3);
  for (const TensorSpec& t : tied.tensors()) {
    const TensorSpec* u = untied.find(t.name);
    ASSERT_NE(u, nullptr);
    EXPECT_EQ(std::memcmp(a.data() + u->offset, b.data() + t.offset, t.numel * sizeof(float)), 0) << t.name;
  }
}

}  // namespace
}  // namespace strata::model
