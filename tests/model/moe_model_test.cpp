// The decoder with mixture-of-experts layers: expert token counts, the auxiliary loss switch and
// loss-free balancing. Parity with PyTorch is in moe_parity_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "../test_util.h"
#include "model/decoder.h"
#include "model/flat_model.h"
#include "model/tiny_moe.h"

namespace strata::model {
namespace {

std::vector<float> gradients(bool output_router_logits, const TinyBatch& batch) {
  FlatModel<LlamaModel> model(tiny_moe_config(output_router_logits, 0.0));
  model.init_weights(7);
  model.zero_grads();
  model.forward_backward(batch.inputs.data(), batch.targets.data(), kTinyB, kTinyT, 1.0f / (kTinyB * kTinyT));
  return std::vector<float>(model.grads(), model.grads() + model.layout().total_size());
}

TEST(MoeModelTest, AuxLossJoinsTheGradientOnlyWithOutputRouterLogits) {
  const TinyBatch batch = tiny_batch(1, 31);
  const std::vector<float> without = gradients(false, batch);
  const std::vector<float> with = gradients(true, batch);
  const ParamLayout layout(tiny_moe_config(true, 0.0));
  const TensorSpec* router = layout.find("model.layers.0.mlp.gate.weight");
  ASSERT_NE(router, nullptr);
  const double diff = testing::relative_error(with.data() + router->offset, without.data() + router->offset,
                                              router->numel);
  EXPECT_GT(diff, 1e-3) << "the auxiliary loss should change the router's gradient";
  const TensorSpec* lm_head = layout.find("lm_head.weight");
  ASSERT_NE(lm_head, nullptr);
  // The LM head sits after every router: its gradient does not see the aux loss.
  EXPECT_EQ(std::memcmp(with.data() + lm_head->offset, without.data() + lm_head->offset,
                        static_cast<size_t>(lm_head->numel) * sizeof(float)),
            0);
}

TEST(MoeModelTest, ExpertCountsAccumulateOverAStepAndResetWithZeroGrads) {
  const TinyBatch a = tiny_batch(2, 31), b = tiny_batch(3, 31);
  FlatModel<LlamaModel> model(tiny_moe_config(true, 0.0));
  model.init_weights(3);
  const int64_t E = 4, per_layer = kTinyB * kTinyT * 2;
  auto layer_total = [&](int64_t layer) {
    int64_t s = 0;
    for (int64_t e = 0; e < E; ++e) s += model.net().expert_token_counts()[layer * E + e];
    return s;
  };
  model.zero_grads();
  model.forward_backward(a.inputs.data(), a.targets.data(), kTinyB, kTinyT, 0.01f);
  EXPECT_EQ(layer_total(0), per_layer);
  EXPECT_EQ(layer_total(1), 0);  // dense layer
  model.forward_backward(b.inputs.data(), b.targets.data(), kTinyB, kTinyT, 0.01f);
  EXPECT_EQ(layer_total(2), 2 * per_layer);
  model.forward_loss(a.inputs.data(), a.targets.data(), kTinyB, kTinyT);  // evaluation does not count
  EXPECT_EQ(layer_total(2), 2 * per_layer);
  EXPECT_TRUE(std::isfinite(model.net().last_aux_loss()));
  EXPECT_GT(model.net().last_aux_loss(), 0.0);
  model.zero_grads();
  EXPECT_EQ(layer_total(0), 0);
}

// Max over experts of load / mean load, over the MoE layers.
double imbalance(const LlamaModel& model) {
  const ModelConfig& c = model.config();
  double worst = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.is_moe_layer(l)) continue;
    int64_t total = 0, most = 0;
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const int64_t n = model.expert_token_counts()[l * c.num_experts + e];
      total += n;
      most = std::max(most, n);
    }
    worst = std::max(worst, static_cast<double>(most) * c.num_experts / static_cast<double>(total));
  }
  return worst;
}

TEST(MoeModelTest, LossFreeBiasBalancesTheExperts) {
  const TinyBatch batch = tiny_batch(4, 31);
  FlatModel<LlamaModel> model(tiny_moe_config(false, 0.005));
  model.init_weights(5);
  // Skew every router towards expert 0 so that the start is badly unbalanced.
  for (const char* name : {"model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"}) {
    const TensorSpec* t = model.layout().find(name);
    ASSERT_NE(t, nullptr);
    for (int64_t i = 0; i < t->shape[1]; ++i) model.params()[t->offset + i] += 0.3f;
  }
  // The sign update moves every bias by a fixed step, so loads oscillate around balance once
  // they reach it; compare the average of the last steps with the start.
  constexpr int kSteps = 80;
  constexpr int kTail = 20;
  std::string trajectory;
  double first = 0, tail = 0;
  for (int step = 0; step < kSteps; ++step) {
    model.zero_grads();
    model.forward_backward(batch.inputs.data(), batch.targets.data(), kTinyB, kTinyT, 0.0f);
    const double now = imbalance(model.net());
    trajectory += fmt::format("{:.2f} ", now);
    if (step == 0) first = now;
    if (step >= kSteps - kTail) tail += now / kTail;
    model.net().update_expert_bias();
  }
  EXPECT_GT(first, 1.5) << trajectory;
  EXPECT_LT(tail, first - 0.25) << trajectory;
  std::printf("load max/mean by step: %s\n", trajectory.c_str());
  bool moved = false;
  for (float v : model.net().expert_selection_bias()) moved = moved || v != 0.0f;
  EXPECT_TRUE(moved);
}

TEST(MoeModelTest, WithoutARateTheBiasStaysZero) {
  const TinyBatch batch = tiny_batch(5, 31);
  FlatModel<LlamaModel> model(tiny_moe_config(true, 0.0));
  model.init_weights(5);
  model.zero_grads();
  model.forward_backward(batch.inputs.data(), batch.targets.data(), kTinyB, kTinyT, 0.01f);
  model.net().update_expert_bias();
  for (float v : model.net().expert_selection_bias()) EXPECT_EQ(v, 0.0f);
}

}  // namespace
}  // namespace strata::model
