// The GPU's bf16 recipe on the CPU (kernels::CpuBf16Ops, model::LlamaModelBf16): its ops round
// each output exactly once from the fp32 computation, and the decoder written once over it
// tracks the fp32 reference within bf16 tolerances, dense and MoE alike.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "core/cpu_device.h"
#include "kernels/attention.h"
#include "kernels/cpu/backend.h"
#include "kernels/linear.h"
#include "kernels/rmsnorm.h"
#include "kernels/swiglu.h"
#include "model/decoder.h"
#include "model/flat_model.h"

namespace strata::model {
namespace {

using kernels::Bf16;

std::vector<Bf16> random_bf16(int64_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<Bf16> out(static_cast<size_t>(n));
  for (Bf16& v : out) v = kernels::to_bf16(u(rng));
  return out;
}

std::vector<float> widen(const std::vector<Bf16>& v) {
  std::vector<float> out;
  for (Bf16 b : v) out.push_back(kernels::to_f32(b));
  return out;
}

// Bitwise: the bf16 op's output is the fp32 op's output on the same (widened) inputs, rounded.
void expect_rounded(const std::vector<Bf16>& got, const std::vector<float>& fp32, const char* what) {
  ASSERT_EQ(got.size(), fp32.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].bits, kernels::to_bf16(fp32[i]).bits) << what << " element " << i;
  }
}

TEST(CpuBf16Ops, EachOpRoundsTheFp32ResultOnce) {
  kernels::CpuBf16Ops ops;
  const int64_t N = 6, IC = 20, OC = 12;
  const auto x = random_bf16(N * IC, 1), w = random_bf16(OC * IC, 2, 0.3f), b = random_bf16(OC, 3, 0.1f);
  std::vector<Bf16> out(static_cast<size_t>(N * OC));
  ops.linear_forward(out.data(), x.data(), w.data(), b.data(), N, IC, OC);
  std::vector<float> ref(out.size());
  kernels::cpu::linear_forward(ref.data(), widen(x).data(), widen(w).data(), widen(b).data(), N, IC, OC);
  expect_rounded(out, ref, "linear_forward");

  const auto g = random_bf16(N * IC, 4);
  std::vector<float> rstd(N), rstd_ref(N);
  std::vector<Bf16> normed(static_cast<size_t>(N * IC));
  ops.rmsnorm_forward(normed.data(), rstd.data(), x.data(), g.data(), N, IC, 1e-5f);
  std::vector<float> normed_ref(normed.size());
  kernels::cpu::rmsnorm_forward(normed_ref.data(), rstd_ref.data(), widen(x).data(), widen(g).data(), N, IC, 1e-5f);
  expect_rounded(normed, normed_ref, "rmsnorm_forward");
  EXPECT_EQ(rstd, rstd_ref);

  std::vector<Bf16> act(static_cast<size_t>(N * IC));
  ops.swiglu_forward(act.data(), x.data(), g.data(), N * IC);
  std::vector<float> act_ref(act.size());
  kernels::cpu::swiglu_forward(act_ref.data(), widen(x).data(), widen(g).data(), N * IC);
  expect_rounded(act, act_ref, "swiglu_forward");

  const int64_t B = 2, T = 5, Hq = 4, Hkv = 2, D = 8;
  const auto q = random_bf16(B * T * Hq * D, 5), k = random_bf16(B * T * Hkv * D, 6), v = random_bf16(B * T * Hkv * D, 7);
  std::vector<Bf16> att(q.size());
  std::vector<float> lse(B * Hq * T), lse_ref(lse.size()), att_ref(q.size());
  ops.attention_forward(att.data(), lse.data(), q.data(), k.data(), v.data(), B, T, Hq, Hkv, D);
  kernels::cpu::attention_forward(att_ref.data(), lse_ref.data(), widen(q).data(), widen(k).data(), widen(v).data(),
                                  B, T, Hq, Hkv, D);
  expect_rounded(att, att_ref, "attention_forward");
  EXPECT_EQ(lse, lse_ref);
}

