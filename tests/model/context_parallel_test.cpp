// Context parallelism's layout and ring attention, in one process: every rank of a ring of N is
// simulated with the block ops (kernels/attention.h) over the layout of model/context_parallel.h,
// and the merged results are compared with causal attention over the whole sequence.
#include "model/context_parallel.h"

#include <cmath>
#include <numeric>
#include <vector>

#include <filesystem>
#include <memory>
#include <thread>
#include <unistd.h>

#include "../test_util.h"
#include "flat_model.h"
#include "kernels/attention.h"
#include "core/cpu_device.h"
#include "parallel/comm.h"

namespace strata::model {
namespace {

using kernels::AttentionBlock;
using strata::testing::random_vector;

TEST(ContextParallelLayout, EachRankTakesChunksRAndTwoNMinusOneMinusR) {
  EXPECT_EQ(context_chunk(4, 0, 0), 0);
  EXPECT_EQ(context_chunk(4, 0, 1), 7);
  EXPECT_EQ(context_chunk(4, 3, 0), 3);
  EXPECT_EQ(context_chunk(4, 3, 1), 4);
  // Every chunk is held by exactly one rank.
  for (int64_t n : {1, 2, 3, 4}) {
    std::vector<int> held(static_cast<size_t>(2 * n), 0);
    for (int64_t r = 0; r < n; ++r)
      for (int half = 0; half < 2; ++half) ++held[static_cast<size_t>(context_chunk(n, r, half))];
    for (int h : held) EXPECT_EQ(h, 1);
  }
  EXPECT_EQ(context_block(3, 1), AttentionBlock::kFull);
  EXPECT_EQ(context_block(2, 2), AttentionBlock::kCausal);
  EXPECT_EQ(context_block(1, 2), std::nullopt);
  EXPECT_EQ(context_ring_source(4, 1, 0), 1);
  EXPECT_EQ(context_ring_source(4, 1, 2), 3);
}

TEST(ContextParallelLayout, SplitAndMergeRoundTripAndPositionsAreTheSequences) {
  const int64_t B = 2, T = 24, W = 3;
  std::vector<int32_t> seq(static_cast<size_t>(B * T * W));
  std::iota(seq.begin(), seq.end(), 0);
  for (int64_t n : {1, 2, 3}) {
    std::vector<int32_t> back(seq.size(), -1);
    int64_t causal_keys_first = -1;
    for (int64_t r = 0; r < n; ++r) {
      std::vector<int32_t> local(static_cast<size_t>(B * T * W / n));
      context_split(local.data(), seq.data(), B, T, W, sizeof(int32_t), n, r);
      std::vector<int32_t> pos(static_cast<size_t>(B * T / n));
      context_positions(pos.data(), B, T, n, r);
      // Token i of the local rows is sequence token pos[i] of its sequence.
      for (int64_t i = 0; i < B * T / n; ++i) {
        const int64_t row = i / (T / (2 * n)), b = row % B;
        ASSERT_EQ(local[static_cast<size_t>(i * W)], seq[static_cast<size_t>((b * T + pos[i]) * W)]);
      }
      context_merge(back.data(), local.data(), B, T, W, sizeof(int32_t), n, r);
      // Load balance: the keys a rank's queries see (causally) are the same on every rank.
      int64_t keys = 0;
      for (int64_t i = 0; i < B * T / n; ++i) keys += pos[i] + 1;
      if (r == 0) causal_keys_first = keys;
      EXPECT_EQ(keys, causal_keys_first) << "rank " << r << " of " << n;
    }
    EXPECT_EQ(back, seq);
  }
}

// One attention problem over whole sequences, in (B, T, H, D) layout.
struct Problem {
  int64_t B, T, Hq, Hkv, D, Dv;
  std::vector<float> q, k, v, dout;
  Problem(int64_t B_, int64_t T_, int64_t Hq_, int64_t Hkv_, int64_t D_, int64_t Dv_)
      : B(B_), T(T_), Hq(Hq_), Hkv(Hkv_), D(D_), Dv(Dv_) {
    q = random_vector(B * T * Hq * D, 11);
    k = random_vector(B * T * Hkv * D, 12);
    v = random_vector(B * T * Hkv * Dv, 13);
    dout = random_vector(B * T * Hq * Dv, 14);
  }
};

struct Outputs {
  std::vector<float> out, lse, dq, dk, dv;
};

using Forward = decltype(&kernels::cpu::attention_block_forward);
using Backward = decltype(&kernels::cpu::attention_block_backward);

// The ring over N simulated ranks; results gathered back into the sequences' layout. lse is
// (B, Hq, T) as attention_forward writes it. Backward runs on the given out and lse (the whole
// attention's), so that only the order of its sums differs from the unsplit backward.
Outputs ring(const Problem& p, int64_t N, Forward forward, Backward backward, const Outputs& whole) {
  const int64_t B = p.B, T = p.T, C = T / (2 * N), Hq = p.Hq, Hkv = p.Hkv, D = p.D, Dv = p.Dv;
  auto split = [&](const std::vector<float>& x, int64_t width, int64_t r) {
    std::vector<float> local(x.size() / static_cast<size_t>(N));
    context_split(local.data(), x.data(), B, T, width, sizeof(float), N, r);
    return local;
  };
  // lse (B, Hq, T) per rank as (2B, Hq, C).
  auto split_lse = [&](const std::vector<float>& lse, int64_t r) {
    std::vector<float> local(static_cast<size_t>(2 * B * Hq * C));
    for (int half = 0; half < 2; ++half)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t t = 0; t < C; ++t)
            local[static_cast<size_t>(((half * B + b) * Hq + h) * C + t)] =
                lse[static_cast<size_t>((b * Hq + h) * T + context_chunk(N, r, half) * C + t)];
    return local;
  };
  const int64_t qw = Hq * D, kw = Hkv * D, vw = Hkv * Dv, ow = Hq * Dv;
  std::vector<std::vector<float>> q(N), k(N), v(N), dout(N), wout(N), wlse(N);
  for (int64_t r = 0; r < N; ++r) {
    q[r] = split(p.q, qw, r);
    k[r] = split(p.k, kw, r);
    v[r] = split(p.v, vw, r);
    dout[r] = split(p.dout, ow, r);
    wout[r] = split(whole.out, ow, r);
    wlse[r] = split_lse(whole.lse, r);
  }
  Outputs o;
  o.out.assign(p.B * T * ow, 0.0f);
  o.lse.assign(static_cast<size_t>(B * Hq * T), 0.0f);
  o.dq.assign(p.q.size(), 0.0f);
  o.dk.assign(p.k.size(), 0.0f);
  o.dv.assign(p.v.size(), 0.0f);
  // Offsets of half h in a rank's local tensors of `width` elements per token.
  auto half_at = [&](int half, int64_t width) { return static_cast<size_t>(half * B * C * width); };
  std::vector<std::vector<float>> dk(N, std::vector<float>(k[0].size(), 0.0f));
  std::vector<std::vector<float>> dv(N, std::vector<float>(v[0].size(), 0.0f));
  for (int64_t r = 0; r < N; ++r) {
    std::vector<float> out(q[r].size() / static_cast<size_t>(D) * static_cast<size_t>(Dv)),
        lse(static_cast<size_t>(2 * B * Hq * C)), dq(q[r].size(), std::nanf(""));
    bool started[2] = {false, false};
    bool dq_started[2] = {false, false};  // a half's first block writes its dq, the later ones add
    for (int64_t s = 0; s < N; ++s) {
      const int64_t src = context_ring_source(N, r, s);
      for (int qh = 0; qh < 2; ++qh)
        for (int kh = 0; kh < 2; ++kh) {
          const auto block = context_block(context_chunk(N, r, qh), context_chunk(N, src, kh));
          if (!block) continue;
          forward(out.data() + half_at(qh, ow), lse.data() + half_at(qh, Hq), q[r].data() + half_at(qh, qw),
                  k[src].data() + half_at(kh, kw), v[src].data() + half_at(kh, vw), B, C, C, Hq, Hkv, D, *block,
                  started[qh], Dv, 0);
          started[qh] = true;
          backward(dq.data() + half_at(qh, qw), dk[src].data() + half_at(kh, kw), dv[src].data() + half_at(kh, vw),
                   dout[r].data() + half_at(qh, ow), q[r].data() + half_at(qh, qw), k[src].data() + half_at(kh, kw),
                   v[src].data() + half_at(kh, vw), wout[r].data() + half_at(qh, ow), wlse[r].data() + half_at(qh, Hq),
                   B, C, C, Hq, Hkv, D, *block, dq_started[qh], /*accumulate_dkv=*/true, Dv, 0);
          dq_started[qh] = true;
        }
    }
    context_merge(o.out.data(), out.data(), B, T, ow, sizeof(float), N, r);
    context_merge(o.dq.data(), dq.data(), B, T, qw, sizeof(float), N, r);
    for (int half = 0; half < 2; ++half)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t t = 0; t < C; ++t)
            o.lse[static_cast<size_t>((b * Hq + h) * T + context_chunk(N, r, half) * C + t)] =
                lse[static_cast<size_t>(((half * B + b) * Hq + h) * C + t)];
  }
  for (int64_t r = 0; r < N; ++r) {
    context_merge(o.dk.data(), dk[r].data(), B, T, kw, sizeof(float), N, r);
    context_merge(o.dv.data(), dv[r].data(), B, T, vw, sizeof(float), N, r);
  }
  return o;
}

