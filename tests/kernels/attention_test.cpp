// Causal GQA attention: fast path against the reference, reference backward
// against finite differences, causality, determinism.
#include "kernels/attention.h"

#include <omp.h>

#include <cmath>
#include <ostream>
#include <vector>

#include "../test_util.h"

namespace strata::kernels {
namespace {

using strata::testing::finite_difference;
using strata::testing::max_scaled_error;
using strata::testing::random_vector;
using strata::testing::relative_error;

struct AttnShape {
  int64_t B, T, Hq, Hkv, D;
};
// Readable parameter names in test output.
void PrintTo(const AttnShape &s, std::ostream *os) {
  *os << "B=" << s.B << " "
      << "T=" << s.T << " "
      << "Hq=" << s.Hq << " "
      << "Hkv=" << s.Hkv << " "
      << "D=" << s.D;
}
const AttnShape kShapes[] = {{1, 1, 1, 1, 8},   {2, 7, 2, 1, 16},
                             {1, 33, 4, 2, 8},  {2, 17, 4, 4, 16},
                             {1, 65, 4, 1, 64}, {1, 33, 2, 2, 64}};

// Dv: the value head dim (0: D); scale: the softmax scale (0: 1/sqrt(D)).
struct AttnData {
  explicit AttnData(const AttnShape &s, uint64_t seed, int64_t value_dim = 0,
                    double softmax_scale = 0)
      : shape(s), Dv(value_dim == 0 ? s.D : value_dim), scale(softmax_scale),
        q_size(s.B * s.T * s.Hq * s.D), kv_size(s.B * s.T * s.Hkv * s.D),
        o_size(s.B * s.T * s.Hq * Dv), v_size(s.B * s.T * s.Hkv * Dv),
        // A wider spread than [-1, 1] makes the softmax rows peaked as well as
        // flat.
        q(random_vector(q_size, seed, -2.f, 2.f)),
        k(random_vector(kv_size, seed + 1, -2.f, 2.f)),
        v(random_vector(v_size, seed + 2)),
        dout(random_vector(o_size, seed + 3)) {}
  AttnShape shape;
  int64_t Dv;
  double scale;
  int64_t q_size, kv_size, o_size, v_size;
  std::vector<float> q, k, v, dout;
  std::vector<int32_t> positions; // (B, T) document masks; empty: none
};

struct AttnResult {
  std::vector<float> out, lse, dq, dk, dv;
};

template <typename Forward, typename Backward>
AttnResult run(const AttnData &d, Forward forward, Backward backward) {
  const auto [B, T, Hq, Hkv, D] = d.shape;
  AttnResult r;
  r.out.assign(d.o_size, NAN);
  r.lse.assign(B * Hq * T, NAN);
  r.dq.assign(d.q_size, NAN);
  r.dk.assign(d.kv_size,
              NAN); // NaN-filled: backward must overwrite every element
  r.dv.assign(d.v_size, NAN);
  const int32_t *positions = d.positions.empty() ? nullptr : d.positions.data();
  forward(r.out.data(), r.lse.data(), d.q.data(), d.k.data(), d.v.data(), B, T,
          Hq, Hkv, D, 0, positions, d.Dv, d.scale);
  backward(r.dq.data(), r.dk.data(), r.dv.data(), d.dout.data(), d.q.data(),
           d.k.data(), d.v.data(), r.out.data(), r.lse.data(), B, T, Hq, Hkv,
           D, positions, d.Dv, d.scale);
  return r;
}

AttnResult run_ref(const AttnData &d) {
  return run(d, ref::attention_forward, ref::attention_backward);
}
AttnResult run_cpu(const AttnData &d) {
  return run(d, cpu::attention_forward, cpu::attention_backward);
}

// Each shape runs untiled (a key tile larger than T) and with a key tile of 8, so that rows see
// several tiles, documents start inside tiles and cached rows' tiles line up with the whole
// sequence's.
struct AttnCase {
  AttnShape shape;
  int64_t tile;
};
void PrintTo(const AttnCase &c, std::ostream *os) {
  PrintTo(c.shape, os);
  *os << " key tile " << c.tile;
}

// Sets the CPU attention's key tile for a scope.
class KeyTile {
 public:
  explicit KeyTile(int64_t keys) : before_(attention_key_tile()) { set_attention_key_tile(keys); }
  ~KeyTile() { set_attention_key_tile(before_); }

