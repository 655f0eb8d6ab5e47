#include "model/decoder.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../test_util.h"
#include "model/flat_model.h"

namespace strata::model {
namespace {

ModelConfig small_config(bool tied, bool attention_bias) {
  ModelConfig c;
  c.vocab_size = 37;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  c.attention_bias = attention_bias;
  c.fill_defaults();
  return c;
}

struct Batch {
  int64_t B = 0;
  int64_t T = 0;
  std::vector<int32_t> inputs;   // (B, T)
  std::vector<int32_t> targets;  // (B, T), -1 = ignored
};

Batch random_batch(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  Batch b{B, T, {}, {}};
  for (int64_t i = 0; i < B * T; ++i) {
    b.inputs.push_back(token(rng));
    // Every fifth target is ignored, as padding or prompt tokens would be.
    b.targets.push_back(i % 5 == 3 ? -1 : token(rng));
  }
  return b;
}

// Parameters far from the 0.02-std init, so that every gradient is large enough for a finite
// difference in fp32 to resolve it.
void randomize_params(FlatModel<LlamaModel>& model, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> matrix(-0.3f, 0.3f), gain(0.7f, 1.3f), bias(-0.1f, 0.1f);
  for (const TensorSpec& t : model.layout().tensors()) {
    float* p = model.params() + t.offset;
    for (int64_t i = 0; i < t.numel; ++i) {
      switch (t.kind) {
        case TensorRole::kMatrix: p[i] = matrix(rng); break;
        case TensorRole::kNormWeight: p[i] = gain(rng); break;
        case TensorRole::kBias: p[i] = bias(rng); break;
      }
    }
  }
}

class LlamaGradientTest : public ::testing::TestWithParam<std::pair<bool, bool>> {};

TEST_P(LlamaGradientTest, BackwardMatchesFiniteDifferencesOfTheLoss) {
  const auto [tied, bias] = GetParam();
  FlatModel<LlamaModel> model(small_config(tied, bias));
  randomize_params(model, 7);
  const Batch b = random_batch(2, 6, model.config().vocab_size, 11);

  model.zero_grads();
  model.forward_backward(b.inputs.data(), b.targets.data(), b.B, b.T, /*grad_scale=*/1.0f);
  const std::vector<float> grads(model.grads(), model.grads() + model.layout().total_size());
  auto loss = [&] { return model.forward_loss(b.inputs.data(), b.targets.data(), b.B, b.T); };

  constexpr double kStep = 1e-2;
  for (const TensorSpec& t : model.layout().tensors()) {
    // The element with the largest gradient, and one from the middle of the tensor.
    const float* g = grads.data() + t.offset;
    const int64_t largest = std::max_element(g, g + t.numel, [](float a, float c) {
                              return std::fabs(a) < std::fabs(c);
                            }) - g;
    for (int64_t i : {largest, t.numel / 2}) {
      const double fd = testing::finite_difference(loss, model.params() + t.offset + i, kStep);
      const double analytic = g[i];
      const double err = std::fabs(fd - analytic) / (2e-3 + 1e-2 * std::fabs(analytic));
      EXPECT_WITHIN(err, 1.0) << " " << t.name << "[" << i << "]: backward " << analytic
                              << ", finite difference " << fd;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, LlamaGradientTest,
                         ::testing::Values(std::pair{false, false}, std::pair{true, true}),
                         [](const auto& info) {
                           return std::string(info.param.first ? "Tied" : "Untied") +
                                  (info.param.second ? "WithBias" : "NoBias");
                         });

TEST(LlamaModelTest, ForwardBackwardIsBitwiseDeterministic) {
  const ModelConfig c = small_config(false, false);
  const Batch small = random_batch(2, 7, c.vocab_size, 3);
  const Batch large = random_batch(3, 11, c.vocab_size, 4);

  FlatModel<LlamaModel> a(c), b(c);
  a.init_weights(42);
  b.init_weights(42);
  ASSERT_EQ(std::memcmp(a.params(), b.params(), sizeof(float) * a.layout().total_size()), 0);
  a.zero_grads();
  const double loss_a = a.forward_backward(small.inputs.data(), small.targets.data(), small.B, small.T, 0.1f);
  // b first runs a larger batch, so its workspace is planned differently and holds stale data.
  b.zero_grads();
  b.forward_backward(large.inputs.data(), large.targets.data(), large.B, large.T, 0.1f);
  b.zero_grads();
  const double loss_b = b.forward_backward(small.inputs.data(), small.targets.data(), small.B, small.T, 0.1f);

  EXPECT_TRUE(std::isfinite(loss_a));
  EXPECT_EQ(loss_a, loss_b);
  EXPECT_EQ(std::memcmp(a.grads(), b.grads(), sizeof(float) * a.layout().total_size()), 0);
}

// Dynamic NTK RoPE scaling changes nothing for sequences within max_position_embeddings (bitwise
// the unscaled model), rescales past it (a different loss), and after a long sequence a short one
// is again computed as without scaling (the frequencies follow each micro-batch's length).
TEST(LlamaModelTest, DynamicRopeScalingActsOnlyPastTheContext) {
  ModelConfig plain = small_config(false, false);
  plain.max_position_embeddings = 16;
  ModelConfig dynamic = plain;
  dynamic.rope.scaling = kernels::RopeScaling::kDynamic;
  dynamic.rope.factor = 2.0;
  const Batch short_batch = random_batch(2, 16, plain.vocab_size, 5);
  const Batch long_batch = random_batch(2, 40, plain.vocab_size, 6);
  FlatModel<LlamaModel> a(plain), b(dynamic);
  a.init_weights(7);
  b.init_weights(7);
  auto run = [](FlatModel<LlamaModel>& m, const Batch& x) {
    m.zero_grads();
    return m.forward_backward(x.inputs.data(), x.targets.data(), x.B, x.T, 0.1f);
  };
  const double plain_short = run(a, short_batch), dynamic_short = run(b, short_batch);
  EXPECT_EQ(plain_short, dynamic_short);
  EXPECT_EQ(std::memcmp(a.grads(), b.grads(), sizeof(float) * a.layout().total_size()), 0);
  const double plain_long = run(a, long_batch), dynamic_long = run(b, long_batch);
  EXPECT_TRUE(std::isfinite(dynamic_long));
  EXPECT_NE(plain_long, dynamic_long);
  EXPECT_EQ(run(b, short_batch), plain_short);
}

// YaRN: the decoder rotates with its frequencies and multiplies cos and sin by its attention
// factor, in forward and in backward (the gradient is the loss's, by finite differences). With a
// factor of 1 it is the unscaled model, bit for bit.
TEST(LlamaModelTest, YarnRopeScalingBackwardMatchesItsLoss) {
  ModelConfig plain = small_config(false, false);
  plain.max_position_embeddings = 4;
  ModelConfig yarn = plain;
  yarn.rope.scaling = kernels::RopeScaling::kYarn;
  yarn.rope.original_max_position_embeddings = 0;
  yarn.rope.factor = 1.0;
  const Batch b = random_batch(2, 6, plain.vocab_size, 11);
  FlatModel<LlamaModel> a(plain), one(yarn);
  randomize_params(a, 7);
  randomize_params(one, 7);
  auto run = [&](FlatModel<LlamaModel>& m) {
    m.zero_grads();
    return m.forward_backward(b.inputs.data(), b.targets.data(), b.B, b.T, 1.0f);
  };
  EXPECT_EQ(run(a), run(one));
  EXPECT_EQ(std::memcmp(a.grads(), one.grads(), sizeof(float) * a.layout().total_size()), 0);

  yarn.rope.factor = 4.0;  // attention factor 1 + 0.1 ln 4
  FlatModel<LlamaModel> model(yarn);
  randomize_params(model, 7);
  const double scaled = run(model);
  EXPECT_TRUE(std::isfinite(scaled));
  EXPECT_NE(scaled, run(a));
  run(model);
  const std::vector<float> grads(model.grads(), model.grads() + model.layout().total_size());
  auto loss = [&] { return model.forward_loss(b.inputs.data(), b.targets.data(), b.B, b.T); };
  // The attention projections are where RoPE sits; check the largest gradient of each.
  for (const TensorSpec& t : model.layout().tensors()) {
    if (t.name.find("q_proj") == std::string::npos && t.name.find("k_proj") == std::string::npos) continue;
    const float* g = grads.data() + t.offset;
    const int64_t i = std::max_element(g, g + t.numel, [](float x, float y) { return std::fabs(x) < std::fabs(y); }) - g;
    const double fd = testing::finite_difference(loss, model.params() + t.offset + i, 1e-2);
    const double err = std::fabs(fd - g[i]) / (2e-3 + 1e-2 * std::fabs(g[i]));
    EXPECT_WITHIN(err, 1.0) << t.name << "[" << i << "]: backward " << g[i] << ", finite difference " << fd;
  }
}

TEST(LlamaModelTest, MicroBatchesAccumulateToTheFullBatchGradient) {
  const ModelConfig c = small_config(true, false);
  const Batch full = random_batch(4, 8, c.vocab_size, 5);
  const int64_t half_tokens = 2 * full.T;
  const int64_t valid = count_valid_targets(full.targets.data(), full.B * full.T);
  const float scale = 1.0f / static_cast<float>(valid);

  FlatModel<LlamaModel> model(c);
  model.init_weights(9);
  model.zero_grads();
  const double loss_full = model.forward_backward(full.inputs.data(), full.targets.data(), full.B, full.T, scale);
  const std::vector<float> grads_full(model.grads(), model.grads() + model.layout().total_size());

  model.zero_grads();
  double loss_parts = 0;
  for (int64_t part = 0; part < 2; ++part) {
    loss_parts += model.forward_backward(full.inputs.data() + part * half_tokens,
                                         full.targets.data() + part * half_tokens, 2, full.T, scale);
  }
  EXPECT_WITHIN(std::fabs(loss_parts - loss_full) / loss_full, 1e-6);
  for (const TensorSpec& t : model.layout().tensors()) {
    const double err = testing::relative_error(model.grads() + t.offset, grads_full.data() + t.offset, t.numel);
    EXPECT_WITHIN(err, 1e-5) << " " << t.name;
  }
}

TEST(LlamaModelTest, ForwardLossEqualsForwardBackwardLossAndLeavesGradientsAlone) {
  const ModelConfig c = small_config(false, false);
  const Batch b = random_batch(2, 9, c.vocab_size, 6);
  FlatModel<LlamaModel> model(c);
  model.init_weights(1);
  model.zero_grads();
  const double with_grads = model.forward_backward(b.inputs.data(), b.targets.data(), b.B, b.T, 1.0f);
  const std::vector<float> grads(model.grads(), model.grads() + model.layout().total_size());
  const double without = model.forward_loss(b.inputs.data(), b.targets.data(), b.B, b.T);
  EXPECT_WITHIN(std::fabs(with_grads - without) / with_grads, 1e-6);
  EXPECT_EQ(std::memcmp(grads.data(), model.grads(), sizeof(float) * grads.size()), 0);
  // At init every logit is near zero, so the mean loss is near log(V).
  const double mean = without / static_cast<double>(count_valid_targets(b.targets.data(), b.B * b.T));
  EXPECT_NEAR(mean, std::log(static_cast<double>(c.vocab_size)), 0.1);
}

TEST(LlamaModelTest, GradientsAccumulateAcrossCalls) {
  const ModelConfig c = small_config(false, false);
  const Batch b = random_batch(1, 5, c.vocab_size, 8);
  FlatModel<LlamaModel> model(c);
  model.init_weights(2);
  model.zero_grads();
  model.forward_backward(b.inputs.data(), b.targets.data(), b.B, b.T, 1.0f);
  const std::vector<float> once(model.grads(), model.grads() + model.layout().total_size());
  model.forward_backward(b.inputs.data(), b.targets.data(), b.B, b.T, 1.0f);
  std::vector<float> twice_expected(once);
  for (float& g : twice_expected) g *= 2.0f;
  EXPECT_WITHIN(testing::relative_error(model.grads(), twice_expected.data(), model.layout().total_size()), 1e-6);
}

TEST(LlamaModelTest, IgnoredTargetsContributeNoLossAndNoGradient) {
  const ModelConfig c = small_config(false, false);
  Batch b = random_batch(2, 4, c.vocab_size, 10);
  std::fill(b.targets.begin(), b.targets.end(), -1);
  FlatModel<LlamaModel> model(c);
  model.init_weights(3);
  model.zero_grads();
  EXPECT_EQ(model.forward_backward(b.inputs.data(), b.targets.data(), b.B, b.T, 1.0f), 0.0);
  const float* g = model.grads();
  EXPECT_TRUE(std::all_of(g, g + model.layout().total_size(), [](float x) { return x == 0.0f; }));
}

}  // namespace
}  // namespace strata::model
