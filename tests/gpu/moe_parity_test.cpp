// Backend parity of the mixture-of-experts ops: every CUDA op of kernels/moe.h against the CPU
// reference (kernels::ref) fed the same fp32 inputs, over Mixtral-like (E=8, K=2) and
// Qwen-MoE-like (E=60, K=4) configurations, both scoring modes, with and without a selection
// bias, odd sizes, and expert assignments that leave some experts without tokens.
//
// Integer outputs (expert_idx, slots, offsets, counts) must match exactly; float outputs within
// kF32Tol (relative L2 error, NaN or Inf fails), copies and single products bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../test_util.h"
#include "gpu_test_util.h"
#include "kernels/cuda/ops.h"
#include "kernels/moe.h"

namespace strata::testing {
namespace {

namespace ref = kernels::ref;
namespace cu = kernels::cuda;
using kernels::RouterConfig;
using kernels::RouterScoring;

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
};

std::vector<RouteCase> route_cases() {
  const auto mixtral = RouterScoring::kTopKThenSoftmax;
  const auto qwen = RouterScoring::kSoftmaxThenTopK;
  return {
      {1, 1, 1, mixtral, false},   {7, 8, 2, mixtral, false}, {257, 8, 2, mixtral, false}, {65, 5, 5, mixtral, false},
      {50, 33, 3, mixtral, false}, {33, 60, 4, qwen, false},  {1000, 60, 4, qwen, true},   {129, 128, 8, qwen, true},
      {20, 257, 6, qwen, false},   {31, 8, 2, qwen, true},    {17, 2048, 8, qwen, true},
  };
}

std::string describe(const RouteCase& c, bool bias, const char* inputs) {
  return dims({{"N", c.N}, {"E", c.E}, {"K", c.K}, {"bias", bias}}) +
         (c.scoring == RouterScoring::kTopKThenSoftmax ? " topk-then-softmax" : " softmax-then-topk") +
         (c.normalize ? " normalized " : " ") + inputs;
}

// Forward on both backends from the same logits; checks the outputs; returns nothing (the
// backward test recomputes the reference forward itself).
void check_route_forward(const RouteCase& c, const std::vector<float>& logits, const std::vector<float>* bias,
                         const std::string& what, cudaStream_t stream) {
  RouterConfig config;
  config.num_experts = c.E;
  config.top_k = c.K;
  config.scoring = c.scoring;
  config.normalize_top_k = c.normalize;
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
      RouterConfig config;
      config.num_experts = c.E;
      config.top_k = c.K;
      config.scoring = c.scoring;
      config.normalize_top_k = c.normalize;
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
  cu::Context ctx(16 << 20);
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
    const std::vector<float> x = random_vector(N * C, 501 + N);
    const std::vector<float> dxs = random_vector(S * C, 502 + C);
    const std::vector<float> ys = random_vector(S * C, 503 + N);
    const std::vector<float> weights = random_vector(S, 504, 0.f, 1.f);
    const std::vector<float> dout = random_vector(N * C, 505 + C);

    std::vector<float> xs(S * C), dx(N * C), out(N * C), dys(S * C), dweights(S);
    ref::moe_gather(xs.data(), x.data(), perm.token_of_slot.data(), S, C);
    ref::moe_gather_backward(dx.data(), dxs.data(), perm.slot_of.data(), N, K, C);
    ref::moe_combine_forward(out.data(), ys.data(), weights.data(), perm.slot_of.data(), N, K, C);
    ref::moe_combine_backward(dys.data(), dweights.data(), dout.data(), ys.data(), weights.data(), perm.slot_of.data(),
                              N, K, C);

    DeviceBuffer<int32_t> d_slot_of(perm.slot_of), d_token_of_slot(perm.token_of_slot);
    DeviceBuffer<float> d_x(x), d_dxs(dxs), d_ys(ys), d_weights(weights), d_dout(dout);
    DeviceBuffer<float> d_xs(S * C), d_dx(N * C), d_out(N * C), d_dys(S * C), d_dweights(S);
    cu::moe_gather(d_xs.get(), d_x.get(), d_token_of_slot.get(), S, C, stream.get());
    cu::moe_gather_backward(d_dx.get(), d_dxs.get(), d_slot_of.get(), N, K, C, stream.get());
    cu::moe_combine_forward(d_out.get(), d_ys.get(), d_weights.get(), d_slot_of.get(), N, K, C, stream.get());
    cu::moe_combine_backward(d_dys.get(), d_dweights.get(), d_dout.get(), d_ys.get(), d_weights.get(), d_slot_of.get(),
                             N, K, C, stream.get());
    expect_same(download_f32(d_xs), xs, "gather " + what);
    expect_close(download_f32(d_dx), dx, kF32Tol, "gather_backward " + what);
    expect_close(download_f32(d_out), out, kF32Tol, "combine_forward " + what);
    // dys = w * dout, one correctly rounded product per element on both sides.
    expect_same(download_f32(d_dys), dys, "combine_backward dys " + what);
    expect_close(download_f32(d_dweights), dweights, kF32Tol, "combine_backward dweights " + what);
  }
}