 private:
  int64_t before_;
};

class AttentionShapeTest : public ::testing::TestWithParam<AttnCase> {
 protected:
  AttnShape shape() const { return GetParam().shape; }
  KeyTile tile_{GetParam().tile};
};

TEST_P(AttentionShapeTest, FastMatchesReference) {
  AttnData d(shape(), 10);
  AttnResult want = run_ref(d);
  AttnResult got = run_cpu(d);
  EXPECT_WITHIN(relative_error(got.out, want.out), 1e-5);
  EXPECT_WITHIN(max_scaled_error(got.lse.data(), want.lse.data(),
                                 got.lse.size(), 1e-5, 1e-5),
                1.0);
  EXPECT_WITHIN(relative_error(got.dq, want.dq), 1e-5);
  EXPECT_WITHIN(relative_error(got.dk, want.dk), 1e-5);
  EXPECT_WITHIN(relative_error(got.dv, want.dv), 1e-5);
}

// The fast backward given the reference's out/lse must also agree: backward
// only trusts its inputs, so this isolates it from the forward.
TEST_P(AttentionShapeTest, FastBackwardMatchesReferenceOnSameInputs) {
  AttnData d(shape(), 20);
  const auto [B, T, Hq, Hkv, D] = d.shape;
  AttnResult want = run_ref(d);
  std::vector<float> dq(d.q_size), dk(d.kv_size), dv(d.kv_size);
  cpu::attention_backward(dq.data(), dk.data(), dv.data(), d.dout.data(),
                          d.q.data(), d.k.data(), d.v.data(), want.out.data(),
                          want.lse.data(), B, T, Hq, Hkv, D, nullptr);
  EXPECT_WITHIN(relative_error(dq, want.dq), 1e-5);
  EXPECT_WITHIN(relative_error(dk, want.dk), 1e-5);
  EXPECT_WITHIN(relative_error(dv, want.dv), 1e-5);
}

// Changing key/value at position p must leave every output before p
// bit-identical.
TEST_P(AttentionShapeTest, FutureKeysDoNotAffectEarlierOutputs) {
  AttnData d(shape(), 30);
  const auto [B, T, Hq, Hkv, D] = d.shape;
  const int64_t p = T / 2;
  for (bool fast : {false, true}) {
    AttnResult before = fast ? run_cpu(d) : run_ref(d);
    AttnData changed = d;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < Hkv * D; ++i) {
        changed.k[(b * T + p) * Hkv * D + i] += 3.0f;
        changed.v[(b * T + p) * Hkv * D + i] -= 5.0f;
      }
    }
    AttnResult after = fast ? run_cpu(changed) : run_ref(changed);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = (b * T + t) * Hq * D;
        bool same = true;
        for (int64_t i = 0; i < Hq * D; ++i)
          same = same && before.out[row + i] == after.out[row + i];
        if (t < p) {
          EXPECT_TRUE(same) << "fast=" << fast << " b=" << b << " t=" << t;
        } else {
          EXPECT_FALSE(same) << "fast=" << fast << " b=" << b << " t=" << t;
        }
      }
    }
  }
}

// Queries after `past` cached positions (a KV cache in generation) give bitwise the rows
// of those queries in the whole sequence's attention, on both paths.
TEST_P(AttentionShapeTest, QueriesAfterCachedKeysGiveTheFullSequencesRowsBitwise) {
  const AttnShape shape = this->shape();
  const auto [B, T, Hq, Hkv, D] = shape;
  const AttnData d(shape, 21);
  for (const bool fast : {false, true}) {
    auto forward = fast ? cpu::attention_forward : ref::attention_forward;
    std::vector<float> full(d.q_size), full_lse(B * Hq * T);
    forward(full.data(), full_lse.data(), d.q.data(), d.k.data(), d.v.data(), B, T, Hq, Hkv, D, 0, nullptr, 0, 0);
    for (const int64_t past : {T / 2, T - 1}) {
      const int64_t n = T - past;  // the new queries
      std::vector<float> q(B * n * Hq * D), out(B * n * Hq * D, NAN), lse(B * Hq * n, NAN);
      for (int64_t b = 0; b < B; ++b)
        std::copy_n(d.q.begin() + (b * T + past) * Hq * D, n * Hq * D, q.begin() + b * n * Hq * D);
      forward(out.data(), lse.data(), q.data(), d.k.data(), d.v.data(), B, n, Hq, Hkv, D, past, nullptr, 0, 0);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t i = 0; i < n * Hq * D; ++i)
          ASSERT_EQ(out[b * n * Hq * D + i], full[(b * T + past) * Hq * D + i]) << fast << " past " << past;
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t t = 0; t < n; ++t)
            ASSERT_EQ(lse[(b * Hq + h) * n + t], full_lse[(b * Hq + h) * T + past + t]) << fast << " past " << past;
      }
    }
  }
}

