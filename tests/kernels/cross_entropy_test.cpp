// LM head + cross-entropy: fast path against the reference, reference gradients
// against finite differences, ignored targets, independence from chunk_tokens,
// determinism.
#include "kernels/cross_entropy.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <ostream>
#include <random>
#include <vector>

#include "../test_util.h"

namespace strata::kernels {
namespace {

using strata::testing::finite_difference;
using strata::testing::random_vector;
using strata::testing::relative_error;

struct CeShape {
  int64_t N, C, V, chunk;
};
// Readable parameter names in test output.
void PrintTo(const CeShape &s, std::ostream *os) {
  *os << "N=" << s.N << " "
      << "C=" << s.C << " "
      << "V=" << s.V << " "
      << "chunk=" << s.chunk;
}
// N not a multiple of chunk, odd V, chunk larger than N, chunk of one token.
const CeShape kCeShapes[] = {{1, 8, 5, 4},      {7, 16, 33, 3},  {33, 64, 101, 8},
                           {65, 32, 257, 64}, {10, 8, 7, 100}, {9, 16, 31, 1}};

// Random targets with about one in five masked (-1).
std::vector<int32_t> random_targets(int64_t N, int64_t V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(V - 1));
  std::uniform_int_distribution<int> mask(0, 4);
  std::vector<int32_t> t(static_cast<size_t>(N));
  for (auto &x : t)
    x = mask(rng) == 0 ? -1 : token(rng);
  return t;
}

struct CeData {
  CeData(const CeShape &s, uint64_t seed)
      : shape(s), x(random_vector(s.N * s.C, seed, -2.f, 2.f)),
        weight(random_vector(s.V * s.C, seed + 1, -1.f, 1.f)),
        dweight_init(random_vector(s.V * s.C, seed + 2)),
        targets(random_targets(s.N, s.V, seed + 3)) {}
  CeShape shape;
  std::vector<float> x, weight, dweight_init;
  std::vector<int32_t> targets;
};

struct CeResult {
  double loss;
  std::vector<float> dx, dweight;
};

using CeFn = double (*)(float *, float *, const float *, const float *,
                        const int32_t *, int64_t, int64_t, int64_t, float,
                        int64_t);

CeResult run(CeFn fn, const CeData &d, float grad_scale, int64_t chunk) {
  CeResult r;
  r.dx.assign(d.x.size(),
              NAN); // dx must be overwritten everywhere, masked rows included
  r.dweight = d.dweight_init; // dweight accumulates onto what is there
  r.loss =
      fn(r.dx.data(), r.dweight.data(), d.x.data(), d.weight.data(),
         d.targets.data(), d.shape.N, d.shape.C, d.shape.V, grad_scale, chunk);
  return r;
}

// dweight's change alone, so that tolerances are not hidden by the initial
// values.
std::vector<float> increment(const CeResult &r, const CeData &d) {
  std::vector<float> inc(r.dweight.size());
  for (size_t i = 0; i < inc.size(); ++i)
    inc[i] = r.dweight[i] - d.dweight_init[i];
  return inc;
}

class CrossEntropyShapeTest : public ::testing::TestWithParam<CeShape> {};

TEST_P(CrossEntropyShapeTest, FastMatchesReference) {
  CeData d(GetParam(), 100);
  const float grad_scale = 0.37f;
  CeResult want = run(ref::lm_head_cross_entropy, d, grad_scale, d.shape.chunk);
  CeResult got = run(cpu::lm_head_cross_entropy, d, grad_scale, d.shape.chunk);
  EXPECT_TRUE(std::isfinite(want.loss));
  EXPECT_WITHIN(std::fabs(got.loss - want.loss) /
                    std::max(1.0, std::fabs(want.loss)),
                1e-5);
  EXPECT_WITHIN(relative_error(got.dx, want.dx), 1e-5);
  EXPECT_WITHIN(relative_error(increment(got, d), increment(want, d)), 1e-5);
}

// The weight in row blocks, each in an allocation of its own (as pages of the chunk space are):
// the same loss and gradients as the reference, every block's gradient landing in its block.
TEST_P(CrossEntropyShapeTest, RowBlocksMatchReference) {
  CeData d(GetParam(), 300);
  const float grad_scale = 0.37f;
  const int64_t C = d.shape.C, V = d.shape.V;
  const int64_t rows = std::max<int64_t>(1, V / 3);  // three or four blocks, the last shorter
  std::vector<std::vector<float>> w, dw;
  std::vector<const float *> w_blocks;
  std::vector<float *> dw_blocks;
  for (int64_t v0 = 0; v0 < V; v0 += rows) {
    const int64_t n = std::min(rows, V - v0);
    w.emplace_back(d.weight.begin() + v0 * C, d.weight.begin() + (v0 + n) * C);
    dw.emplace_back(d.dweight_init.begin() + v0 * C, d.dweight_init.begin() + (v0 + n) * C);
  }
  for (size_t b = 0; b < w.size(); ++b) {
    w_blocks.push_back(w[b].data());
    dw_blocks.push_back(dw[b].data());
  }
  std::vector<float> dx(d.x.size(), NAN);
  const double loss = cpu::lm_head_cross_entropy_blocked(
      dx.data(), dw_blocks.data(), d.x.data(), w_blocks.data(), rows, d.targets.data(), d.shape.N, C, V,
      grad_scale, d.shape.chunk);
  std::vector<float> got_inc;
  for (size_t b = 0; b < dw.size(); ++b)
    for (size_t i = 0; i < dw[b].size(); ++i)
      got_inc.push_back(dw[b][i] - d.dweight_init[b * static_cast<size_t>(rows * C) + i]);
  CeResult want = run(ref::lm_head_cross_entropy, d, grad_scale, d.shape.chunk);
  EXPECT_WITHIN(std::fabs(loss - want.loss) / std::max(1.0, std::fabs(want.loss)), 1e-5);
  EXPECT_WITHIN(relative_error(dx, want.dx), 1e-5);
  EXPECT_WITHIN(relative_error(got_inc, increment(want, d)), 1e-5);
}

TEST_P(CrossEntropyShapeTest, ResultDoesNotDependOnChunkTokens) {
  CeData d(GetParam(), 200);
  CeResult base = run(cpu::lm_head_cross_entropy, d, 1.0f, d.shape.N);
  for (int64_t chunk : {int64_t{1}, int64_t{3}, d.shape.chunk, d.shape.N + 5}) {
    CeResult r = run(cpu::lm_head_cross_entropy, d, 1.0f, chunk);
    EXPECT_WITHIN(std::fabs(r.loss - base.loss) /
                      std::max(1.0, std::fabs(base.loss)),
                  1e-6)
        << chunk;
    EXPECT_WITHIN(relative_error(r.dx, base.dx), 1e-5) << chunk;
    EXPECT_WITHIN(relative_error(increment(r, d), increment(base, d)), 1e-5)
        << chunk;
  }
}

TEST_P(CrossEntropyShapeTest, TwoRunsAreBitwiseEqual) {
  CeData d(GetParam(), 300);
  CeResult a = run(cpu::lm_head_cross_entropy, d, 0.5f, d.shape.chunk);
  CeResult b = run(cpu::lm_head_cross_entropy, d, 0.5f, d.shape.chunk);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.dx, b.dx);
  EXPECT_EQ(a.dweight, b.dweight);
}

