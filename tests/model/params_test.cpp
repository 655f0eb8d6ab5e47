#include "model/params.h"

#include <gtest/gtest.h>
#include <omp.h>

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
    if (t.kind == TensorRole::kMatrix) {
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
      const float expected = t.kind == TensorRole::kNormWeight ? 1.0f : 0.0f;
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

// A large tensor fills on several threads (each pair of values from its own point of the
// generator's counter): the bits do not depend on how many there are, and match the values the
// first pairs get when a tensor is small enough to fill on one.
TEST(InitWeightsTest, ALargeTensorHasTheSameBitsOnAnyNumberOfThreads) {
  TensorSpec big;
  big.name = "model.layers.0.mlp.up_proj.weight";
  big.kind = TensorRole::kMatrix;
  big.numel = 300001;  // odd: the last pair has one value
  TensorSpec small = big;
  small.numel = 1001;
  std::vector<float> one(static_cast<size_t>(big.numel)), many(one.size()), head(static_cast<size_t>(small.numel));
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  init_tensor(big, one.data(), 9);
  omp_set_num_threads(4);
  init_tensor(big, many.data(), 9);
  omp_set_num_threads(threads);
  init_tensor(small, head.data(), 9);
  EXPECT_EQ(std::memcmp(one.data(), many.data(), one.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(one.data(), head.data(), head.size() * sizeof(float)), 0);
}

// A vocabulary far larger than every other tensor is cut in row blocks about the size of the
// largest other tensor (Llama 3: 128256 x 4096 in blocks of 14336 rows, the MLP's size); a
// vocabulary that is not (the tiny preset's) stays one block.
TEST(ParamLayoutTest, LargeVocabulariesGoInRowBlocks) {
  const ParamLayout small(tiny(false, false));
  EXPECT_EQ(small.at(small.embed_tokens()).block_rows, 0);
  EXPECT_EQ(small.at(small.embed_tokens()).num_blocks(), 1);
  const ParamLayout llama(ModelConfig::preset("llama3-8b").value());
  for (int64_t offset : {llama.embed_tokens(), llama.lm_head()}) {
    const TensorSpec& t = llama.at(offset);
    EXPECT_EQ(t.block_rows, 14336) << t.name;
    EXPECT_EQ(t.num_blocks(), 9) << t.name;  // 8 full blocks and 128256 - 8 * 14336 = 13568 rows
    EXPECT_EQ(t.block_numel(8), int64_t{13568} * 4096) << t.name;
    EXPECT_EQ(t.block_offset(1), t.offset + int64_t{14336} * 4096) << t.name;
    int64_t sum = 0;
    for (int64_t b = 0; b < t.num_blocks(); ++b) sum += t.block_numel(b);
    EXPECT_EQ(sum, t.numel) << t.name;
  }
  EXPECT_EQ(llama.at(llama.layer(0).q_proj).block_rows, 0);
}

}  // namespace
}  // namespace strata::model
