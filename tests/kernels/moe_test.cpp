// Mixture-of-experts ops: routing, permutation, grouped experts, combine and the auxiliary
// load-balancing loss, forward and backward, fast path against reference and finite differences.
#include "kernels/moe.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../test_util.h"
#include "kernels/linear.h"

namespace strata::kernels {
namespace {

using strata::testing::finite_difference;
using strata::testing::random_vector;
using strata::testing::relative_error;

// The ops of one backend, so that every test runs the same code on ref and cpu.
struct Backend {
  const char* name;
  decltype(&ref::linear_forward) linear_forward;
  decltype(&ref::linear_backward) linear_backward;
  decltype(&ref::moe_route_forward) route_forward;
  decltype(&ref::moe_route_backward) route_backward;
  decltype(&ref::moe_permute) permute;
  decltype(&ref::moe_gather) gather;
  decltype(&ref::moe_gather_backward) gather_backward;
  decltype(&ref::moe_combine_forward) combine_forward;
  decltype(&ref::moe_combine_backward) combine_backward;
  decltype(&ref::moe_experts_forward) experts_forward;
  decltype(&ref::moe_experts_backward) experts_backward;
  decltype(&ref::moe_router_stats) router_stats;
};

const Backend kRef = {"ref",
                      &ref::linear_forward,
                      &ref::linear_backward,
                      &ref::moe_route_forward,
                      &ref::moe_route_backward,
                      &ref::moe_permute,
                      &ref::moe_gather,
                      &ref::moe_gather_backward,
                      &ref::moe_combine_forward,
                      &ref::moe_combine_backward,
                      &ref::moe_experts_forward,
                      &ref::moe_experts_backward,
                      &ref::moe_router_stats};
const Backend kCpu = {"cpu",
                      &cpu::linear_forward,
                      &cpu::linear_backward,
                      &cpu::moe_route_forward,
                      &cpu::moe_route_backward,
                      &cpu::moe_permute,
                      &cpu::moe_gather,
                      &cpu::moe_gather_backward,
                      &cpu::moe_combine_forward,
                      &cpu::moe_combine_backward,
                      &cpu::moe_experts_forward,
                      &cpu::moe_experts_backward,
                      &cpu::moe_router_stats};

// A whole MoE block: router, routing, permutation, experts, combine, plus the aux loss of this
// one layer, with its parameters and every intermediate.
struct MoeBlock {
  int64_t N, C, F;
  RouterConfig rc;
  std::vector<float> x;       // (N, C)
  std::vector<float> router;  // (E, C)
  std::vector<std::vector<float>> w_gate, w_up, w_down;  // E x (F,C), (F,C), (C,F)
  std::vector<float> bias;    // (E) selection bias, used when use_bias
  bool use_bias = false;

  // Forward state.
  std::vector<float> logits, probs, weights, xs, ys, gate, up, act, out;
  std::vector<int32_t> expert_idx, slot_of, token_of_slot;
  std::vector<int64_t> offsets, counts;
  std::vector<double> prob_sums;

  MoeBlock(int64_t n, int64_t c, int64_t f, RouterConfig config, uint64_t seed)
      : N(n), C(c), F(f), rc(config) {
    const int64_t E = rc.num_experts;
    x = random_vector(N * C, seed);
    router = random_vector(E * C, seed + 1, -0.8f, 0.8f);
    for (int64_t e = 0; e < E; ++e) {
      w_gate.push_back(random_vector(F * C, seed + 10 + e, -0.5f, 0.5f));
      w_up.push_back(random_vector(F * C, seed + 20 + e, -0.5f, 0.5f));
      w_down.push_back(random_vector(C * F, seed + 30 + e, -0.5f, 0.5f));
    }
    bias = random_vector(E, seed + 2, -0.3f, 0.3f);
  }