TEST_P(AttentionShapeTest, SameResultForAnyThreadCountAndRun) {
  AttnData d(shape(), 40);
  AttnResult first = run_cpu(d);
  AttnResult second = run_cpu(d);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  AttnResult single = run_cpu(d);
  omp_set_num_threads(threads);
  for (const AttnResult *r : {&second, &single}) {
    EXPECT_EQ(r->out, first.out);
    EXPECT_EQ(r->lse, first.lse);
    EXPECT_EQ(r->dq, first.dq);
    EXPECT_EQ(r->dk, first.dk);
    EXPECT_EQ(r->dv, first.dv);
  }
}

// Document masks (kernels/attention.h): rows cut into documents of lengths 3, 5, 1, 7, ...
// (the last cut short by T), and each row's positions restarting at each.
std::vector<int32_t> document_positions(int64_t B, int64_t T) {
  const int64_t lengths[] = {3, 5, 1, 7, 2};
  std::vector<int32_t> positions;
  for (int64_t b = 0; b < B; ++b) {
    int64_t doc = b, pos = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (pos == lengths[doc % 5])
        pos = 0, ++doc;
      positions.push_back(static_cast<int32_t>(pos++));
    }
  }
  return positions;
}

// Each document of a masked batch gets bitwise what it gets alone in a
// sequence of its own (forward and backward), on both paths: its rows see
// only its keys, in the same order.
TEST_P(AttentionShapeTest, DocumentMasksGiveEachDocumentItsOwnAttentionBitwise) {
  const auto [B, T, Hq, Hkv, D] = shape();
  AttnData d(shape(), 70);
  d.positions = document_positions(B, T);
  for (const bool fast : {false, true}) {
    const AttnResult packed = fast ? run_cpu(d) : run_ref(d);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t start = 0; start < T;) {
        int64_t n = 1;
        while (start + n < T && d.positions[b * T + start + n] != 0)
          ++n;
        AttnData alone({1, n, Hq, Hkv, D}, 0);
        // (Structured bindings are copied: clang 14 cannot capture them.)
        auto cut = [&, T = T, D = D](const std::vector<float> &all,
                                     int64_t heads, std::vector<float> *out) {
          out->assign(all.begin() + (b * T + start) * heads * D,
                      all.begin() + (b * T + start + n) * heads * D);
        };
        cut(d.q, Hq, &alone.q);
        cut(d.dout, Hq, &alone.dout);
        cut(d.k, Hkv, &alone.k);
        cut(d.v, Hkv, &alone.v);
        const AttnResult want = fast ? run_cpu(alone) : run_ref(alone);
        std::vector<float> got;
        cut(packed.out, Hq, &got);
        EXPECT_EQ(got, want.out) << fast;
        cut(packed.dq, Hq, &got);
        EXPECT_EQ(got, want.dq) << fast;
        cut(packed.dk, Hkv, &got);
        EXPECT_EQ(got, want.dk) << fast;
        cut(packed.dv, Hkv, &got);
        EXPECT_EQ(got, want.dv) << fast;
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t t = 0; t < n; ++t)
            EXPECT_EQ(packed.lse[(b * Hq + h) * T + start + t],
                      want.lse[h * n + t])
                << fast;
        start += n;
      }
    }
  }
}

std::vector<AttnCase> shape_cases() {
  std::vector<AttnCase> cases;
  for (int64_t tile : {int64_t{1} << 20, int64_t{8}})
    for (const AttnShape &s : kShapes)
      cases.push_back({s, tile});
  return cases;
}
INSTANTIATE_TEST_SUITE_P(Shapes, AttentionShapeTest,
                         ::testing::ValuesIn(shape_cases()));