Outputs whole_attention(const Problem& p, bool fast) {
  Outputs o;
  o.out.resize(static_cast<size_t>(p.B * p.T * p.Hq * p.Dv));
  o.lse.resize(static_cast<size_t>(p.B * p.Hq * p.T));
  o.dq.resize(p.q.size());
  o.dk.resize(p.k.size());
  o.dv.resize(p.v.size());
  auto f = fast ? kernels::cpu::attention_forward : kernels::ref::attention_forward;
  auto b = fast ? kernels::cpu::attention_backward : kernels::ref::attention_backward;
  f(o.out.data(), o.lse.data(), p.q.data(), p.k.data(), p.v.data(), p.B, p.T, p.Hq, p.Hkv, p.D, 0, nullptr, p.Dv, 0);
  b(o.dq.data(), o.dk.data(), o.dv.data(), p.dout.data(), p.q.data(), p.k.data(), p.v.data(), o.out.data(),
    o.lse.data(), p.B, p.T, p.Hq, p.Hkv, p.D, nullptr, p.Dv, 0);
  return o;
}

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float a : x) m = std::max(m, double(std::fabs(a)));
  return m;
}

void expect_within(const std::vector<float>& got, const std::vector<float>& want, double bound, const char* what,
                   int64_t N) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_TRUE(std::fabs(double(got[i]) - double(want[i])) <= bound)
        << what << "[" << i << "] " << got[i] << " over a ring of " << N << ", " << want[i] << " whole; bound "
        << bound;
}