// ---- experts --------------------------------------------------------------------------------

// E experts' weights (or gradients), one device buffer per tensor as the Hugging Face tensors
// are separate, with host copies and the per-expert pointer arrays both backends take.
struct ExpertSet {
  std::vector<std::vector<float>> host_gate, host_up, host_down;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> dev_gate, dev_up, dev_down;

  ExpertSet(int64_t E, int64_t C, int64_t F, uint64_t seed, float scale) {
    for (int64_t e = 0; e < E; ++e) {
      host_gate.push_back(random_vector(F * C, seed + 3 * e, -scale, scale));
      host_up.push_back(random_vector(F * C, seed + 3 * e + 1, -scale, scale));
      host_down.push_back(random_vector(C * F, seed + 3 * e + 2, -scale, scale));
      dev_gate.push_back(std::make_unique<DeviceBuffer<float>>(host_gate.back()));
      dev_up.push_back(std::make_unique<DeviceBuffer<float>>(host_up.back()));
      dev_down.push_back(std::make_unique<DeviceBuffer<float>>(host_down.back()));
    }
  }
  template <typename T>
  struct Pointers {
    std::vector<T*> gate, up, down;
    kernels::ExpertTensors<T> tensors() const { return {gate.data(), up.data(), down.data()}; }
  };
  Pointers<const float> host_const() const {
    Pointers<const float> p;
    for (size_t e = 0; e < host_gate.size(); ++e) {
      p.gate.push_back(host_gate[e].data());
      p.up.push_back(host_up[e].data());
      p.down.push_back(host_down[e].data());
    }
    return p;
  }
  Pointers<float> host_mutable() {
    Pointers<float> p;
    for (size_t e = 0; e < host_gate.size(); ++e) {
      p.gate.push_back(host_gate[e].data());
      p.up.push_back(host_up[e].data());
      p.down.push_back(host_down[e].data());
    }
    return p;
  }
  template <typename T>
  Pointers<T> device() const {
    Pointers<T> p;
    for (size_t e = 0; e < dev_gate.size(); ++e) {
      p.gate.push_back(dev_gate[e]->get());
      p.up.push_back(dev_up[e]->get());
      p.down.push_back(dev_down[e]->get());
    }
    return p;
  }
  // Every tensor downloaded and concatenated: gate, up, down of expert 0, then expert 1, ...
  std::vector<float> download_all() const {
    std::vector<float> all;
    for (size_t e = 0; e < dev_gate.size(); ++e) {
      for (const auto* buffer : {dev_gate[e].get(), dev_up[e].get(), dev_down[e].get()}) {
        const std::vector<float> part = download_f32(*buffer);
        all.insert(all.end(), part.begin(), part.end());
      }
    }
    return all;
  }
  std::vector<float> host_all() const {
    std::vector<float> all;
    for (size_t e = 0; e < host_gate.size(); ++e) {
      for (const auto* part : {&host_gate[e], &host_up[e], &host_down[e]}) {
        all.insert(all.end(), part->begin(), part->end());
      }
    }
    return all;
  }
};