// L = sum(out * dout) through the reference forward; its gradient with respect
// to every element of q, k and v must match the reference backward.
void check_finite_difference(const AttnShape &shape, int64_t Dv = 0,
                             double scale = 0) {
  AttnData d(shape, 50, Dv, scale);
  const auto [B, T, Hq, Hkv, D] = shape;
  AttnResult analytic = run_ref(d);
  std::vector<float> out(d.o_size), lse(B * Hq * T);
  // Bindings captured by copy: clang 14 cannot capture a structured binding implicitly.
  auto loss = [&, B = B, T = T, Hq = Hq, Hkv = Hkv, D = D]() {
    ref::attention_forward(out.data(), lse.data(), d.q.data(), d.k.data(),
                           d.v.data(), B, T, Hq, Hkv, D, 0, nullptr, d.Dv,
                           d.scale);
    double s = 0;
    for (int64_t i = 0; i < d.o_size; ++i)
      s += double(d.dout[i]) * out[i];
    return s;
  };
  struct {
    std::vector<float> *input;
    const std::vector<float> *grad;
    const char *name;
  } cases[] = {{&d.q, &analytic.dq, "dq"},
               {&d.k, &analytic.dk, "dk"},
               {&d.v, &analytic.dv, "dv"}};
  for (auto &c : cases) {
    std::vector<float> numeric(c.input->size());
    for (size_t i = 0; i < numeric.size(); ++i) {
      numeric[i] = float(finite_difference(loss, &(*c.input)[i], 1e-2));
    }
    EXPECT_WITHIN(relative_error(numeric, *c.grad), 2e-4) << c.name;
  }
}

// Key tiles against one tile of every key (kernels/attention.h), with document masks too.
// Backward given the same out and lse runs its sums in the untiled order: bitwise the same.
// Forward differs by the online softmax only. With u = 2^-24, n keys in a row and n_t tiles, each
// term p_j v_j picks up at most (2 + 2 n_t) u from the exps and rescalings beyond the untiled
// path's, plus u |s_j - m| from rounding s_j - m, whose p-weighted sum is at most n/e; both
// paths' fp32 accumulations add (n + 6) u each. So per element of out
//   |tiled - untiled| <= 3 (n + n_t + 8) u max|v|,
// and of lse (the log of a sum whose terms differ so, plus the final rounding of each)
//   |tiled - untiled| <= (n + 4 n_t + 8) u + 2 u |lse|.
// The reference, in double, differs by the rounding of its float results: 2 u max|v| and 2 u |lse|
// (plus 1e-12 for its double arithmetic).
void expect_tiles_within_bound(const AttnShape &shape, int64_t tile, bool fast, bool documents) {
  AttnData d(shape, 80);
  const auto [B, T, Hq, Hkv, D] = shape;
  if (documents) {  // documents of 700, 900 and the rest (and of 40, 80, ... in short rows)
    d.positions.resize(static_cast<size_t>(B * T));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0, start = 0; t < T; ++t) {
        if (t - start == (T > 1000 ? 700 + 200 * (start > 0) : 40 + 40 * (start > 0))) start = t;
        d.positions[static_cast<size_t>(b * T + t)] = static_cast<int32_t>(t - start);
      }
  }
  auto forward = fast ? cpu::attention_forward : ref::attention_forward;
  auto backward = fast ? cpu::attention_backward : ref::attention_backward;
  AttnResult untiled, tiled;
  {
    KeyTile all(0);
    untiled = run(d, forward, backward);
  }
  {
    KeyTile some(tile);
    tiled = run(d, forward, backward);
  }
  const double u = std::ldexp(1.0, -24);
  double max_v = 0;
  for (float x : d.v) max_v = std::max(max_v, double(std::fabs(x)));
  const double n = double(T), n_t = std::ceil(double(T) / double(tile));
  const double out_bound = fast ? 3 * (n + n_t + 8) * u * max_v : 2 * u * max_v + 1e-12;
  for (size_t i = 0; i < tiled.out.size(); ++i)
    ASSERT_TRUE(std::fabs(tiled.out[i] - untiled.out[i]) <= out_bound)
        << "out[" << i << "] " << tiled.out[i] << " tiled, " << untiled.out[i] << " untiled; bound " << out_bound;
  for (size_t i = 0; i < tiled.lse.size(); ++i) {
    const double bound = (fast ? (n + 4 * n_t + 8) * u : 1e-12) + 2 * u * std::fabs(untiled.lse[i]);
    ASSERT_TRUE(std::fabs(tiled.lse[i] - untiled.lse[i]) <= bound)
        << "lse[" << i << "] " << tiled.lse[i] << " tiled, " << untiled.lse[i] << " untiled; bound " << bound;
  }
  // Backward on the same inputs: the untiled forward's out and lse, under the tile.
  std::vector<float> dq(d.q_size), dk(d.kv_size), dv(d.v_size);
  const int32_t *positions = d.positions.empty() ? nullptr : d.positions.data();
  {
    KeyTile some(tile);
    backward(dq.data(), dk.data(), dv.data(), d.dout.data(), d.q.data(), d.k.data(), d.v.data(), untiled.out.data(),
             untiled.lse.data(), B, T, Hq, Hkv, D, positions, 0, 0);
  }
  EXPECT_EQ(dq, untiled.dq);
  EXPECT_EQ(dk, untiled.dk);
  EXPECT_EQ(dv, untiled.dv);
}

