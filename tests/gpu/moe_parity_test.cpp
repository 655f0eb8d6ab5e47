// Backend parity of the mixture-of-experts ops: every CUDA op of kernels/moe.h against the CPU
// reference (kernels::ref), over Mixtral-like (E=8, K=2) and Qwen-MoE-like (E=60, K=4)
// configurations, both scoring modes, with and without a selection bias, odd sizes, and expert
// assignments that leave some experts without tokens.
//
// The router is fp32 on both sides and fed the same fp32 inputs. Token activations and expert
// weights are bf16 on the GPU: they are rounded to bf16 before either side sees them, so only
// the computation (and the GPU's bf16 outputs and intermediates) differs.
//
// Integer outputs (expert_idx, slots, offsets, counts) must match exactly. Float outputs within
// a relative L2 error (NaN or Inf fails):
//   kBf16Tol  outputs stored in bf16, and fp32 outputs computed from a bf16-rounded
//             intermediate (expert weight gradients of gate/up, router gradients of a block);
//   kF32Tol   fp32 outputs accumulated in fp32 from bf16 or fp32 inputs (routing, combine
//             dweights, the down projection's weight gradient);
//   exact     copies and single products (gather, combine backward dys).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../test_util.h"
#include "gpu_test_util.h"
#include "kernels/cuda/ops.h"
#include "kernels/moe.h"

namespace strata::testing {
namespace {

namespace ref = kernels::ref;
namespace cu = kernels::cuda;
using kernels::GroupScore;
using kernels::RouterConfig;
using kernels::RouterScoring;

constexpr double kBf16Tol = 1e-2;
constexpr double kF32Tol = 1e-5;

std::string dims(std::initializer_list<std::pair<const char*, int64_t>> values) {
  std::string s;
  for (const auto& [name, value] : values) {
    if (!s.empty()) s += " ";
    s += std::string(name) + "=" + std::to_string(value);
  }
  return s;
}

void expect_close(const std::vector<float>& gpu, const std::vector<float>& want, double tol, const std::string& what) {
  ASSERT_EQ(gpu.size(), want.size()) << what;
  const double err = relative_error(gpu, want);
  EXPECT_TRUE(err <= tol) << what << ": relative error " << err << " exceeds " << tol;
}

// Element by element, bitwise (floats compared by their bits, so NaN never matches a number).
template <typename T>
void expect_same(const std::vector<T>& gpu, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(gpu.size(), want.size()) << what;
  int64_t mismatches = 0, first = -1;
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (std::memcmp(&gpu[i], &want[i], sizeof(T)) != 0) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0) << what << ": first mismatch at " << first << " (" << (first >= 0 ? gpu[first] : T{})
                           << " vs " << (first >= 0 ? want[first] : T{}) << ")";
}

// expert_idx (N,K): each token picks K distinct experts from `allowed` (all E when empty), so
// the experts outside it receive no tokens.
std::vector<int32_t> random_assignments(int64_t N, int64_t K, int64_t E, uint64_t seed,
                                        std::vector<int32_t> allowed = {}) {
  if (allowed.empty()) {
    allowed.resize(static_cast<size_t>(E));
    std::iota(allowed.begin(), allowed.end(), 0);
  }
  EXPECT_GE(static_cast<int64_t>(allowed.size()), K);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> idx(static_cast<size_t>(N * K));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {  // partial Fisher-Yates: the first K of a shuffle
      std::uniform_int_distribution<size_t> pick(static_cast<size_t>(k), allowed.size() - 1);
      std::swap(allowed[static_cast<size_t>(k)], allowed[pick(rng)]);
      idx[static_cast<size_t>(n * K + k)] = allowed[static_cast<size_t>(k)];
    }
  }
  return idx;
}

// Values on a coarse grid (multiples of `step` in [lo, hi]), so that many are exactly equal.
std::vector<float> grid_vector(int64_t n, uint64_t seed, int lo, int hi, float step) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(dist(rng)) * step;
  return v;
}

// The slots of a set of assignments, from the reference permutation.
struct Permutation {
  std::vector<int32_t> slot_of, token_of_slot;
  std::vector<int64_t> offsets;
};
Permutation reference_permutation(const std::vector<int32_t>& expert_idx, int64_t N, int64_t K, int64_t E) {
  Permutation p;
  p.slot_of.resize(static_cast<size_t>(N * K));
  p.token_of_slot.resize(static_cast<size_t>(N * K));
  p.offsets.resize(static_cast<size_t>(E + 1));
  ref::moe_permute(p.slot_of.data(), p.token_of_slot.data(), p.offsets.data(), expert_idx.data(), N, K, E);
  return p;
}