// The magnitudes the backward's sums add, per element of dq, dk, dv (double, from the whole
// attention's lse): with a_ij = p_ij (Sum_d |dout_i||v_j| + Sum_d |dout_i||out_i|), the bound on
// |ds_ij| and on what its dot products round,
//   dq_i: scale Sum_j a_ij |k_j|;  dk_j: scale Sum_i a_ij |q_i|;  dv_j: Sum_i p_ij |dout_i|.
Outputs magnitudes(const Problem& p, const Outputs& whole) {
  const int64_t B = p.B, T = p.T, Hq = p.Hq, Hkv = p.Hkv, D = p.D, Dv = p.Dv, group = Hq / Hkv;
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<double> mq(p.q.size(), 0.0), mk(p.k.size(), 0.0), mv(p.v.size(), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const int64_t qi = ((b * T + i) * Hq + h) * D, oi = ((b * T + i) * Hq + h) * Dv;
        double dout_out = 0;
        for (int64_t d = 0; d < Dv; ++d) dout_out += std::fabs(p.dout[oi + d] * whole.out[oi + d]);
        for (int64_t j = 0; j <= i; ++j) {
          const int64_t kj = ((b * T + j) * Hkv + h / group) * D, vj = ((b * T + j) * Hkv + h / group) * Dv;
          double s = 0, dout_v = 0;
          for (int64_t d = 0; d < D; ++d) s += double(p.q[qi + d]) * p.k[kj + d];
          for (int64_t d = 0; d < Dv; ++d) dout_v += std::fabs(double(p.dout[oi + d]) * p.v[vj + d]);
          const double pij = std::exp(scale * s - whole.lse[(b * Hq + h) * T + i]);
          const double a = pij * (dout_v + dout_out);
          for (int64_t d = 0; d < D; ++d) {
            mq[qi + d] += scale * a * std::fabs(p.k[kj + d]);
            mk[kj + d] += scale * a * std::fabs(p.q[qi + d]);
          }
          for (int64_t d = 0; d < Dv; ++d) mv[vj + d] += pij * std::fabs(p.dout[oi + d]);
        }
      }
  Outputs m;
  m.dq.assign(mq.begin(), mq.end());
  m.dk.assign(mk.begin(), mk.end());
  m.dv.assign(mv.begin(), mv.end());
  return m;
}