// Masked tokens must count for nothing: the result equals the one on the valid
// tokens alone.
TEST_P(CrossEntropyShapeTest, IgnoredTargetsContributeNothing) {
  CeData d(GetParam(), 400);
  const auto [N, C, V, chunk] = d.shape;
  CeData valid_only = d;
  valid_only.x.clear();
  valid_only.targets.clear();
  for (int64_t n = 0; n < N; ++n) {
    if (d.targets[n] < 0)
      continue;
    valid_only.x.insert(valid_only.x.end(), d.x.begin() + n * C,
                        d.x.begin() + (n + 1) * C);
    valid_only.targets.push_back(d.targets[n]);
  }
  valid_only.shape.N = static_cast<int64_t>(valid_only.targets.size());
  for (CeFn fn : {&ref::lm_head_cross_entropy, &cpu::lm_head_cross_entropy}) {
    CeResult all = run(fn, d, 1.0f, chunk);
    CeResult some = run(fn, valid_only, 1.0f, chunk);
    EXPECT_WITHIN(std::fabs(all.loss - some.loss) /
                      std::max(1.0, std::fabs(some.loss)),
                  1e-6);
    EXPECT_WITHIN(relative_error(increment(all, d), increment(some, d)), 1e-5);
    int64_t k = 0;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t c = 0; c < C; ++c) {
        if (d.targets[n] < 0) {
          EXPECT_EQ(all.dx[n * C + c], 0.0f) << n;
        } else {
          EXPECT_NEAR(all.dx[n * C + c], some.dx[k * C + c], 1e-5) << n;
        }
      }
      if (d.targets[n] >= 0)
        ++k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CrossEntropyShapeTest,
                         ::testing::ValuesIn(kCeShapes));