  ExpertTensors<const float> expert_weights(std::vector<const float*>* storage) const {
    const int64_t E = rc.num_experts;
    storage->clear();
    for (int64_t e = 0; e < E; ++e) storage->push_back(w_gate[e].data());
    for (int64_t e = 0; e < E; ++e) storage->push_back(w_up[e].data());
    for (int64_t e = 0; e < E; ++e) storage->push_back(w_down[e].data());
    return {storage->data(), storage->data() + E, storage->data() + 2 * E};
  }

  void forward(const Backend& b) {
    const int64_t E = rc.num_experts, K = rc.top_k, S = N * K;
    logits.assign(N * E, NAN);
    probs.assign(N * E, NAN);
    weights.assign(N * K, NAN);
    expert_idx.assign(N * K, -1);
    slot_of.assign(N * K, -1);
    token_of_slot.assign(S, -1);
    offsets.assign(E + 1, -1);
    xs.assign(S * C, NAN);
    ys.assign(S * C, NAN);
    gate.assign(S * F, NAN);
    up.assign(S * F, NAN);
    act.assign(S * F, NAN);
    out.assign(N * C, NAN);
    counts.assign(E, 0);
    prob_sums.assign(E, 0.0);
    b.linear_forward(logits.data(), x.data(), router.data(), nullptr, N, C, E);
    b.route_forward(expert_idx.data(), weights.data(), probs.data(), logits.data(),
                    use_bias ? bias.data() : nullptr, N, rc);
    b.permute(slot_of.data(), token_of_slot.data(), offsets.data(), expert_idx.data(), N, K, E);
    b.gather(xs.data(), x.data(), token_of_slot.data(), S, C);
    std::vector<const float*> ptrs;
    b.experts_forward(ys.data(), gate.data(), up.data(), act.data(), xs.data(), offsets.data(),
                      expert_weights(&ptrs), E, C, F);
    b.combine_forward(out.data(), ys.data(), weights.data(), slot_of.data(), N, K, C);
    b.router_stats(counts.data(), prob_sums.data(), expert_idx.data(), probs.data(), N, K, E);
  }