void expect_within_magnitudes(const std::vector<float>& got, const std::vector<float>& want,
                              const std::vector<float>& magnitude, double factor, const char* what, int64_t N) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound = factor * magnitude[i] + 1e-30;
    ASSERT_TRUE(std::fabs(double(got[i]) - double(want[i])) <= bound)
        << what << "[" << i << "] " << got[i] << " over a ring of " << N << ", " << want[i] << " whole; bound "
        << bound;
  }
}

// The ring against whole-sequence attention, fp32 fast path and reference.
//
// Forward: the ring is the whole row's online softmax with the keys taken in other tiles (each
// block a tile of C keys, plus the key tiles inside it) and merged once per block in double,
// each merge rounding out and lse once more. So the key-tile bound of tests/kernels/attention_test
// applies with n_t = the tiles of C keys in every block, plus 2 u per merge:
//   |out - out_whole| <= 3 (n + n_t + 8) u max|v| + 2 (2N) u max|v|,
//   |lse - lse_whole| <= (n + 4 n_t + 8) u + 2 u |lse| (1 + 2N).
// The reference path (double inside) leaves the roundings of the merges: 2 u (2N + 1) per value.
// Backward on the whole attention's out and lse adds the same terms in another order (blocks of
// keys for dq, blocks of queries for dk and dv): each side of a sum of n terms is within (n - 1) u
// of the sum of their magnitudes (above), and each term within its dot products' (2D + 2Dv) u, so
//   |ring - whole| <= 2 (T + 2 D + 2 Dv + 16) u magnitude.
void expect_ring_matches_whole(const Problem& p, int64_t N, bool fast) {
  const Outputs whole = whole_attention(p, fast);
  const Outputs r = fast ? ring(p, N, kernels::cpu::attention_block_forward, kernels::cpu::attention_block_backward, whole)
                         : ring(p, N, kernels::ref::attention_block_forward, kernels::ref::attention_block_backward, whole);
  const double u = std::ldexp(1.0, -24);
  const double n = double(p.T), C = double(p.T / (2 * N));
  const double tile = double(kernels::attention_key_tile() > 0 ? kernels::attention_key_tile() : p.T);
  const double n_t = 2.0 * N * std::ceil(C / std::min(tile, C)) + std::ceil(n / std::min(tile, n));
  const double mv = max_abs(p.v);
  const double merges = 2.0 * N;
  const double out_bound = fast ? 3 * (n + n_t + 8) * u * mv + 2 * merges * u * mv : 2 * u * (merges + 1) * mv;
  expect_within(r.out, whole.out, out_bound, "out", N);
  for (size_t i = 0; i < r.lse.size(); ++i) {
    const double bound = (fast ? (n + 4 * n_t + 8) * u : 0.0) + 2 * u * std::fabs(whole.lse[i]) * (1 + merges);
    ASSERT_TRUE(std::fabs(double(r.lse[i]) - double(whole.lse[i])) <= bound)
        << "lse[" << i << "] " << r.lse[i] << " over a ring of " << N << ", " << whole.lse[i] << " whole";
  }
  const Outputs m = magnitudes(p, whole);
  const double factor = 2 * (n + 2.0 * double(p.D + p.Dv) + 16) * u;
  expect_within_magnitudes(r.dq, whole.dq, m.dq, factor, "dq", N);
  expect_within_magnitudes(r.dk, whole.dk, m.dk, factor, "dk", N);
  expect_within_magnitudes(r.dv, whole.dv, m.dv, factor, "dv", N);
}

TEST(RingAttention, MatchesWholeSequenceAttentionAtRingsOfOneTwoAndFour) {
  for (int64_t N : {1, 2, 4}) {
    expect_ring_matches_whole(Problem(2, 8 * 24, 4, 2, 16, 16), N, /*fast=*/true);
    expect_ring_matches_whole(Problem(1, 8 * 12, 4, 1, 24, 8), N, /*fast=*/true);  // MLA-like d_v != d_qk
    expect_ring_matches_whole(Problem(2, 8 * 6, 2, 2, 8, 8), N, /*fast=*/false);
  }
}