// ---- routing --------------------------------------------------------------------------------

struct RouteCase {
  int64_t N, E, K;
  RouterScoring scoring;
  bool normalize;
  // Group-limited routing and the weights' scale (kernels/moe.h); 1, 1, 1: none.
  int64_t groups = 1, top_groups = 1;
  bool top_two = false;
  float scale = 1.0f;
  RouterConfig config() const {
    return {E, K, scoring, normalize, groups, top_groups, top_two ? GroupScore::kTopTwoSum : GroupScore::kMax, scale};
  }
};

std::vector<RouteCase> route_cases() {
  const auto mixtral = RouterScoring::kTopKThenSoftmax;
  const auto qwen = RouterScoring::kSoftmaxThenTopK;
  const auto sigmoid = RouterScoring::kSigmoidThenTopK;
  return {
      {1, 1, 1, mixtral, false},   {7, 8, 2, mixtral, false}, {257, 8, 2, mixtral, false}, {65, 5, 5, mixtral, false},
      {50, 33, 3, mixtral, false}, {33, 60, 4, qwen, false},  {1000, 60, 4, qwen, true},   {129, 128, 8, qwen, true},
      {20, 257, 6, qwen, false},   {31, 8, 2, qwen, true},    {17, 2048, 8, qwen, true},
      // DeepSeek-V2 (group-limited greedy, scaled), DeepSeek-V3 (sigmoid, top-two group sums).
      {45, 64, 6, qwen, false, 8, 3, false, 16.0f}, {300, 256, 8, sigmoid, true, 8, 4, true, 2.5f},
      {17, 8, 2, sigmoid, false},  {9, 160, 6, sigmoid, true, 16, 3, true, 1.0f},
  };
}

std::string describe(const RouteCase& c, bool bias, const char* inputs) {
  const char* scoring = c.scoring == RouterScoring::kTopKThenSoftmax   ? " topk-then-softmax"
                        : c.scoring == RouterScoring::kSoftmaxThenTopK ? " softmax-then-topk"
                                                                       : " sigmoid-then-topk";
  return dims({{"N", c.N}, {"E", c.E}, {"K", c.K}, {"groups", c.groups}, {"top_groups", c.top_groups}, {"bias", bias}}) +
         scoring + (c.top_two ? " top-two" : "") + (c.normalize ? " normalized " : " ") + inputs;
}

// Forward on both backends from the same logits; checks the outputs; returns nothing (the
// backward test recomputes the reference forward itself).
void check_route_forward(const RouteCase& c, const std::vector<float>& logits, const std::vector<float>* bias,
                         const std::string& what, cudaStream_t stream) {
  const RouterConfig config = c.config();
  std::vector<int32_t> idx(c.N * c.K);
  std::vector<float> weights(c.N * c.K), probs(c.N * c.E);
  ref::moe_route_forward(idx.data(), weights.data(), probs.data(), logits.data(), bias ? bias->data() : nullptr, c.N,
                         config);

  DeviceBuffer<float> d_logits(logits), d_weights(c.N * c.K), d_probs(c.N * c.E);
  DeviceBuffer<int32_t> d_idx(c.N * c.K);
  std::unique_ptr<DeviceBuffer<float>> d_bias;
  if (bias) d_bias = std::make_unique<DeviceBuffer<float>>(*bias);
  cu::moe_route_forward(d_idx.get(), d_weights.get(), d_probs.get(), d_logits.get(), d_bias ? d_bias->get() : nullptr,
                        c.N, config, stream);
  expect_same(d_idx.download<int32_t>(), idx, what + " expert_idx");
  expect_close(download_f32(d_weights), weights, kF32Tol, what + " weights");
  expect_close(download_f32(d_probs), probs, kF32Tol, what + " probs");
}

TEST(MoeParity, RouteForwardSelectsTheSameExperts) {
  StreamGuard stream;
  for (const RouteCase& c : route_cases()) {
    for (bool with_bias : {false, true}) {
      const uint64_t seed = 100 + c.N * 7 + c.E * 3 + c.K + with_bias;
      const std::vector<float> logits = random_vector(c.N * c.E, seed, -3.f, 3.f);
      const std::vector<float> bias = random_vector(c.E, seed + 1, -0.5f, 0.5f);
      check_route_forward(c, logits, with_bias ? &bias : nullptr, describe(c, with_bias, "random"), stream.get());
    }
  }
}