  // loss = sum(out * r) + aux_coef * aux.
  double loss(const std::vector<float>& r, double aux_coef) const {
    double l = 0;
    for (int64_t i = 0; i < N * C; ++i) l += double(out[i]) * r[i];
    return l + aux_coef * moe_aux_loss(counts.data(), prob_sums.data(), N, rc.num_experts);
  }
};

struct MoeGrads {
  std::vector<float> dx, drouter;
  std::vector<std::vector<float>> dgate, dup, ddown;
};

MoeGrads backward(const Backend& b, const MoeBlock& m, const std::vector<float>& r, double aux_coef) {
  const int64_t E = m.rc.num_experts, K = m.rc.top_k, S = m.N * K, N = m.N, C = m.C, F = m.F;
  MoeGrads g;
  g.dx.assign(N * C, NAN);  // overwritten
  g.drouter.assign(E * C, 0.0f);
  for (int64_t e = 0; e < E; ++e) {
    g.dgate.emplace_back(F * C, 0.0f);
    g.dup.emplace_back(F * C, 0.0f);
    g.ddown.emplace_back(C * F, 0.0f);
  }
  std::vector<float> dys(S * C, NAN), dweights(N * K, NAN), dxs(S * C, NAN), dg(S * F, NAN),
      du(S * F, NAN), da(S * F, NAN), dlogits(N * E, NAN), dx_router(N * C, NAN), prob_grad(E);
  b.combine_backward(dys.data(), dweights.data(), r.data(), m.ys.data(), m.weights.data(),
                     m.slot_of.data(), N, K, C);
  std::vector<float*> dptrs;
  for (auto* v : {&g.dgate, &g.dup, &g.ddown})
    for (auto& t : *v) dptrs.push_back(t.data());
  std::vector<const float*> wptrs;
  b.experts_backward(dxs.data(), {dptrs.data(), dptrs.data() + E, dptrs.data() + 2 * E}, dg.data(),
                     du.data(), da.data(), dys.data(), m.xs.data(), m.gate.data(), m.up.data(),
                     m.act.data(), m.offsets.data(), m.expert_weights(&wptrs), E, C, F);
  b.gather_backward(g.dx.data(), dxs.data(), m.slot_of.data(), N, K, C);
  moe_aux_loss_prob_grad(prob_grad.data(), m.counts.data(), N, E, aux_coef);
  b.route_backward(dlogits.data(), dweights.data(), aux_coef != 0 ? prob_grad.data() : nullptr,
                   m.probs.data(), m.expert_idx.data(), m.weights.data(), N, m.rc);
  b.linear_backward(dx_router.data(), g.drouter.data(), nullptr, dlogits.data(), m.x.data(),
                    m.router.data(), N, C, E);
  for (int64_t i = 0; i < N * C; ++i) g.dx[i] += dx_router[i];
  return g;
}

struct Case {
  std::string name;
  RouterConfig rc;
};

std::vector<Case> routing_cases() {
  using RS = RouterScoring;
  return {
      {"mixtral_top1", {4, 1, RS::kTopKThenSoftmax, false}},
      {"mixtral_top2", {4, 2, RS::kTopKThenSoftmax, false}},
      {"qwen_top1", {4, 1, RS::kSoftmaxThenTopK, false}},
      {"qwen_top2", {4, 2, RS::kSoftmaxThenTopK, false}},
      {"qwen_top2_normalized", {4, 2, RS::kSoftmaxThenTopK, true}},
      {"qwen_top3_of_6_normalized", {6, 3, RS::kSoftmaxThenTopK, true}},
      // DeepSeek-V2: group-limited greedy over softmax probabilities, scaled.
      {"deepseek_v2_groups_scaled", {8, 3, RS::kSoftmaxThenTopK, false, 4, 2, GroupScore::kMax, 2.0f}},
      // DeepSeek-V3: sigmoid scores, top-two group sums, normalised and scaled.
      {"deepseek_v3_groups", {8, 2, RS::kSigmoidThenTopK, true, 4, 2, GroupScore::kTopTwoSum, 2.5f}},
      {"sigmoid_unnormalized", {6, 2, RS::kSigmoidThenTopK, false, 1, 1, GroupScore::kMax, 1.5f}},
  };
}

// The logit whose sigmoid is s.
float logit_of(double s) { return static_cast<float>(std::log(s / (1.0 - s))); }

TEST(MoeRouting, SigmoidScoresEachExpertOnItsOwn) {
  const double s[4] = {0.3, 0.9, 0.6, 0.2};
  float logits[4];
  for (int e = 0; e < 4; ++e) logits[e] = logit_of(s[e]);
  for (const Backend* b : {&kRef, &kCpu}) {
    int32_t idx[2];
    float w[2], probs[4];
    b->route_forward(idx, w, probs, logits, nullptr, 1,
                     {4, 2, RouterScoring::kSigmoidThenTopK, true, 1, 1, GroupScore::kMax, 2.5f});
    for (int e = 0; e < 4; ++e) EXPECT_NEAR(probs[e], s[e], 1e-6) << b->name;
    EXPECT_EQ(idx[0], 1) << b->name;
    EXPECT_EQ(idx[1], 2) << b->name;
    EXPECT_NEAR(w[0], 2.5 * 0.9 / 1.5, 1e-6) << b->name;
    EXPECT_NEAR(w[1], 2.5 * 0.6 / 1.5, 1e-6) << b->name;
    b->route_forward(idx, w, probs, logits, nullptr, 1,
                     {4, 2, RouterScoring::kSigmoidThenTopK, false, 1, 1, GroupScore::kMax, 1.0f});
    EXPECT_NEAR(w[0], 0.9, 1e-6) << b->name;
    EXPECT_NEAR(w[1], 0.6, 1e-6) << b->name;
  }
}

// Eight experts in four groups of two, two groups kept. The two best experts (0 and 2) are in
// different groups; group 1 has the best pair, group 2 the next, group 0 only one good expert.
TEST(MoeRouting, GroupLimitingChangesTheChoice) {
  const double s[8] = {0.95, 0.05, 0.9, 0.7, 0.8, 0.75, 0.1, 0.1};
  float logits[8];
  for (int e = 0; e < 8; ++e) logits[e] = logit_of(s[e]);
  using RS = RouterScoring;
  const RouterConfig plain{8, 2, RS::kSigmoidThenTopK, true};
  const RouterConfig top_two{8, 2, RS::kSigmoidThenTopK, true, 4, 2, GroupScore::kTopTwoSum};
  const RouterConfig by_max{8, 2, RS::kSigmoidThenTopK, true, 4, 1, GroupScore::kMax};
  const RouterConfig one_group{8, 2, RS::kSigmoidThenTopK, true, 4, 1, GroupScore::kTopTwoSum};
  for (const Backend* b : {&kRef, &kCpu}) {
    int32_t idx[2];
    float w[2], probs[8];
    b->route_forward(idx, w, probs, logits, nullptr, 1, plain);
    EXPECT_EQ(std::vector<int32_t>(idx, idx + 2), (std::vector<int32_t>{0, 2})) << b->name;
    // Group sums: 1.0, 1.6, 1.55, 0.2: groups 1 and 2 are kept, expert 0 is not eligible.
    b->route_forward(idx, w, probs, logits, nullptr, 1, top_two);
    EXPECT_EQ(std::vector<int32_t>(idx, idx + 2), (std::vector<int32_t>{2, 4})) << b->name;
    EXPECT_NEAR(w[0], 0.9 / 1.7, 1e-6) << b->name;
    // Group maxima: 0.95, 0.9, 0.8, 0.1: group 0 alone is kept (two groups by maxima always hold
    // the two best experts).
    b->route_forward(idx, w, probs, logits, nullptr, 1, by_max);
    EXPECT_EQ(std::vector<int32_t>(idx, idx + 2), (std::vector<int32_t>{0, 1})) << b->name;
    b->route_forward(idx, w, probs, logits, nullptr, 1, one_group);
    EXPECT_EQ(std::vector<int32_t>(idx, idx + 2), (std::vector<int32_t>{2, 3})) << b->name;
    // The selection bias moves group 3 to the top (0.1 + 1 twice) but not the weights.
    const float bias[8] = {0, 0, 0, 0, 0, 0, 1.0f, 1.0f};
    b->route_forward(idx, w, probs, logits, bias, 1, one_group);
    EXPECT_EQ(std::vector<int32_t>(idx, idx + 2), (std::vector<int32_t>{6, 7})) << b->name;
    EXPECT_NEAR(w[0], 0.5, 1e-6) << b->name;
  }
}

TEST(MoeRouting, ConfigsOutsideTheRulesAreNamed) {
  using RS = RouterScoring;
  const char* why = nullptr;
  EXPECT_TRUE(router_config_ok({8, 2, RS::kSigmoidThenTopK, true, 4, 2, GroupScore::kTopTwoSum, 2.5f}));
  EXPECT_FALSE(router_config_ok({8, 2, RS::kSigmoidThenTopK, true, 3, 2}, &why));
  EXPECT_STREQ(why, "num_groups must divide num_experts");
  EXPECT_FALSE(router_config_ok({8, 2, RS::kSigmoidThenTopK, true, 4, 5}, &why));
  EXPECT_STREQ(why, "needs 1 <= top_groups <= num_groups");
  EXPECT_FALSE(router_config_ok({8, 3, RS::kSigmoidThenTopK, true, 4, 1}, &why));
  EXPECT_STREQ(why, "the kept groups hold fewer experts than top_k");
  EXPECT_FALSE(router_config_ok({8, 1, RS::kSigmoidThenTopK, true, 8, 1, GroupScore::kTopTwoSum}, &why));
  EXPECT_STREQ(why, "a top-two group score needs groups of at least 2 experts");
  EXPECT_FALSE(router_config_ok({8, 2, RS::kTopKThenSoftmax, false, 2, 1}, &why));
  EXPECT_STREQ(why, "top-k-then-softmax routing takes neither groups nor a scale");
  EXPECT_FALSE(router_config_ok({8, 2, RS::kSoftmaxThenTopK, false, 1, 1, GroupScore::kMax, 0.0f}, &why));
  EXPECT_STREQ(why, "the routing scale must be positive and finite");
}

TEST(MoeRouting, ForwardMatchesDefinitionForBothScorings) {
  const float logits[4] = {1.0f, 3.0f, 2.0f, 0.0f};
  const double z = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + 1.0;
  const double p1 = std::exp(3.0) / z, p2 = std::exp(2.0) / z;
  for (const Backend* b : {&kRef, &kCpu}) {
    int32_t idx[2];
    float w[2], probs[4];
    b->route_forward(idx, w, probs, logits, nullptr, 1, {4, 2, RouterScoring::kTopKThenSoftmax, false});
    EXPECT_EQ(idx[0], 1) << b->name;
    EXPECT_EQ(idx[1], 2) << b->name;
    EXPECT_NEAR(w[0], std::exp(1.0) / (std::exp(1.0) + 1.0), 1e-6) << b->name;
    EXPECT_NEAR(w[1], 1.0 / (std::exp(1.0) + 1.0), 1e-6) << b->name;
    EXPECT_NEAR(probs[1], p1, 1e-6) << b->name;

    b->route_forward(idx, w, probs, logits, nullptr, 1, {4, 2, RouterScoring::kSoftmaxThenTopK, false});
    EXPECT_EQ(idx[0], 1) << b->name;
    EXPECT_NEAR(w[0], p1, 1e-6) << b->name;
    EXPECT_NEAR(w[1], p2, 1e-6) << b->name;

    b->route_forward(idx, w, probs, logits, nullptr, 1, {4, 2, RouterScoring::kSoftmaxThenTopK, true});
    EXPECT_NEAR(w[0], p1 / (p1 + p2), 1e-6) << b->name;
    EXPECT_NEAR(w[1], p2 / (p1 + p2), 1e-6) << b->name;

    // Top-1 Mixtral routing gives the one chosen expert all the weight.
    b->route_forward(idx, w, probs, logits, nullptr, 1, {4, 1, RouterScoring::kTopKThenSoftmax, false});
    EXPECT_EQ(idx[0], 1) << b->name;
    EXPECT_EQ(w[0], 1.0f) << b->name;
  }
}

TEST(MoeRouting, SelectionBiasChangesTheChoiceButNotTheWeights) {
  const float logits[4] = {1.0f, 3.0f, 2.0f, 0.0f};
  const float bias[4] = {0.0f, 0.0f, 0.0f, 5.0f};  // pushes expert 3 to the top
  for (const Backend* b : {&kRef, &kCpu}) {
    int32_t idx[2];
    float w[2], probs[4];
    b->route_forward(idx, w, probs, logits, bias, 1, {4, 2, RouterScoring::kTopKThenSoftmax, false});
    EXPECT_EQ(idx[0], 3) << b->name;
    EXPECT_EQ(idx[1], 1) << b->name;
    // Weights: softmax over the unbiased logits 0 and 3.
    EXPECT_NEAR(w[0], 1.0 / (1.0 + std::exp(3.0)), 1e-6) << b->name;
    b->route_forward(idx, w, probs, logits, bias, 1, {4, 2, RouterScoring::kSoftmaxThenTopK, false});
    EXPECT_EQ(idx[0], 3) << b->name;
    EXPECT_NEAR(w[0], probs[3], 1e-7) << b->name;
  }
}

TEST(MoePermute, OrdersByExpertThenTokenAndHandlesEmptyExperts) {
  // 4 tokens, top-2, 4 experts; expert 2 receives no tokens.
  const int32_t idx[8] = {3, 0, 0, 1, 1, 3, 0, 3};
  const int32_t want_token_of_slot[8] = {0, 1, 3, 1, 2, 0, 2, 3};
  const int64_t want_offsets[5] = {0, 3, 5, 5, 8};
  for (const Backend* b : {&kRef, &kCpu}) {
    int32_t slot_of[8], token_of_slot[8];
    int64_t offsets[5];
    b->permute(slot_of, token_of_slot, offsets, idx, 4, 2, 4);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(token_of_slot[i], want_token_of_slot[i]) << b->name << " slot " << i;
    for (int i = 0; i < 5; ++i) EXPECT_EQ(offsets[i], want_offsets[i]) << b->name << " expert " << i;
    for (int a = 0; a < 8; ++a) {
      EXPECT_EQ(token_of_slot[slot_of[a]], a / 2) << b->name;  // each assignment finds its token
      EXPECT_GE(slot_of[a], offsets[idx[a]]) << b->name;
      EXPECT_LT(slot_of[a], offsets[idx[a] + 1]) << b->name;
    }
  }
}

TEST(MoeBlockTest, FastPathMatchesReferenceIncludingAnEmptyExpert) {
  for (const Case& c : routing_cases()) {
    for (bool starve : {false, true}) {
      MoeBlock m(37, 24, 20, c.rc, 11);
      if (starve) {
        // Router row of the last expert points away from every token: it gets none.
        for (int64_t i = 0; i < m.C; ++i) m.router[(c.rc.num_experts - 1) * m.C + i] = 0.0f;
        for (int64_t n = 0; n < m.N; ++n) m.x[n * m.C] = 1.0f + std::fabs(m.x[n * m.C]);
        m.router[(c.rc.num_experts - 1) * m.C] = -50.0f;
      }
      MoeBlock f = m;
      m.forward(kRef);
      f.forward(kCpu);
      const std::string what = c.name + (starve ? " starved" : "");
      if (starve) {
        EXPECT_EQ(m.counts[c.rc.num_experts - 1], 0) << what;
      }
      EXPECT_EQ(m.expert_idx, f.expert_idx) << what;
      EXPECT_EQ(m.offsets, f.offsets) << what;
      EXPECT_EQ(m.counts, f.counts) << what;
      EXPECT_WITHIN(relative_error(f.probs, m.probs), 1e-6) << what;
      EXPECT_WITHIN(relative_error(f.weights, m.weights), 1e-6) << what;
      EXPECT_WITHIN(relative_error(f.out, m.out), 1e-5) << what;

      const auto r = random_vector(m.N * m.C, 99);
      const MoeGrads gr = backward(kRef, m, r, 0.3);
      const MoeGrads gf = backward(kCpu, f, r, 0.3);
      EXPECT_WITHIN(relative_error(gf.dx, gr.dx), 1e-5) << what;
      EXPECT_WITHIN(relative_error(gf.drouter, gr.drouter), 1e-5) << what;
      for (int64_t e = 0; e < c.rc.num_experts; ++e) {
        if (m.offsets[e + 1] == m.offsets[e]) {
          // No tokens: the accumulated gradients stay exactly zero.
          for (float v : gf.dgate[e]) EXPECT_EQ(v, 0.0f) << what;
          for (float v : gr.ddown[e]) EXPECT_EQ(v, 0.0f) << what;
          continue;
        }
        EXPECT_WITHIN(relative_error(gf.dgate[e], gr.dgate[e]), 1e-5) << what << " expert " << e;
        EXPECT_WITHIN(relative_error(gf.dup[e], gr.dup[e]), 1e-5) << what << " expert " << e;
        EXPECT_WITHIN(relative_error(gf.ddown[e], gr.ddown[e]), 1e-5) << what << " expert " << e;
      }
    }
  }
}

TEST(MoeBlockTest, OutputMatchesDenseDefinition) {
  // out[n] = sum over chosen experts of weight * expert_e(x[n]), computed without permutation.
  for (const Case& c : routing_cases()) {
    MoeBlock m(9, 8, 6, c.rc, 5);
    m.forward(kCpu);
    const int64_t K = c.rc.top_k, C = m.C, F = m.F;
    std::vector<float> want(m.N * C, 0.0f), g(F), u(F), a(F), y(C);
    for (int64_t n = 0; n < m.N; ++n) {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = m.expert_idx[n * K + k];
        ref::linear_forward(g.data(), m.x.data() + n * C, m.w_gate[e].data(), nullptr, 1, C, F);
        ref::linear_forward(u.data(), m.x.data() + n * C, m.w_up[e].data(), nullptr, 1, C, F);
        for (int64_t i = 0; i < F; ++i) a[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
        ref::linear_forward(y.data(), a.data(), m.w_down[e].data(), nullptr, 1, F, C);
        for (int64_t i = 0; i < C; ++i) want[n * C + i] += m.weights[n * K + k] * y[i];
      }
    }
    EXPECT_WITHIN(relative_error(m.out, want), 1e-5) << c.name;
  }
}

// Numbers from transformers 4.40's load_balancing_loss_func((l0, l1), num_experts=4, top_k)
// and load_balancing_loss_func((l0,), 4, 2) for these logits.
TEST(MoeAuxLoss, MatchesTransformersLoadBalancingLoss) {
  const float l0[12] = {1.0f, 3.0f, 2.0f, 0.0f, 0.5f, -1.0f, 2.5f, 0.25f, -2.0f, 1.5f, 0.0f, 1.0f};
  const float l1[12] = {0.0f, 0.1f, -0.3f, 2.0f, 1.0f, 1.25f, 0.5f, -1.0f, 3.0f, -3.0f, 0.0f, 0.5f};
  struct Want {
    int64_t top_k;
    int layers;
    double value;
  };
  for (const Want& want : {Want{2, 2, 2.0310516357421875}, Want{1, 2, 1.05330228805542},
                           Want{2, 1, 2.3773458003997803}}) {
    for (const Backend* b : {&kRef, &kCpu}) {
      const RouterConfig rc{4, want.top_k, RouterScoring::kSoftmaxThenTopK, false};
      std::vector<int64_t> counts(4, 0);
      std::vector<double> prob_sums(4, 0.0);
      for (const float* l : {l0, l1}) {
        if (l == l1 && want.layers == 1) break;
        int32_t idx[6];
        float w[6], probs[12];
        b->route_forward(idx, w, probs, l, nullptr, 3, rc);
        b->router_stats(counts.data(), prob_sums.data(), idx, probs, 3, want.top_k, 4);
      }
      const double aux = moe_aux_loss(counts.data(), prob_sums.data(), 3 * want.layers, 4);
      EXPECT_NEAR(aux, want.value, 1e-6) << b->name << " top_k " << want.top_k << " layers " << want.layers;
    }
  }
}

TEST(MoeAuxLoss, MatchesFormulaInDouble) {
  const RouterConfig rc{6, 2, RouterScoring::kTopKThenSoftmax, false};
  MoeBlock m(40, 8, 4, rc, 3);
  m.forward(kCpu);
  // f_e = (choices of e) / N, P_e = mean softmax probability, aux = E * sum_e f_e P_e.
  double want = 0;
  for (int64_t e = 0; e < 6; ++e) {
    double f = 0, p = 0;
    for (int64_t n = 0; n < m.N; ++n) {
      for (int64_t k = 0; k < 2; ++k) f += m.expert_idx[n * 2 + k] == e ? 1.0 : 0.0;
      double z = 0;
      for (int64_t j = 0; j < 6; ++j) z += std::exp(double(m.logits[n * 6 + j]));
      p += std::exp(double(m.logits[n * 6 + e])) / z;
    }
    want += (f / m.N) * (p / m.N);
  }
  want *= 6;
  const double aux = moe_aux_loss(m.counts.data(), m.prob_sums.data(), m.N, 6);
  EXPECT_NEAR(aux, want, 1e-6 * want);
}

// Finite differences through the router (logits -> weights and the aux loss), the expert
// weights and the inputs, for each routing style. A step never changes the top-k selection
// (checked), so the loss is smooth where it is probed.
TEST(MoeBlockTest, BackwardMatchesFiniteDifferences) {
  constexpr double kAuxCoef = 0.5;
  constexpr double kStep = 1e-3;
  for (const Case& c : routing_cases()) {
    MoeBlock m(6, 5, 4, c.rc, 21);
    const auto r = random_vector(m.N * m.C, 7);
    m.forward(kRef);
    const std::vector<int32_t> chosen = m.expert_idx;
    const MoeGrads g = backward(kRef, m, r, kAuxCoef);
    bool selection_changed = false;
    auto loss = [&] {
      m.forward(kRef);
      selection_changed = selection_changed || m.expert_idx != chosen;
      return m.loss(r, kAuxCoef);
    };
    auto check = [&](std::vector<float>& param, const std::vector<float>& grad, const std::string& what) {
      std::vector<float> numeric(param.size());
      for (size_t i = 0; i < param.size(); ++i) numeric[i] = finite_difference(loss, &param[i], kStep);
      EXPECT_WITHIN(relative_error(grad, numeric), 2e-3) << c.name << " " << what;
    };
    check(m.x, g.dx, "input");
    check(m.router, g.drouter, "router");
    for (int64_t e = 0; e < c.rc.num_experts; ++e) {
      if (m.offsets[e + 1] == m.offsets[e]) continue;
      check(m.w_gate[e], g.dgate[e], "gate of expert " + std::to_string(e));
      check(m.w_up[e], g.dup[e], "up of expert " + std::to_string(e));
      check(m.w_down[e], g.ddown[e], "down of expert " + std::to_string(e));
    }
    EXPECT_FALSE(selection_changed) << c.name << ": a finite-difference step flipped the routing";
  }
}

TEST(MoeLossFree, BiasMovesTowardsUnderloadedExperts) {
  float bias[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const int64_t counts[4] = {10, 2, 6, 6};  // mean 6
  moe_update_selection_bias(bias, counts, 4, 0.01f);
  EXPECT_FLOAT_EQ(bias[0], -0.01f);
  EXPECT_FLOAT_EQ(bias[1], 0.01f);
  EXPECT_FLOAT_EQ(bias[2], 0.0f);
  EXPECT_FLOAT_EQ(bias[3], 0.0f);
}

// A tile of the expert order gives each expert its rows within the tile: offsets 0 2 5 5 9 (4
// experts, the third without rows), tiles of 4 rows.
TEST(MoeTileOffsets, EachExpertGetsItsRowsWithinTheTile) {
  const std::vector<int64_t> offsets = {0, 2, 5, 5, 9};
  const std::vector<std::vector<int64_t>> want = {{0, 2, 4, 4, 4}, {0, 0, 1, 1, 4}, {0, 0, 0, 0, 1}};
  for (int64_t t = 0; t < 3; ++t) {
    const int64_t r0 = 4 * t, n = std::min<int64_t>(4, 9 - r0);
    std::vector<int64_t> got(5, -1);
    moe_tile_offsets(got.data(), offsets.data(), 4, r0, n);
    EXPECT_EQ(got, want[static_cast<size_t>(t)]) << "tile from row " << r0;
  }
}

}  // namespace
}  // namespace strata::kernels