// A masked-out quarter proves the mask matters: a ring that treated every block as full (or
// skipped the full ones) would be far outside the bound, so the bound is a real test.
TEST(RingAttention, AWrongMaskIsFarOutsideTheBound) {
  const Problem p(1, 32, 2, 1, 8, 8);
  const Outputs whole = whole_attention(p, true);
  auto all_full = [](float* out, float* lse, const float* q, const float* k, const float* v, int64_t B, int64_t Tq,
                     int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D, AttentionBlock, bool accumulate, int64_t Dv,
                     double scale) {
    kernels::cpu::attention_block_forward(out, lse, q, k, v, B, Tq, Tk, Hq, Hkv, D, AttentionBlock::kFull, accumulate,
                                          Dv, scale);
  };
  auto all_full_backward = [](float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                              const float* v, const float* out, const float* lse, int64_t B, int64_t Tq, int64_t Tk,
                              int64_t Hq, int64_t Hkv, int64_t D, AttentionBlock, bool accumulate_dq,
                              bool accumulate_dkv, int64_t Dv, double scale) {
    kernels::cpu::attention_block_backward(dq, dk, dv, dout, q, k, v, out, lse, B, Tq, Tk, Hq, Hkv, D,
                                           AttentionBlock::kFull, accumulate_dq, accumulate_dkv, Dv, scale);
  };
  const Outputs r = ring(p, 2, all_full, all_full_backward, whole);
  double worst = 0;
  for (size_t i = 0; i < r.out.size(); ++i) worst = std::max(worst, std::fabs(double(r.out[i]) - whole.out[i]));
  EXPECT_GT(worst, 1e-2);
  // The backward's bound, by the magnitudes of the right mask, is broken by far as well.
  const Outputs m = magnitudes(p, whole);
  const double factor = 2 * (double(p.T) + 2.0 * double(p.D + p.Dv) + 16) * std::ldexp(1.0, -24);
  double ratio = 0;
  for (size_t i = 0; i < r.dk.size(); ++i)
    ratio = std::max(ratio, std::fabs(double(r.dk[i]) - whole.dk[i]) / (factor * m.dk[i] + 1e-30));
  EXPECT_GT(ratio, 100.0);
}

// A causal block that writes (no accumulation) is attention_forward and attention_backward bit
// for bit, over outputs that held NaN before; fast path and reference.
TEST(RingAttention, ACausalBlockIsWholeSequenceAttentionBitwise) {
  const Problem p(2, 40, 4, 2, 16, 8);
  for (const bool fast : {true, false}) {
    const Outputs whole = whole_attention(p, fast);
    const float nan = std::nanf("");
    std::vector<float> out(whole.out.size(), nan), lse(whole.lse.size(), nan), dq(p.q.size(), nan),
        dk(p.k.size(), nan), dv(p.v.size(), nan);
    auto forward = fast ? kernels::cpu::attention_block_forward : kernels::ref::attention_block_forward;
    auto backward = fast ? kernels::cpu::attention_block_backward : kernels::ref::attention_block_backward;
    forward(out.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), p.B, p.T, p.T, p.Hq, p.Hkv, p.D,
            AttentionBlock::kCausal, false, p.Dv, 0);
    EXPECT_EQ(out, whole.out);
    EXPECT_EQ(lse, whole.lse);
    backward(dq.data(), dk.data(), dv.data(), p.dout.data(), p.q.data(), p.k.data(), p.v.data(), whole.out.data(),
             whole.lse.data(), p.B, p.T, p.T, p.Hq, p.Hkv, p.D, AttentionBlock::kCausal, false, false, p.Dv, 0);
    EXPECT_EQ(dq, whole.dq);
    EXPECT_EQ(dk, whole.dk);
    EXPECT_EQ(dv, whole.dv);
  }
}

// aux: the auxiliary load-balancing loss joins the gradients; its statistics are the whole
// micro-batch's, summed over the group.
ModelConfig ring_config(bool moe, bool aux = false) {
  ModelConfig c;
  c.vocab_size = 61;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 128;
  if (moe) {
    c.output_router_logits = aux;
    c.router_aux_loss_coef = aux ? 0.05 : 0.0;
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 24;
    c.shared_expert_intermediate_size = 16;
  }
  c.fill_defaults();
  return c;
}

struct RankResult {
  double loss = 0;
  std::vector<float> grads;
  uint64_t bytes_sent = 0;
  std::string error;
};