// Logits (and biases) on a coarse grid: many exactly equal scores, which must go to the lower
// expert index on both backends.
TEST(MoeParity, RouteForwardBreaksTiesTowardTheLowerExpert) {
  StreamGuard stream;
  for (const RouteCase& c : route_cases()) {
    for (bool with_bias : {false, true}) {
      const uint64_t seed = 200 + c.N * 7 + c.E * 3 + c.K + with_bias;
      const std::vector<float> logits = grid_vector(c.N * c.E, seed, -4, 4, 0.5f);
      const std::vector<float> bias = grid_vector(c.E, seed + 1, 0, 1, 0.25f);
      check_route_forward(c, logits, with_bias ? &bias : nullptr, describe(c, with_bias, "ties"), stream.get());
    }
  }
}

TEST(MoeParity, RouteBackward) {
  StreamGuard stream;
  for (const RouteCase& c : route_cases()) {
    for (bool with_prob_grad : {false, true}) {
      const std::string what = describe(c, false, with_prob_grad ? "prob_grad" : "no prob_grad");
      const RouterConfig config = c.config();
      const uint64_t seed = 300 + c.N * 7 + c.E * 3 + c.K;
      const std::vector<float> logits = random_vector(c.N * c.E, seed, -3.f, 3.f);
      std::vector<int32_t> idx(c.N * c.K);
      std::vector<float> weights(c.N * c.K), probs(c.N * c.E);
      ref::moe_route_forward(idx.data(), weights.data(), probs.data(), logits.data(), nullptr, c.N, config);
      const std::vector<float> dweights = random_vector(c.N * c.K, seed + 1);
      const std::vector<float> prob_grad = random_vector(c.E, seed + 2, 0.f, 0.05f);
      std::vector<float> dlogits(c.N * c.E);
      ref::moe_route_backward(dlogits.data(), dweights.data(), with_prob_grad ? prob_grad.data() : nullptr,
                              probs.data(), idx.data(), weights.data(), c.N, config);

      DeviceBuffer<float> d_dweights(dweights), d_prob_grad(prob_grad), d_probs(probs);
      DeviceBuffer<float> d_weights(weights), d_dlogits(c.N * c.E);
      DeviceBuffer<int32_t> d_idx(idx);
      cu::moe_route_backward(d_dlogits.get(), d_dweights.get(), with_prob_grad ? d_prob_grad.get() : nullptr,
                             d_probs.get(), d_idx.get(), d_weights.get(), c.N, config, stream.get());
      expect_close(download_f32(d_dlogits), dlogits, kF32Tol, what + " dlogits");
    }
  }
}

// ---- permutation ----------------------------------------------------------------------------

struct AssignmentCase {
  int64_t N, K, E;
  std::vector<int32_t> allowed;  // experts that receive tokens; empty: all
};

std::vector<AssignmentCase> assignment_cases() {
  return {
      {1, 1, 1, {}},
      {7, 2, 8, {}},
      {7, 2, 8, {3, 5}},                // six experts without tokens, the first and last among them
      {257, 2, 8, {1, 2, 3, 4, 5, 6}},  // experts 0 and 7 empty
      {1000, 4, 60, {}},
      {1000, 4, 60, {0, 7, 8, 9, 20, 33, 41, 58}},  // most of the 60 experts empty
      {4097, 8, 256, {}},
      {300, 6, 257, {}},  // 9 key bits: a second radix pass
      {0, 2, 8, {}},      // no tokens at all
  };
}

std::string describe(const AssignmentCase& c) {
  return dims({{"N", c.N}, {"K", c.K}, {"E", c.E}, {"allowed", static_cast<int64_t>(c.allowed.size())}});
}

TEST(MoeParity, PermuteGivesTheReferenceSlots) {
  StreamGuard stream;
  TestContext ctx(16 << 20);
  for (const AssignmentCase& c : assignment_cases()) {
    const std::string what = "permute " + describe(c);
    const std::vector<int32_t> idx = random_assignments(c.N, c.K, c.E, 400 + c.N + c.E, c.allowed);
    const Permutation want = reference_permutation(idx, c.N, c.K, c.E);
    DeviceBuffer<int32_t> d_idx(idx), d_slot_of(c.N * c.K), d_token_of_slot(c.N * c.K);
    DeviceBuffer<int64_t> d_offsets(c.E + 1);
    cu::moe_permute(ctx, d_slot_of.get(), d_token_of_slot.get(), d_offsets.get(), d_idx.get(), c.N, c.K, c.E,
                    stream.get());
    expect_same(d_slot_of.download<int32_t>(), want.slot_of, what + " slot_of");
    expect_same(d_token_of_slot.download<int32_t>(), want.token_of_slot, what + " token_of_slot");
    expect_same(d_offsets.download<int64_t>(), want.offsets, what + " expert_offsets");
  }
}