// Multi-head latent attention's shapes (values narrower than queries and keys, a caller's
// softmax scale) pass through the op set: forward and backward round the fp32 kernel's results.
TEST(CpuBf16Ops, AttentionWithValueDimsRoundsTheFp32ResultOnce) {
  kernels::CpuBf16Ops ops;
  const int64_t B = 2, T = 5, Hq = 4, Hkv = 2, D = 12, Dv = 8;
  const double scale = 0.3;
  const auto q = random_bf16(B * T * Hq * D, 15), k = random_bf16(B * T * Hkv * D, 16),
             v = random_bf16(B * T * Hkv * Dv, 17), dout = random_bf16(B * T * Hq * Dv, 18);
  std::vector<Bf16> att(static_cast<size_t>(B * T * Hq * Dv));
  std::vector<float> lse(B * Hq * T), lse_ref(lse.size()), att_ref(att.size());
  ops.attention_forward(att.data(), lse.data(), q.data(), k.data(), v.data(), B, T, Hq, Hkv, D, 0, nullptr, Dv, scale);
  kernels::cpu::attention_forward(att_ref.data(), lse_ref.data(), widen(q).data(), widen(k).data(), widen(v).data(),
                                  B, T, Hq, Hkv, D, 0, nullptr, Dv, scale);
  expect_rounded(att, att_ref, "attention_forward");
  EXPECT_EQ(lse, lse_ref);

  std::vector<Bf16> dq(q.size()), dk(k.size()), dv(v.size());
  ops.attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(), att.data(),
                         lse.data(), B, T, Hq, Hkv, D, nullptr, Dv, scale);
  std::vector<float> dq_ref(dq.size()), dk_ref(dk.size()), dv_ref(dv.size());
  kernels::cpu::attention_backward(dq_ref.data(), dk_ref.data(), dv_ref.data(), widen(dout).data(), widen(q).data(),
                                   widen(k).data(), widen(v).data(), widen(att).data(), lse.data(), B, T, Hq, Hkv, D,
                                   nullptr, Dv, scale);
  expect_rounded(dq, dq_ref, "attention_backward dq");
  expect_rounded(dk, dk_ref, "attention_backward dk");
  expect_rounded(dv, dv_ref, "attention_backward dv");
}

TEST(CpuBf16Ops, AddInplaceRoundsTheSum) {
  kernels::CpuBf16Ops ops;
  // 1 + 2^-9 is not a bf16 (8 explicit mantissa bits): the sum rounds to even, back to 1.
  std::vector<Bf16> a = {kernels::to_bf16(1.0f), kernels::to_bf16(1.0f)};
  const std::vector<Bf16> b = {kernels::to_bf16(1.0f / 512), kernels::to_bf16(3.0f / 512)};
  ops.add_inplace(a.data(), b.data(), 2);
  EXPECT_EQ(kernels::to_f32(a[0]), 1.0f);
  EXPECT_EQ(kernels::to_f32(a[1]), 1.0f + 1.0f / 128);
}

// h = x + o_proj(att) and out = h + down_proj(act) are one op: the fp32 product plus the
// residual, rounded once, as cuBLASLt rounds a GEMM with beta = 1 onto a separate bf16 C.
TEST(CpuBf16Ops, LinearForwardResidualRoundsTheSumOnce) {
  kernels::CpuBf16Ops ops;
  const int64_t N = 5, IC = 24, OC = 16;
  const auto x = random_bf16(N * IC, 11), w = random_bf16(OC * IC, 12, 0.3f), r = random_bf16(N * OC, 13);
  std::vector<Bf16> out(static_cast<size_t>(N * OC));
  ops.linear_forward_residual(out.data(), x.data(), w.data(), r.data(), N, IC, OC);
  std::vector<float> ref(out.size());
  kernels::cpu::linear_forward(ref.data(), widen(x).data(), widen(w).data(), nullptr, N, IC, OC);
  for (size_t i = 0; i < ref.size(); ++i) ref[i] += kernels::to_f32(r[i]);
  expect_rounded(out, ref, "linear_forward_residual");

  // 1 + 2^-8 is halfway between two bf16s and rounds to even, 1; rounded before the residual
  // 2^-8 is added it stays 1, rounded after it is 1 + 2^-7.
  const std::vector<Bf16> x1 = {kernels::to_bf16(1.0f), kernels::to_bf16(1.0f)};
  const std::vector<Bf16> w1 = {kernels::to_bf16(1.0f), kernels::to_bf16(1.0f / 256)};
  const std::vector<Bf16> r1 = {kernels::to_bf16(1.0f / 256)};
  std::vector<Bf16> o1(1);
  ops.linear_forward_residual(o1.data(), x1.data(), w1.data(), r1.data(), 1, 2, 1);
  EXPECT_EQ(kernels::to_f32(o1[0]), 1.0f + 1.0f / 128);
}