// Tokens of S sequences of T.
struct Batch {
  std::vector<int32_t> inputs, targets;
  Batch(const ModelConfig& config, int64_t S, int64_t T) : inputs(static_cast<size_t>(S * T)), targets(inputs.size()) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      inputs[i] = static_cast<int32_t>((i * 37 + 11) % static_cast<size_t>(config.vocab_size));
      targets[i] = i % 13 == 5 ? -1 : static_cast<int32_t>((i * 53 + 3) % static_cast<size_t>(config.vocab_size));
    }
  }
};

// A context group of N ranks (threads, each with its own Gloo connection and model) over S whole
// sequences of T tokens: each rank's loss, gradients and bytes sent. chaos_seed >= 0: each rank's
// ops are queued on a compute stream of a CPU device in chaos mode with that seed (random delays
// before each task, so an exchange that does not wait for the blocks it must shows), else they
// run in the calling thread.
template <class Net>
std::vector<RankResult> run_context_group(const ModelConfig& config, int64_t N, const Batch& batch, int64_t S,
                                          int64_t T, int64_t chaos_seed = -1) {
  const std::string dir = ::testing::TempDir() + "/ring_" + std::to_string(getpid()) + "_" + std::to_string(N) + "_" +
                          std::to_string(config.num_experts) + "_" + std::to_string(sizeof(typename Net::Act)) + "_" +
                          std::to_string(chaos_seed);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<RankResult> results(static_cast<size_t>(N));
  std::vector<std::thread> threads;
  for (int64_t r = 0; r < N; ++r) {
    threads.emplace_back([&, r] {
      RankResult& out = results[static_cast<size_t>(r)];
      parallel::LaunchInfo launch;
      launch.rank = static_cast<int>(r);
      launch.world_size = static_cast<int>(N);
      launch.local_rank = launch.rank;
      launch.local_world_size = launch.world_size;
      launch.launcher = "torchrun";
      launch.job_id = "ring";
      parallel::CommOptions options;
      options.backend = "gloo";
      options.rendezvous_dir = dir;
      options.timeout = std::chrono::seconds(60);
      Result<std::unique_ptr<parallel::Comm>> comm = parallel::connect(launch, options);
      if (!comm.ok()) {
        out.error = comm.status().to_string();
        return;
      }
      std::unique_ptr<CpuDevice> device;
      if (chaos_seed >= 0) {
        Result<std::unique_ptr<CpuDevice>> made = CpuDevice::create(0, 0, static_cast<uint64_t>(chaos_seed) + 1);
        if (!made.ok()) {
          out.error = made.status().to_string();
          return;
        }
        device = std::move(*made);
      }
      FlatModel<Net> m(config, typename Net::OpSet(device.get()));
      m.init_weights(7);
      m.net().set_context_comm(comm->get());
      std::vector<int32_t> in(batch.inputs.size() / static_cast<size_t>(N)), tg(in.size());
      context_split(in.data(), batch.inputs.data(), S, T, 1, sizeof(int32_t), N, r);
      context_split(tg.data(), batch.targets.data(), S, T, 1, sizeof(int32_t), N, r);
      Result<double> loss = m.compute(in.data(), tg.data(), 2 * S, T / (2 * N), 1.0f, /*backward=*/true);
      if (!loss.ok()) {
        out.error = loss.status().to_string();
        return;
      }
      out.loss = *loss;
      out.grads.assign(m.grads(), m.grads() + m.layout().total_size());
      out.bytes_sent = (*comm)->bytes_sent();
      m.net().set_context_comm(nullptr);
    });
  }
  for (std::thread& t : threads) t.join();
  std::filesystem::remove_all(dir);
  return results;
}