// Every tile of the expert order, its offsets from the device's offsets as the CPU's make them.
TEST(MoeParity, TileOffsetsAreTheReferences) {
  StreamGuard stream;
  for (const AssignmentCase& c : assignment_cases()) {
    const std::vector<int32_t> idx = random_assignments(c.N, c.K, c.E, 500 + c.N + c.E, c.allowed);
    const Permutation perm = reference_permutation(idx, c.N, c.K, c.E);
    DeviceBuffer<int64_t> d_offsets(perm.offsets), d_tile(c.E + 1);
    const int64_t S = c.N * c.K, tile = std::max<int64_t>(1, S / 3);
    for (int64_t r0 = 0; r0 < S; r0 += tile) {
      const int64_t n = std::min(tile, S - r0);
      std::vector<int64_t> want(static_cast<size_t>(c.E + 1));
      kernels::moe_tile_offsets(want.data(), perm.offsets.data(), c.E, r0, n);
      cu::moe_tile_offsets(d_tile.get(), d_offsets.get(), c.E, r0, n, stream.get());
      expect_same(d_tile.download<int64_t>(), want, "tile offsets " + describe(c) + " from row " + std::to_string(r0));
    }
  }
}

// ---- gather and combine ---------------------------------------------------------------------

TEST(MoeParity, GatherAndCombine) {
  StreamGuard stream;
  struct Case {
    int64_t N, K, E, C;
  };
  for (const Case& c :
       {Case{1, 1, 1, 1}, Case{7, 2, 8, 33}, Case{257, 4, 60, 64}, Case{1000, 8, 64, 129}, Case{5, 2, 8, 4096}}) {
    const int64_t N = c.N, K = c.K, C = c.C, S = N * K;
    const std::string what = dims({{"N", N}, {"K", K}, {"E", c.E}, {"C", C}});
    const std::vector<int32_t> idx = random_assignments(N, K, c.E, 500 + N + C);
    const Permutation perm = reference_permutation(idx, N, K, c.E);
    std::vector<float> x = random_vector(N * C, 501 + N);
    std::vector<float> dxs = random_vector(S * C, 502 + C);
    std::vector<float> ys = random_vector(S * C, 503 + N);
    const std::vector<float> weights = random_vector(S, 504, 0.f, 1.f);
    std::vector<float> dout = random_vector(N * C, 505 + C);
    // Rounds the bf16 inputs in place, before the reference reads them.
    DeviceBuffer<bf16> d_x = upload_bf16(x), d_dxs = upload_bf16(dxs), d_ys = upload_bf16(ys);
    DeviceBuffer<bf16> d_dout = upload_bf16(dout);

    std::vector<float> xs(S * C), dx(N * C), out(N * C), dys(S * C), dweights(S);
    ref::moe_gather(xs.data(), x.data(), perm.token_of_slot.data(), S, C);
    ref::moe_gather_backward(dx.data(), dxs.data(), perm.slot_of.data(), N, K, C);
    ref::moe_combine_forward(out.data(), ys.data(), weights.data(), perm.slot_of.data(), N, K, C);
    ref::moe_combine_backward(dys.data(), dweights.data(), dout.data(), ys.data(), weights.data(), perm.slot_of.data(),
                              N, K, C);

    DeviceBuffer<int32_t> d_slot_of(perm.slot_of), d_token_of_slot(perm.token_of_slot);
    DeviceBuffer<float> d_weights(weights), d_dweights(S);
    DeviceBuffer<bf16> d_xs(S * C), d_dx(N * C), d_out(N * C), d_dys(S * C);
    cu::moe_gather(d_xs.get(), d_x.get(), d_token_of_slot.get(), S, C, stream.get());
    cu::moe_gather_backward(d_dx.get(), d_dxs.get(), d_slot_of.get(), N, K, C, stream.get());
    cu::moe_combine_forward(d_out.get(), d_ys.get(), d_weights.get(), d_slot_of.get(), N, K, C, stream.get());
    cu::moe_combine_backward(d_dys.get(), d_dweights.get(), d_dout.get(), d_ys.get(), d_weights.get(), d_slot_of.get(),
                             N, K, C, stream.get());
    expect_same(download_bf16(d_xs), xs, "gather " + what);
    expect_close(download_bf16(d_dx), dx, kBf16Tol, "gather_backward " + what);
    expect_close(download_bf16(d_out), out, kBf16Tol, "combine_forward " + what);
    // dys = w * dout: the correctly rounded fp32 product on both sides (the reference's double
    // product of an fp32 and a bf16 value is exact), then the GPU's one rounding to bf16.
    round_to_bf16(dys);
    expect_same(download_bf16(d_dys), dys, "combine_backward dys " + what);
    expect_close(download_f32(d_dweights), dweights, kF32Tol, "combine_backward dweights " + what);
  }
}