// The fp32 recipe is the reference: fusing the residual must not move a bit of it.
TEST(CpuF32Ops, LinearForwardResidualIsLinearForwardThenAddBitwise) {
  kernels::CpuF32Ops ops;
  const int64_t N = 7, IC = 300, OC = 33;
  std::mt19937_64 rng(21);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(N * IC), w(OC * IC), r(N * OC);
  for (float& v : x) v = u(rng);
  for (float& v : w) v = u(rng);
  for (float& v : r) v = u(rng) * 100.0f;
  std::vector<float> fused(N * OC), unfused(N * OC);
  ops.linear_forward_residual(fused.data(), x.data(), w.data(), r.data(), N, IC, OC);
  ops.linear_forward(unfused.data(), x.data(), w.data(), nullptr, N, IC, OC);
  ops.add_inplace(unfused.data(), r.data(), N * OC);
  EXPECT_EQ(std::memcmp(fused.data(), unfused.data(), fused.size() * sizeof(float)), 0);
}

ModelConfig dense_config() {
  ModelConfig c;
  c.vocab_size = 53;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.attention_bias = true;
  c.fill_defaults();
  return c;
}

ModelConfig moe_config() {
  ModelConfig c = dense_config();
  c.attention_bias = false;
  c.qk_norm = true;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 24;
  c.shared_expert_intermediate_size = 32;
  c.router_scoring = kernels::RouterScoring::kSoftmaxThenTopK;
  c.output_router_logits = true;
  c.router_aux_loss_coef = 0.01;
  c.fill_defaults();
  return c;
}

struct Tokens {
  std::vector<int32_t> inputs, targets;
};

Tokens random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  Tokens t;
  for (int64_t i = 0; i < n; ++i) {
    t.inputs.push_back(token(rng));
    t.targets.push_back(i % 7 == 2 ? -1 : token(rng));
  }
  return t;
}

double relative_l2(const float* got, const float* want, int64_t n) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

class Bf16DecoderTest : public ::testing::TestWithParam<bool> {};

// Same master weights, same tokens: the bf16 recipe's loss and gradients stay within bf16
// tolerances of the fp32 reference, and are not bitwise equal to it (the recipe does round).
TEST_P(Bf16DecoderTest, TracksTheFp32ReferenceWithinBf16Tolerance) {
  const ModelConfig c = GetParam() ? moe_config() : dense_config();
  FlatModel<LlamaModel> ref(c);
  FlatModel<LlamaModelBf16> bf(c);
  ref.init_weights(3);
  std::copy_n(ref.params(), ref.layout().total_size(), bf.params());
  bf.sync_compute_copy();
  const int64_t B = 2, T = 16;
  const Tokens t = random_tokens(B * T, c.vocab_size, 9);
  ref.zero_grads();
  bf.zero_grads();
  const double want = ref.forward_backward(t.inputs.data(), t.targets.data(), B, T, 1.0f / 20);
  const double got = bf.forward_backward(t.inputs.data(), t.targets.data(), B, T, 1.0f / 20);
  const double loss_err = std::abs(got - want) / std::abs(want);
  EXPECT_TRUE(loss_err <= 1e-3) << "loss " << got << " vs fp32 " << want;
  EXPECT_NE(got, want);
  const double grad_err = relative_l2(bf.grads(), ref.grads(), ref.layout().total_size());
  std::printf("bf16 recipe vs fp32: loss relative error %.3g, gradient relative L2 error %.3g\n", loss_err, grad_err);
  EXPECT_TRUE(grad_err <= 2e-2) << "gradients differ by " << grad_err << " (relative L2)";
  EXPECT_GT(grad_err, 0.0);
  if (c.is_moe()) {
    EXPECT_EQ(bf.net().expert_token_counts(), ref.net().expert_token_counts());
  }
  // A forward alone gives the same loss as the forward of forward_backward.
  EXPECT_EQ(bf.forward_loss(t.inputs.data(), t.targets.data(), B, T), got);
}

