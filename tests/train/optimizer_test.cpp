#include "reference_adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "../test_util.h"

namespace strata {
namespace {

model::ModelConfig small_config() {
  model::ModelConfig c;
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.attention_bias = true;
  c.fill_defaults();
  return c;
}

// Gradients only inside tensors (alignment padding stays 0, as the model leaves it).
std::vector<float> random_grads(const model::ParamLayout& layout, uint64_t seed) {
  std::vector<float> g(static_cast<size_t>(layout.total_size()), 0.0f);
  const std::vector<float> r = testing::random_vector(layout.total_size(), seed);
  for (const auto& t : layout.tensors())
    for (int64_t i = 0; i < t.numel; ++i) g[t.offset + i] = r[t.offset + i];
  return g;
}

TEST(AdamWTest, ClipGradientsReturnsThePreClipNormAndScalesToMaxNorm) {
  const model::ParamLayout layout(small_config());
  AdamW opt(layout, OptimizerConfig{});
  std::vector<float> g = random_grads(layout, 1);
  double sum = 0;
  for (float x : g) sum += double(x) * x;
  const double norm = opt.clip_gradients(g.data(), 1.0f);
  EXPECT_WITHIN(std::fabs(norm - std::sqrt(sum)) / std::sqrt(sum), 1e-12);
  ASSERT_GT(norm, 1.0);
  EXPECT_WITHIN(std::fabs(opt.grad_norm(g.data()) - 1.0), 1e-5);
}

TEST(AdamWTest, ClipGradientsLeavesSmallGradientsAlone) {
  const model::ParamLayout layout(small_config());
  AdamW opt(layout, OptimizerConfig{});
  std::vector<float> g = random_grads(layout, 2);
  const std::vector<float> before = g;
  const double norm = opt.clip_gradients(g.data(), 1e6f);
  EXPECT_GT(norm, 0.0);
  EXPECT_EQ(g, before);
}

TEST(AdamWTest, WeightDecayOnlyOnMatrices) {
  const model::ParamLayout layout(small_config());
  OptimizerConfig oc;
  oc.weight_decay = 0.5f;
  AdamW opt(layout, oc);
  std::vector<float> params(static_cast<size_t>(layout.total_size()), 2.0f);
  const std::vector<float> zero(params.size(), 0.0f);
  opt.step(params.data(), zero.data(), 0.1f);
  EXPECT_EQ(opt.step_count(), 1);
  for (const auto& t : layout.tensors()) {
    const float expected = t.weight_decay ? 2.0f * (1.0f - 0.1f * 0.5f) : 2.0f;
    for (int64_t i = 0; i < t.numel; ++i) ASSERT_FLOAT_EQ(params[t.offset + i], expected) << t.name;
  }
}

TEST(AdamWTest, StepsFollowTorchAdamWWithBiasCorrection) {
  const model::ParamLayout layout(small_config());
  OptimizerConfig oc;
  AdamW opt(layout, oc);
  const model::TensorSpec& norm = *layout.find("model.norm.weight");
  const model::TensorSpec& q = *layout.find("model.layers.0.self_attn.q_proj.weight");
  std::vector<float> params(static_cast<size_t>(layout.total_size()), 0.5f);
  // The torch.optim.AdamW update written out for one element of each kind, in double.
  double p_norm = 0.5, p_q = 0.5, m_norm = 0, v_norm = 0, m_q = 0, v_q = 0;
  const float lr = 0.01f;
  for (int step = 1; step <= 3; ++step) {
    std::vector<float> g(params.size(), 0.0f);
    const float g_norm = 0.3f * step, g_q = -0.2f / step;
    g[norm.offset] = g_norm;
    g[q.offset] = g_q;
    opt.step(params.data(), g.data(), lr);
    auto update = [&](double& p, double& m, double& v, double grad, double wd) {
      p *= 1 - lr * wd;
      m = oc.beta1 * m + (1 - oc.beta1) * grad;
      v = oc.beta2 * v + (1 - oc.beta2) * grad * grad;
      const double bc1 = 1 - std::pow(double(oc.beta1), step), bc2 = 1 - std::pow(double(oc.beta2), step);
      p -= lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + oc.eps);
    };
    update(p_norm, m_norm, v_norm, g_norm, 0.0);
    update(p_q, m_q, v_q, g_q, oc.weight_decay);
    EXPECT_NEAR(params[norm.offset], p_norm, 1e-6) << "step " << step;
    EXPECT_NEAR(params[q.offset], p_q, 1e-6) << "step " << step;
    EXPECT_NEAR(opt.m()[q.offset], m_q, 1e-7);
    EXPECT_NEAR(opt.v()[q.offset], v_q, 1e-7);
  }
  EXPECT_EQ(opt.step_count(), 3);
}

}  // namespace
}  // namespace strata