// ---- experts --------------------------------------------------------------------------------

// E experts' weights (T = bf16: rounded to bf16, the compute copies) or gradients (T = float),
// one device buffer per tensor as the Hugging Face tensors are separate, with host copies (the
// values the device holds, in fp32) and the per-expert pointer arrays both backends take.
enum ExpertPart { kGate = 0, kUp = 1, kDown = 2 };

template <typename T>
struct ExpertSet {
  std::vector<std::vector<float>> host[3];  // gate, up, down
  std::vector<std::unique_ptr<DeviceBuffer<T>>> dev[3];

  ExpertSet(int64_t E, int64_t C, int64_t F, uint64_t seed, float scale) {
    for (int64_t e = 0; e < E; ++e) {
      for (int part = 0; part < 3; ++part) {
        std::vector<float> v = random_vector(F * C, seed + 3 * e + part, -scale, scale);
        if constexpr (std::is_same_v<T, bf16>) {
          dev[part].push_back(std::make_unique<DeviceBuffer<bf16>>(round_to_bf16(v)));
        } else {
          dev[part].push_back(std::make_unique<DeviceBuffer<float>>(v));
        }
        host[part].push_back(std::move(v));
      }
    }
  }
  template <typename U>
  struct Pointers {
    std::vector<U*> part[3];
    kernels::ExpertTensors<U> tensors() const { return {part[kGate].data(), part[kUp].data(), part[kDown].data()}; }
  };
  Pointers<const float> host_const() const {
    Pointers<const float> p;
    for (int part = 0; part < 3; ++part) {
      for (const auto& v : host[part]) p.part[part].push_back(v.data());
    }
    return p;
  }
  Pointers<float> host_mutable() {
    Pointers<float> p;
    for (int part = 0; part < 3; ++part) {
      for (auto& v : host[part]) p.part[part].push_back(v.data());
    }
    return p;
  }
  template <typename U>
  Pointers<U> device() const {
    Pointers<U> p;
    for (int part = 0; part < 3; ++part) {
      for (const auto& buffer : dev[part]) p.part[part].push_back(buffer->get());
    }
    return p;
  }
  // One part of every expert, downloaded and concatenated in expert order.
  std::vector<float> download(ExpertPart part) const {
    std::vector<float> all;
    for (const auto& buffer : dev[part]) {
      std::vector<float> v;
      if constexpr (std::is_same_v<T, bf16>) {
        v = download_bf16(*buffer);
      } else {
        v = download_f32(*buffer);
      }
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }
  std::vector<float> host_all(ExpertPart part) const {
    std::vector<float> all;
    for (const auto& v : host[part]) all.insert(all.end(), v.begin(), v.end());
    return all;
  }
};

// The expert weight gradients against the reference: the down projection's (dys^T @ act, both
// bf16 inputs the reference also sees) within kF32Tol; gate's and up's within kBf16Tol, as they
// come from the GPU's bf16 dgate and dup.
void expect_weight_gradients(const ExpertSet<float>& gpu, const ExpertSet<float>& want, const std::string& what) {
  expect_close(gpu.download(kGate), want.host_all(kGate), kBf16Tol, what + " dW_gate");
  expect_close(gpu.download(kUp), want.host_all(kUp), kBf16Tol, what + " dW_up");
  expect_close(gpu.download(kDown), want.host_all(kDown), kF32Tol, what + " dW_down");
}

struct ExpertCase {
  int64_t N, K, E, C, F;
  std::vector<int32_t> allowed;
};

TEST(MoeParity, ExpertsForwardAndBackward) {
  StreamGuard stream;
  TestContext ctx(16 << 20);
  for (const ExpertCase& c :
       {ExpertCase{33, 2, 8, 64, 96, {}}, ExpertCase{7, 2, 8, 33, 47, {1, 2, 5}},
        ExpertCase{100, 4, 60, 32, 24, {0, 3, 4, 10, 11, 12, 30, 59}}, ExpertCase{100, 4, 60, 48, 40, {}},
        ExpertCase{5, 1, 1, 16, 8, {}}, ExpertCase{257, 2, 8, 129, 257, {}}}) {
    const int64_t N = c.N, K = c.K, E = c.E, C = c.C, F = c.F, S = N * K;
    const std::string what =
        dims({{"N", N}, {"K", K}, {"E", E}, {"C", C}, {"F", F}, {"allowed", static_cast<int64_t>(c.allowed.size())}});
    const std::vector<int32_t> idx = random_assignments(N, K, E, 600 + N + E, c.allowed);
    const Permutation perm = reference_permutation(idx, N, K, E);
    const ExpertSet<bf16> w(E, C, F, 601 + C, 0.2f);
    ExpertSet<float> dw(E, C, F, 602 + F, 0.01f);  // gradients accumulate onto these
    std::vector<float> xs = random_vector(S * C, 603 + S);
    std::vector<float> dys = random_vector(S * C, 604 + S);
    DeviceBuffer<bf16> d_xs = upload_bf16(xs), d_dys = upload_bf16(dys);

    // Reference forward from the rounded inputs.
    std::vector<float> ys(S * C), gate(S * F), up(S * F), act(S * F);
    const auto w_host = w.host_const();
    ref::moe_experts_forward(ys.data(), gate.data(), up.data(), act.data(), xs.data(), perm.offsets.data(),
                             w_host.tensors(), E, C, F);
    DeviceBuffer<int64_t> d_offsets(perm.offsets);
    DeviceBuffer<bf16> d_ys(S * C), d_gate(S * F), d_up(S * F), d_act(S * F);
    const auto w_dev = w.device<const bf16>();
    cu::moe_experts_forward(ctx, d_ys.get(), d_gate.get(), d_up.get(), d_act.get(), d_xs.get(), d_offsets.get(),
                            w_dev.tensors(), E, C, F, stream.get());
    expect_close(download_bf16(d_ys), ys, kBf16Tol, what + " ys");
    expect_close(download_bf16(d_gate), gate, kBf16Tol, what + " gate");
    expect_close(download_bf16(d_up), up, kBf16Tol, what + " up");
    expect_close(download_bf16(d_act), act, kBf16Tol, what + " act");

    // Backward from the reference's activations on both sides, rounded to bf16 first.
    DeviceBuffer<bf16> d_gate_ref = upload_bf16(gate), d_up_ref = upload_bf16(up), d_act_ref = upload_bf16(act);
    ExpertSet<float> dw_ref(E, C, F, 602 + F, 0.01f);  // the same starting values as dw
    std::vector<float> dxs(S * C), dgate(S * F), dup(S * F), dact(S * F);
    auto dw_host = dw_ref.host_mutable();
    ref::moe_experts_backward(dxs.data(), dw_host.tensors(), dgate.data(), dup.data(), dact.data(), dys.data(),
                              xs.data(), gate.data(), up.data(), act.data(), perm.offsets.data(), w_host.tensors(), E,
                              C, F);
    DeviceBuffer<bf16> d_dxs(S * C), d_dgate(S * F), d_dup(S * F), d_dact(S * F);
    const auto dw_dev = dw.device<float>();
    cu::moe_experts_backward(ctx, d_dxs.get(), dw_dev.tensors(), d_dgate.get(), d_dup.get(), d_dact.get(), d_dys.get(),
                             d_xs.get(), d_gate_ref.get(), d_up_ref.get(), d_act_ref.get(), d_offsets.get(),
                             w_dev.tensors(), E, C, F, stream.get());
    expect_close(download_bf16(d_dxs), dxs, kBf16Tol, what + " dxs");
    expect_close(download_bf16(d_dgate), dgate, kBf16Tol, what + " dgate");
    expect_close(download_bf16(d_dup), dup, kBf16Tol, what + " dup");
    expect_close(download_bf16(d_dact), dact, kBf16Tol, what + " dact");
    expect_weight_gradients(dw, dw_ref, what);
    // Experts without tokens: their gradients are left exactly as they were (dw.host still
    // holds the starting values; the reference updated its own copy).
    for (int64_t e = 0; e < E; ++e) {
      if (perm.offsets[e + 1] != perm.offsets[e]) continue;
      for (ExpertPart part : {kGate, kUp, kDown}) {
        expect_same(download_f32(*dw.dev[part][e]), dw.host[part][e],
                    what + " untouched gradients of empty expert " + std::to_string(e) + " part " +
                        std::to_string(part));
      }
    }
  }
}

// ---- router statistics ----------------------------------------------------------------------

TEST(MoeParity, RouterStats) {
  StreamGuard stream;
  for (const AssignmentCase& c : assignment_cases()) {
    const std::string what = "router_stats " + describe(c);
    const std::vector<int32_t> idx = random_assignments(c.N, c.K, c.E, 700 + c.N + c.E, c.allowed);
    const std::vector<float> probs = random_vector(c.N * c.E, 701 + c.N, 0.f, 1.f);
    // Running totals from earlier layers, which the op adds to.
    std::vector<int64_t> counts(static_cast<size_t>(c.E));
    std::vector<double> prob_sums(static_cast<size_t>(c.E));
    for (int64_t e = 0; e < c.E; ++e) {
      counts[static_cast<size_t>(e)] = 3 * e + 1;
      prob_sums[static_cast<size_t>(e)] = 0.25 * static_cast<double>(e);
    }
    DeviceBuffer<int32_t> d_idx(idx);
    DeviceBuffer<float> d_probs(probs);
    DeviceBuffer<int64_t> d_counts(counts);
    DeviceBuffer<double> d_prob_sums(prob_sums);
    ref::moe_router_stats(counts.data(), prob_sums.data(), idx.data(), probs.data(), c.N, c.K, c.E);
    cu::moe_router_stats(d_counts.get(), d_prob_sums.get(), d_idx.get(), d_probs.get(), c.N, c.K, c.E, stream.get());
    expect_same(d_counts.download<int64_t>(), counts, what + " counts");
    const std::vector<double> got = d_prob_sums.download<double>();
    for (int64_t e = 0; e < c.E; ++e) {
      const double want = prob_sums[static_cast<size_t>(e)];
      EXPECT_TRUE(std::fabs(got[static_cast<size_t>(e)] - want) <= 1e-12 * std::max(1.0, want))
          << what << " prob_sums[" << e << "] " << got[static_cast<size_t>(e)] << " vs " << want;
    }
  }
}

// ---- a whole MoE block ----------------------------------------------------------------------

// Routing, permutation, gather, experts, combine and every backward on the GPU from the same
// logits (and the same bf16 x, dout and expert weights) as the reference: the routing decisions
// are the reference's exactly, the results match it within the bf16 tolerance (every float
// result passes through bf16 activations), and a second run is bitwise identical.
TEST(MoeParity, BlockMatchesTheReferenceAndIsBitwiseReproducible) {
  StreamGuard stream;
  TestContext ctx(16 << 20);
  const int64_t N = 513, E = 60, K = 4, C = 64, F = 48, S = N * K;
  RouterConfig config;
  config.num_experts = E;
  config.top_k = K;
  config.scoring = RouterScoring::kSoftmaxThenTopK;
  config.normalize_top_k = true;
  const std::vector<float> logits = random_vector(N * E, 800, -3.f, 3.f);
  const std::vector<float> bias = random_vector(E, 801, -0.1f, 0.1f);
  std::vector<float> x = random_vector(N * C, 802);
  std::vector<float> dout = random_vector(N * C, 803);
  DeviceBuffer<bf16> d_x = upload_bf16(x), d_dout = upload_bf16(dout);
  const ExpertSet<bf16> w(E, C, F, 804, 0.2f);

  // Reference.
  std::vector<int32_t> idx(N * K);
  std::vector<float> weights(N * K), probs(N * E);
  ref::moe_route_forward(idx.data(), weights.data(), probs.data(), logits.data(), bias.data(), N, config);
  const Permutation perm = reference_permutation(idx, N, K, E);
  std::vector<float> xs(S * C), ys(S * C), gate(S * F), up(S * F), act(S * F), out(N * C);
  const auto w_host = w.host_const();
  ref::moe_gather(xs.data(), x.data(), perm.token_of_slot.data(), S, C);
  ref::moe_experts_forward(ys.data(), gate.data(), up.data(), act.data(), xs.data(), perm.offsets.data(),
                           w_host.tensors(), E, C, F);
  ref::moe_combine_forward(out.data(), ys.data(), weights.data(), perm.slot_of.data(), N, K, C);
  ExpertSet<float> dw_ref(E, C, F, 805, 0.0f);
  auto dw_host = dw_ref.host_mutable();
  std::vector<float> dys(S * C), dweights(N * K), dxs(S * C), dgate(S * F), dup(S * F), dact(S * F), dx(N * C),
      dlogits(N * E);
  ref::moe_combine_backward(dys.data(), dweights.data(), dout.data(), ys.data(), weights.data(), perm.slot_of.data(), N,
                            K, C);
  ref::moe_experts_backward(dxs.data(), dw_host.tensors(), dgate.data(), dup.data(), dact.data(), dys.data(), xs.data(),
                            gate.data(), up.data(), act.data(), perm.offsets.data(), w_host.tensors(), E, C, F);
  ref::moe_gather_backward(dx.data(), dxs.data(), perm.slot_of.data(), N, K, C);
  ref::moe_route_backward(dlogits.data(), dweights.data(), nullptr, probs.data(), idx.data(), weights.data(), N,
                          config);

  DeviceBuffer<float> d_logits(logits), d_bias(bias);
  const auto w_dev = w.device<const bf16>();
  struct Result {
    std::vector<int32_t> idx;
    std::vector<float> out, dx, dlogits, dw[3];
  };
  auto run = [&] {
    DeviceBuffer<int32_t> d_idx(N * K), d_slot_of(N * K), d_token_of_slot(S);
    DeviceBuffer<int64_t> d_offsets(E + 1);
    DeviceBuffer<float> d_weights(N * K), d_probs(N * E), d_dweights(N * K), d_dlogits(N * E);
    DeviceBuffer<bf16> d_xs(S * C), d_ys(S * C), d_gate(S * F), d_up(S * F), d_act(S * F), d_out(N * C);
    DeviceBuffer<bf16> d_dys(S * C), d_dxs(S * C), d_dgate(S * F), d_dup(S * F), d_dact(S * F), d_dx(N * C);
    ExpertSet<float> dw(E, C, F, 805, 0.0f);
    const auto dw_dev = dw.device<float>();
    cu::moe_route_forward(d_idx.get(), d_weights.get(), d_probs.get(), d_logits.get(), d_bias.get(), N, config,
                          stream.get());
    cu::moe_permute(ctx, d_slot_of.get(), d_token_of_slot.get(), d_offsets.get(), d_idx.get(), N, K, E, stream.get());
    cu::moe_gather(d_xs.get(), d_x.get(), d_token_of_slot.get(), S, C, stream.get());
    cu::moe_experts_forward(ctx, d_ys.get(), d_gate.get(), d_up.get(), d_act.get(), d_xs.get(), d_offsets.get(),
                            w_dev.tensors(), E, C, F, stream.get());
    cu::moe_combine_forward(d_out.get(), d_ys.get(), d_weights.get(), d_slot_of.get(), N, K, C, stream.get());
    cu::moe_combine_backward(d_dys.get(), d_dweights.get(), d_dout.get(), d_ys.get(), d_weights.get(), d_slot_of.get(),
                             N, K, C, stream.get());
    cu::moe_experts_backward(ctx, d_dxs.get(), dw_dev.tensors(), d_dgate.get(), d_dup.get(), d_dact.get(), d_dys.get(),
                             d_xs.get(), d_gate.get(), d_up.get(), d_act.get(), d_offsets.get(), w_dev.tensors(), E, C,
                             F, stream.get());
    cu::moe_gather_backward(d_dx.get(), d_dxs.get(), d_slot_of.get(), N, K, C, stream.get());
    cu::moe_route_backward(d_dlogits.get(), d_dweights.get(), nullptr, d_probs.get(), d_idx.get(), d_weights.get(), N,
                           config, stream.get());
    return Result{d_idx.download<int32_t>(),
                  download_bf16(d_out),
                  download_bf16(d_dx),
                  download_f32(d_dlogits),
                  {dw.download(kGate), dw.download(kUp), dw.download(kDown)}};
  };
  const Result first = run();
  expect_same(first.idx, idx, "block expert_idx");
  expect_close(first.out, out, kBf16Tol, "block out");
  expect_close(first.dx, dx, kBf16Tol, "block dx");
  // Through dweights = <dout, ys> with the GPU's bf16 ys.
  expect_close(first.dlogits, dlogits, kBf16Tol, "block dlogits");
  // Every expert weight gradient comes from bf16 intermediates (act, dys, dgate, dup) here.
  for (ExpertPart part : {kGate, kUp, kDown}) {
    expect_close(first.dw[part], dw_ref.host_all(part), kBf16Tol,
                 "block expert weight gradients part " + std::to_string(part));
  }
  const Result second = run();
  expect_same(second.idx, first.idx, "second run expert_idx");
  expect_same(second.out, first.out, "second run out");
  expect_same(second.dx, first.dx, "second run dx");
  expect_same(second.dlogits, first.dlogits, "second run dlogits");
  for (ExpertPart part : {kGate, kUp, kDown}) {
    expect_same(second.dw[part], first.dw[part], "second run expert weight gradients part " + std::to_string(part));
  }
}

}  // namespace
}  // namespace strata::testing