TEST_P(Bf16DecoderTest, TrainsTheLossDown) {
  const ModelConfig c = GetParam() ? moe_config() : dense_config();
  FlatModel<LlamaModelBf16> model(c);
  model.init_weights(5);
  const int64_t B = 2, T = 16;
  const Tokens t = random_tokens(B * T, c.vocab_size, 4);
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    model.zero_grads();
    last = model.forward_backward(t.inputs.data(), t.targets.data(), B, T, 1.0f / (B * T));
    if (step == 0) first = last;
    // Plain SGD on the fp32 master, then a fresh bf16 compute copy.
    for (int64_t i = 0; i < model.layout().total_size(); ++i) model.params()[i] -= 0.5f * model.grads()[i];
    model.sync_compute_copy();
  }
  EXPECT_TRUE(std::isfinite(last));
  EXPECT_LT(last, 0.8 * first);
}

// Keeping every layer's intermediates only skips recomputing what forward computed: the same
// ops on the same inputs, so losses and gradients are bitwise those of recomputation.
template <class Net>
void expect_kept_equals_recomputed(const ModelConfig& c) {
  FlatModel<Net> kept(c), recomputed(c);
  kept.init_weights(8);
  recomputed.init_weights(8);
  kept.net().set_keep_layer_activations(true);
  const int64_t B = 2, T = 16;
  for (int step = 0; step < 3; ++step) {
    const Tokens t = random_tokens(B * T, c.vocab_size, 20 + step);
    kept.zero_grads();
    recomputed.zero_grads();
    const double a = kept.forward_backward(t.inputs.data(), t.targets.data(), B, T, 1.0f / (B * T));
    const double b = recomputed.forward_backward(t.inputs.data(), t.targets.data(), B, T, 1.0f / (B * T));
    ASSERT_EQ(std::memcmp(&a, &b, sizeof(double)), 0) << "step " << step << ": " << a << " vs " << b;
    const int64_t n = kept.layout().total_size();
    ASSERT_EQ(std::memcmp(kept.grads(), recomputed.grads(), static_cast<size_t>(n) * sizeof(float)), 0)
        << "gradients of step " << step;
    for (FlatModel<Net>* net : {&kept, &recomputed}) {
      for (int64_t i = 0; i < n; ++i) net->params()[i] -= 0.1f * net->grads()[i];
      net->sync_compute_copy();
    }
  }
  EXPECT_GT(kept.activation_bytes(), recomputed.activation_bytes());
}

TEST_P(Bf16DecoderTest, KeptLayerActivationsGiveTheRecomputedResultsBitwise) {
  const ModelConfig c = GetParam() ? moe_config() : dense_config();
  expect_kept_equals_recomputed<LlamaModel>(c);
  expect_kept_equals_recomputed<LlamaModelBf16>(c);
}

// With DeepSeek-V3's MTP module, whose block runs in the shared buffers between the last layer's
// forward and its backward: the last layer keeps its own when layers are kept, and is recomputed
// otherwise.
ModelConfig mtp_config(int modules) {
  const nlohmann::json j = {
      {"architectures", {"DeepseekV3ForCausalLM"}}, {"vocab_size", 96}, {"hidden_size", 64},
      {"intermediate_size", 96}, {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"q_lora_rank", 24},
      {"kv_lora_rank", 32}, {"qk_nope_head_dim", 16}, {"qk_rope_head_dim", 8}, {"v_head_dim", 12},
      {"max_position_embeddings", 64}, {"n_routed_experts", 4}, {"num_experts_per_tok", 2}, {"n_group", 2},
      {"topk_group", 1}, {"moe_intermediate_size", 32}, {"n_shared_experts", 1}, {"first_k_dense_replace", 1},
      {"num_nextn_predict_layers", modules}, {"tie_word_embeddings", false}};
  Result<ModelConfig> c = ModelConfig::from_json(j, "test");
  CHECK_MSG(c.ok(), c.status().to_string());
  return *c;
}

TEST(Bf16DecoderMtp, KeptLayerActivationsGiveTheRecomputedResultsBitwise) {
  for (int modules : {1, 2}) {
    const ModelConfig c = mtp_config(modules);
    ASSERT_TRUE(c.trains_mtp());
    expect_kept_equals_recomputed<LlamaModel>(c);
    expect_kept_equals_recomputed<LlamaModelBf16>(c);
  }
}