struct ExpertCase {
  int64_t N, K, E, C, F;
  std::vector<int32_t> allowed;
};

TEST(MoeParity, ExpertsForwardAndBackward) {
  StreamGuard stream;
  cu::Context ctx(16 << 20);
  for (const ExpertCase& c :
       {ExpertCase{33, 2, 8, 64, 96, {}}, ExpertCase{7, 2, 8, 33, 47, {1, 2, 5}},
        ExpertCase{100, 4, 60, 32, 24, {0, 3, 4, 10, 11, 12, 30, 59}}, ExpertCase{100, 4, 60, 48, 40, {}},
        ExpertCase{5, 1, 1, 16, 8, {}}, ExpertCase{257, 2, 8, 129, 257, {}}}) {
    const int64_t N = c.N, K = c.K, E = c.E, C = c.C, F = c.F, S = N * K;
    const std::string what =
        dims({{"N", N}, {"K", K}, {"E", E}, {"C", C}, {"F", F}, {"allowed", static_cast<int64_t>(c.allowed.size())}});
    const std::vector<int32_t> idx = random_assignments(N, K, E, 600 + N + E, c.allowed);
    const Permutation perm = reference_permutation(idx, N, K, E);
    const ExpertSet w(E, C, F, 601 + C, 0.2f);
    ExpertSet dw(E, C, F, 602 + F, 0.01f);  // gradients accumulate onto these
    const std::vector<float> xs = random_vector(S * C, 603 + S);
    const std::vector<float> dys = random_vector(S * C, 604 + S);

    // Reference forward, and backward from the reference's activations on both sides.
    std::vector<float> ys(S * C), gate(S * F), up(S * F), act(S * F);
    const auto w_host = w.host_const();
    ref::moe_experts_forward(ys.data(), gate.data(), up.data(), act.data(), xs.data(), perm.offsets.data(),
                             w_host.tensors(), E, C, F);
    const std::vector<float> dw_before = dw.host_all();
    std::vector<float> dxs(S * C), dgate(S * F), dup(S * F), dact(S * F);
    auto dw_host = dw.host_mutable();
    ref::moe_experts_backward(dxs.data(), dw_host.tensors(), dgate.data(), dup.data(), dact.data(), dys.data(),
                              xs.data(), gate.data(), up.data(), act.data(), perm.offsets.data(), w_host.tensors(), E,
                              C, F);

    DeviceBuffer<int64_t> d_offsets(perm.offsets);
    DeviceBuffer<float> d_xs(xs), d_dys(dys), d_gate_ref(gate), d_up_ref(up), d_act_ref(act);
    DeviceBuffer<float> d_ys(S * C), d_gate(S * F), d_up(S * F), d_act(S * F);
    DeviceBuffer<float> d_dxs(S * C), d_dgate(S * F), d_dup(S * F), d_dact(S * F);
    const auto w_dev = w.device<const float>();
    const auto dw_dev = dw.device<float>();
    cu::moe_experts_forward(ctx, d_ys.get(), d_gate.get(), d_up.get(), d_act.get(), d_xs.get(), d_offsets.get(),
                            w_dev.tensors(), E, C, F, stream.get());
    cu::moe_experts_backward(ctx, d_dxs.get(), dw_dev.tensors(), d_dgate.get(), d_dup.get(), d_dact.get(), d_dys.get(),
                             d_xs.get(), d_gate_ref.get(), d_up_ref.get(), d_act_ref.get(), d_offsets.get(),
                             w_dev.tensors(), E, C, F, stream.get());
    expect_close(download_f32(d_ys), ys, kF32Tol, what + " ys");
    expect_close(download_f32(d_gate), gate, kF32Tol, what + " gate");
    expect_close(download_f32(d_up), up, kF32Tol, what + " up");
    expect_close(download_f32(d_act), act, kF32Tol, what + " act");
    expect_close(download_f32(d_dxs), dxs, kF32Tol, what + " dxs");
    expect_close(download_f32(d_dgate), dgate, kF32Tol, what + " dgate");
    expect_close(download_f32(d_dup), dup, kF32Tol, what + " dup");
    expect_close(download_f32(d_dact), dact, kF32Tol, what + " dact");
    const std::vector<float> dw_gpu = dw.download_all();
    expect_close(dw_gpu, dw.host_all(), kF32Tol, what + " expert weight gradients");
    // Experts without tokens: their gradients are left exactly as they were.
    size_t offset = 0;
    for (int64_t e = 0; e < E; ++e) {
      const size_t size = static_cast<size_t>(2 * F * C + C * F);
      if (perm.offsets[e + 1] == perm.offsets[e]) {
        const std::vector<float> got(dw_gpu.begin() + offset, dw_gpu.begin() + offset + size);
        const std::vector<float> before(dw_before.begin() + offset, dw_before.begin() + offset + size);
        expect_same(got, before, what + " untouched gradients of empty expert " + std::to_string(e));
      }
      offset += size;
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
// logits as the reference: the results match it, and a second run is bitwise identical.
TEST(MoeParity, BlockMatchesTheReferenceAndIsBitwiseReproducible) {
  StreamGuard stream;
  cu::Context ctx(16 << 20);
  const int64_t N = 513, E = 60, K = 4, C = 64, F = 48, S = N * K;
  RouterConfig config;
  config.num_experts = E;
  config.top_k = K;
  config.scoring = RouterScoring::kSoftmaxThenTopK;
  config.normalize_top_k = true;
  const std::vector<float> logits = random_vector(N * E, 800, -3.f, 3.f);
  const std::vector<float> bias = random_vector(E, 801, -0.1f, 0.1f);
  const std::vector<float> x = random_vector(N * C, 802);
  const std::vector<float> dout = random_vector(N * C, 803);
  const ExpertSet w(E, C, F, 804, 0.2f);

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
  ExpertSet dw_ref(E, C, F, 805, 0.0f);
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

  DeviceBuffer<float> d_logits(logits), d_bias(bias), d_x(x), d_dout(dout);
  const auto w_dev = w.device<const float>();
  struct Result {
    std::vector<int32_t> idx;
    std::vector<float> out, dx, dlogits, dw;
  };
  auto run = [&] {
    DeviceBuffer<int32_t> d_idx(N * K), d_slot_of(N * K), d_token_of_slot(S);
    DeviceBuffer<int64_t> d_offsets(E + 1);
    DeviceBuffer<float> d_weights(N * K), d_probs(N * E), d_xs(S * C), d_ys(S * C);
    DeviceBuffer<float> d_gate(S * F), d_up(S * F), d_act(S * F), d_out(N * C);
    DeviceBuffer<float> d_dys(S * C), d_dweights(N * K), d_dxs(S * C), d_dgate(S * F);
    DeviceBuffer<float> d_dup(S * F), d_dact(S * F), d_dx(N * C), d_dlogits(N * E);
    ExpertSet dw(E, C, F, 805, 0.0f);
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
    return Result{d_idx.download<int32_t>(), download_f32(d_out), download_f32(d_dx), download_f32(d_dlogits),
                  dw.download_all()};
  };
  const Result first = run();
  expect_same(first.idx, idx, "block expert_idx");
  expect_close(first.out, out, kF32Tol, "block out");
  expect_close(first.dx, dx, kF32Tol, "block dx");
  expect_close(first.dlogits, dlogits, kF32Tol, "block dlogits");
  expect_close(first.dw, dw_ref.host_all(), kF32Tol, "block expert weight gradients");
  const Result second = run();
  expect_same(second.idx, first.idx, "second run expert_idx");
  expect_same(second.out, first.out, "second run out");
  expect_same(second.dx, first.dx, "second run dx");
  expect_same(second.dlogits, first.dlogits, "second run dlogits");
  expect_same(second.dw, first.dw, "second run expert weight gradients");
}

}  // namespace
}  // namespace strata::testing