TEST(AttentionTest, KeyTilesAgainstUntiledAtLongSequences) {
  expect_tiles_within_bound({1, 2048, 2, 1, 32}, 64, /*fast=*/true, /*documents=*/false);
  expect_tiles_within_bound({1, 2048, 2, 1, 32}, 100, /*fast=*/true, /*documents=*/true);
  expect_tiles_within_bound({2, 300, 2, 1, 16}, 16, /*fast=*/false, /*documents=*/false);
  expect_tiles_within_bound({1, 300, 2, 2, 16}, 24, /*fast=*/false, /*documents=*/true);
}

TEST(AttentionTest, ReferenceBackwardMatchesFiniteDifference) {
  check_finite_difference({1, 7, 2, 1, 8});
  check_finite_difference({2, 5, 4, 2, 8});
  check_finite_difference({1, 4, 2, 2, 16});
}

// Multi-head latent attention's shapes: values narrower (or wider) than queries and keys, and
// a softmax scale of the caller's.
TEST(AttentionTest, ValueDimsAndScaleMatchFiniteDifference) {
  check_finite_difference({1, 7, 2, 1, 12}, 8, 0.5);
  check_finite_difference({2, 5, 4, 2, 8}, 16);
  check_finite_difference({1, 6, 2, 2, 24}, 16, 0.3);
}

TEST(AttentionTest, ValueDimsAndScaleFastMatchesReference) {
  struct Case {
    AttnShape shape;
    int64_t Dv;
    double scale;
  };
  const Case cases[] = {{{1, 33, 4, 2, 24}, 16, 0},
                        {{2, 17, 4, 1, 12}, 20, 0.4},
                        {{1, 40, 2, 2, 192}, 128, 0.1}};
  for (const Case &c : cases) {
    for (const bool masked : {false, true}) {
      AttnData d(c.shape, 80, c.Dv, c.scale);
      if (masked)
        d.positions = document_positions(c.shape.B, c.shape.T);
      const AttnResult want = run_ref(d);
      const AttnResult got = run_cpu(d);
      EXPECT_WITHIN(relative_error(got.out, want.out), 1e-5) << c.Dv;
      EXPECT_WITHIN(max_scaled_error(got.lse.data(), want.lse.data(),
                                     got.lse.size(), 1e-5, 1e-5),
                    1.0);
      EXPECT_WITHIN(relative_error(got.dq, want.dq), 1e-5) << c.Dv;
      EXPECT_WITHIN(relative_error(got.dk, want.dk), 1e-5) << c.Dv;
      EXPECT_WITHIN(relative_error(got.dv, want.dv), 1e-5) << c.Dv;
    }
  }
}

// Naming the defaults changes nothing: Dv = D and scale = 1/sqrt(D) give the bits of 0 and 0
// (D = 12: a scale that is not a power of two).
TEST(AttentionTest, ExplicitDefaultsGiveTheSameBits) {
  const AttnShape shape{2, 17, 4, 2, 12};
  const AttnData implicit(shape, 90);
  const AttnData named(shape, 90, 12, 1.0 / std::sqrt(12.0));
  for (const bool fast : {false, true}) {
    const AttnResult a = fast ? run_cpu(implicit) : run_ref(implicit);
    const AttnResult b = fast ? run_cpu(named) : run_ref(named);
    EXPECT_EQ(a.out, b.out) << fast;
    EXPECT_EQ(a.lse, b.lse) << fast;
    EXPECT_EQ(a.dq, b.dq) << fast;
    EXPECT_EQ(a.dk, b.dk) << fast;
    EXPECT_EQ(a.dv, b.dv) << fast;
  }
}

// A single key means the output row is that key's value row exactly, with lse =
// its score.
TEST(AttentionTest, FirstRowCopiesFirstValue) {
  AttnData d({1, 3, 2, 1, 8}, 60);
  for (bool fast : {false, true}) {
    AttnResult r = fast ? run_cpu(d) : run_ref(d);
    for (int64_t h = 0; h < 2; ++h) {
      double score = 0;
      for (int64_t i = 0; i < 8; ++i) {
        EXPECT_FLOAT_EQ(r.out[h * 8 + i], d.v[i]);
        score += double(d.q[h * 8 + i]) * d.k[i];
      }
      EXPECT_NEAR(r.lse[h * 3], score / std::sqrt(8.0), 1e-5);
    }
  }
}

} // namespace
} // namespace strata::kernels