// With packed documents a module predicts nothing across the start of a document: module k's
// position t has a target only when no document starts in t + 1 .. t + k (and t + k < T).
TEST(Bf16DecoderMtp, ModulesPredictNothingAcrossADocumentStart) {
  const ModelConfig c = mtp_config(2);
  FlatModel<LlamaModel> model(c);
  model.init_weights(3);
  const int64_t B = 1, T = 8;
  const std::vector<int32_t> positions = {0, 1, 2, 0, 1, 2, 3, 0};
  Tokens t = random_tokens(B * T, c.vocab_size, 9);
  for (int32_t& target : t.targets) target = std::max(target, 0);  // every main target counts
  model.zero_grads();
  Result<double> loss = model.compute(t.inputs.data(), t.targets.data(), B, T, 1.0f / (B * T), true, positions.data());
  ASSERT_TRUE(loss.ok()) << loss.status().to_string();
  // Module 1: t = 0, 1, 3, 4, 5 (t = 2 and 6 precede a start, t = 7 is last); module 2: t = 0, 3, 4
  // (t = 1 and 2 span the start at 3, t = 5 and 6 the one at 7, t = 6 and 7 run past the row).
  EXPECT_EQ(model.net().last_mtp_loss().second, 5 + 3);
  EXPECT_TRUE(std::isfinite(model.net().last_mtp_loss().first));
}

INSTANTIATE_TEST_SUITE_P(DenseAndMoe, Bf16DecoderTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("Moe") : std::string("Dense"); });

}  // namespace
}  // namespace strata::model

namespace strata::model {
namespace {

// Chaos mode: the activation block an op set lets go is filled with NaN bytes, so an op still
// reading it computes NaN instead of passing on stale values; without chaos it is left as is.
TEST(DecoderMemory, InChaosModeAReplacedActivationBlockReadsAsNaN) {
  for (const uint64_t seed : {uint64_t{0}, uint64_t{5}}) {
    auto device = CpuDevice::create(0, 1 << 20, seed);
    ASSERT_TRUE(device.ok()) << device.status().to_string();
    CpuF32Model ops(device->get());
    Result<void*> first = ops.activation_block(4096, kernels::MicroBatchShape{});
    ASSERT_TRUE(first.ok());
    float* old = static_cast<float*>(*first);
    std::fill(old, old + 1024, 1.0f);
    // Held past the first block, so that the larger second block cannot take its place.
    Result<DeviceAllocation> fence = (*device)->allocate(4096);
    ASSERT_TRUE(fence.ok());
    ASSERT_TRUE(ops.activation_block(8192, kernels::MicroBatchShape{}).ok());
    int poisoned = 0;
    for (int i = 0; i < 1024; ++i) poisoned += std::isnan(old[i]) ? 1 : 0;
    EXPECT_EQ(poisoned, seed != 0 ? 1024 : 0) << "chaos seed " << seed;
  }
}

// memory.device is enforced by the allocator: the activation table comes from the device's
// budgeted arena, and a table larger than what is left is refused there, naming the request.
TEST(DecoderMemory, AnActivationTableOverTheDeviceBudgetIsRefusedByTheAllocator) {
  const ModelConfig c = dense_config();
  const int64_t B = 2, T = 16;
  const int64_t table = ActivationTable<kernels::CpuF32Ops>::bytes_for(c, B * T, false);
  for (const bool fits : {true, false}) {
    auto device = open_device("cpu", 0, static_cast<uint64_t>(fits ? table + (1 << 20) : table / 2));
    ASSERT_TRUE(device.ok()) << device.status().to_string();
    FlatModel<LlamaModel> model(c, CpuF32Model(device->get()));
    model.init_weights(1);
    const Tokens t = random_tokens(B * T, c.vocab_size, 2);
    Result<double> loss = model.compute(t.inputs.data(), t.targets.data(), B, T, 1.0f, /*backward=*/true);
    if (fits) {
      ASSERT_TRUE(loss.ok()) << loss.status().to_string();
      EXPECT_GE((*device)->memory_in_use(), static_cast<uint64_t>(table));
      continue;
    }
    ASSERT_FALSE(loss.ok());
    EXPECT_EQ(loss.status().code(), StatusCode::kOutOfMemory);
    EXPECT_NE(loss.status().message().find("activation table"), std::string::npos) << loss.status().to_string();
    EXPECT_NE(loss.status().message().find("cannot allocate"), std::string::npos) << loss.status().to_string();
  }
}

}  // namespace
}  // namespace strata::model