// One process over S whole sequences of T tokens against a context group of N ranks over the same
// tokens: the ranks' losses and gradients add up to the whole's, within fp32 (bf16) reordering,
// and each rank sends the ring's bytes: per layer, the keys and values N - 1 times in forward,
// again in the recompute (all layers but the last) and in backward, and the fp32 sums of their
// gradients N times.
template <class Net>
void expect_context_group_matches_one_process(int64_t N, bool moe, double tolerance, bool aux = false) {
  const ModelConfig config = ring_config(moe, aux);
  const int64_t S = 2, C = 8, T = 2 * N * C;
  const Batch batch(config, S, T);
  FlatModel<Net> whole(config);
  whole.init_weights(7);
  Result<double> want = whole.compute(batch.inputs.data(), batch.targets.data(), S, T, 1.0f, /*backward=*/true);
  ASSERT_TRUE(want.ok()) << want.status().to_string();
  const std::vector<RankResult> results = run_context_group<Net>(config, N, batch, S, T);
  double loss = 0;
  std::vector<double> grads(static_cast<size_t>(whole.layout().total_size()), 0.0);
  const int64_t L = config.num_hidden_layers;
  const uint64_t kv_elems = static_cast<uint64_t>(2 * S * C * config.num_key_value_heads * config.head_dim);
  const uint64_t kv_bytes = kv_elems * sizeof(typename Net::Act), sum_bytes = kv_elems * sizeof(float);
  // MoE: the router statistics (E counts, E probability sums) all-gathered once a forward, and
  // with the auxiliary loss the valid targets too, each rank sending its share N - 1 times.
  const uint64_t stats_bytes = moe ? static_cast<uint64_t>(N - 1) * (16 * config.num_experts + (aux ? 8 : 0)) : 0;
  const uint64_t ring_bytes =
      N == 1 ? 0 : static_cast<uint64_t>(3 * L - 1) * 2 * (N - 1) * kv_bytes + static_cast<uint64_t>(L) * 2 * N * sum_bytes;
  for (const RankResult& r : results) {
    ASSERT_TRUE(r.error.empty()) << r.error;
    loss += r.loss;
    for (size_t i = 0; i < grads.size(); ++i) grads[i] += r.grads[i];
    EXPECT_EQ(r.bytes_sent, ring_bytes + stats_bytes);
  }
  EXPECT_TRUE(std::fabs(loss - *want) <= tolerance * std::fabs(*want)) << loss << " over the ring, " << *want;
  const std::vector<float> summed(grads.begin(), grads.end());
  const std::vector<float> expected(whole.grads(), whole.grads() + whole.layout().total_size());
  const double err = strata::testing::relative_error(summed, expected);
  EXPECT_TRUE(err <= tolerance) << "gradients' relative error " << err << " over a ring of " << N;
}

// The ops queued on a compute stream whose tasks start after random delays, the exchanges on the
// calling thread beside them (overlapped, host marks saying when a buffer is free): the same bits
// as the ops run in the calling thread, on every rank, at rings of 2, 3 and 4.
TEST(ContextParallelModel, QueuedOpsOnChaoticStreamsGiveTheBitsOfOpsInTheCaller) {
  for (const bool moe : {false, true}) {
    const ModelConfig config = ring_config(moe);
    // (An odd ring ends with this rank's gradient sums in the buffer the next layer's first
    // exchange receives into.)
    for (int64_t N : {2, 3, 4}) {
      const int64_t S = 2, T = 2 * N * 8;
      const Batch batch(config, S, T);
      const std::vector<RankResult> direct = run_context_group<LlamaModel>(config, N, batch, S, T);
      for (int64_t seed : {1, 2}) {
        const std::vector<RankResult> queued = run_context_group<LlamaModel>(config, N, batch, S, T, seed);
        for (int64_t r = 0; r < N; ++r) {
          ASSERT_TRUE(direct[r].error.empty() && queued[r].error.empty()) << direct[r].error << queued[r].error;
          EXPECT_EQ(queued[r].loss, direct[r].loss) << "rank " << r << " of " << N << ", chaos seed " << seed;
          EXPECT_EQ(queued[r].grads, direct[r].grads) << "rank " << r << " of " << N << ", chaos seed " << seed;
        }
      }
    }
  }
}

TEST(ContextParallelModel, Fp32DenseAtRingsOfTwoAndFour) {
  for (int64_t N : {1, 2, 4}) expect_context_group_matches_one_process<LlamaModel>(N, false, 1e-5);
}

TEST(ContextParallelModel, Fp32MoeAtRingsOfTwoAndFour) {
  for (int64_t N : {2, 4}) expect_context_group_matches_one_process<LlamaModel>(N, true, 1e-5);
  for (int64_t N : {2, 4}) expect_context_group_matches_one_process<LlamaModel>(N, true, 1e-5, /*aux=*/true);
}

TEST(ContextParallelModel, Bf16DenseAtRingOfTwo) {
  expect_context_group_matches_one_process<LlamaModelBf16>(2, false, 1e-3);
}

}  // namespace
}  // namespace strata::model