TEST(CrossEntropyTest, AllIgnoredGivesZeroLossAndNoGradient) {
  CeData d({6, 8, 11, 4}, 500);
  std::fill(d.targets.begin(), d.targets.end(), -1);
  for (CeFn fn : {&ref::lm_head_cross_entropy, &cpu::lm_head_cross_entropy}) {
    CeResult r = run(fn, d, 1.0f, 4);
    EXPECT_EQ(r.loss, 0.0);
    EXPECT_EQ(r.dx, std::vector<float>(d.x.size(), 0.0f));
    EXPECT_EQ(r.dweight, d.dweight_init);
  }
}

// With zero inputs every logit is 0, so each valid token costs exactly log(V).
TEST(CrossEntropyTest, UniformLogitsCostLogV) {
  const int64_t N = 5, C = 4, V = 13;
  std::vector<float> x(N * C, 0.0f), weight = random_vector(V * C, 1);
  std::vector<int32_t> targets = {0, 12, -1, 5, 7};
  for (CeFn fn : {&ref::lm_head_cross_entropy, &cpu::lm_head_cross_entropy}) {
    double loss = fn(nullptr, nullptr, x.data(), weight.data(), targets.data(),
                     N, C, V, 1.0f, 2);
    EXPECT_NEAR(loss, 4 * std::log(double(V)), 1e-5);
  }
}

TEST(CrossEntropyTest, SameResultForAnyThreadCount) {
  CeData d({37, 32, 129, 8}, 600);
  CeResult many = run(cpu::lm_head_cross_entropy, d, 1.0f, 8);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  CeResult one = run(cpu::lm_head_cross_entropy, d, 1.0f, 8);
  omp_set_num_threads(threads);
  EXPECT_EQ(one.loss, many.loss);
  EXPECT_EQ(one.dx, many.dx);
  EXPECT_EQ(one.dweight, many.dweight);
}

// grad_scale * loss differentiated numerically through the reference must match
// the reference's dx and dweight increment.
TEST(CrossEntropyTest, ReferenceGradientsMatchFiniteDifference) {
  CeData d({7, 8, 11, 3}, 700);
  const auto [N, C, V, chunk] = d.shape;
  const float grad_scale = 0.25f;
  CeResult analytic = run(ref::lm_head_cross_entropy, d, grad_scale, chunk);
  // Bindings captured by copy: clang 14 cannot capture a structured binding implicitly.
  auto loss = [&, N = N, C = C, V = V, chunk = chunk]() {
    return grad_scale * ref::lm_head_cross_entropy(
                            nullptr, nullptr, d.x.data(), d.weight.data(),
                            d.targets.data(), N, C, V, grad_scale, chunk);
  };
  std::vector<float> dx(d.x.size()), dw(d.weight.size());
  for (size_t i = 0; i < dx.size(); ++i)
    dx[i] = float(finite_difference(loss, &d.x[i], 1e-3));
  for (size_t i = 0; i < dw.size(); ++i)
    dw[i] = float(finite_difference(loss, &d.weight[i], 1e-3));
  EXPECT_WITHIN(relative_error(dx, analytic.dx), 3e-4);
  EXPECT_WITHIN(relative_error(dw, increment(analytic, d)), 3e-4);
}

} // namespace
} // namespace strata::kernels
