// sgemm / sgemm_builtin against a naive product, and the linear op's fast path against its
// reference and against finite differences.
#include "kernels/linear.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../test_util.h"

namespace strata::kernels {
namespace {

using strata::testing::finite_difference;
using strata::testing::max_scaled_error;
using strata::testing::random_vector;
using strata::testing::relative_error;

using GemmFn = void (*)(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                        const float*, int64_t, float, float*, int64_t);

struct GemmShape {
  int64_t M, N, K;
};

// C = alpha * op(A) op(B) + beta * C in double, the obviously right triple loop.
void naive_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) {
        double a = ta ? A[k * lda + i] : A[i * lda + k];
        double b = tb ? B[j * ldb + k] : B[k * ldb + j];
        s += a * b;
      }
      double c = beta == 0.0f ? 0.0 : double(beta) * C[i * ldc + j];
      C[i * ldc + j] = static_cast<float>(double(alpha) * s + c);
    }
  }
}

// Runs `gemm` on padded (strided) operands for every transpose combination and several
// alpha/beta pairs; checks the result against naive_gemm and that padding is left alone.
void check_gemm(GemmFn gemm, const GemmShape& s) {
  const float kPad = 12345.0f;
  const std::pair<float, float> kScalars[] = {{1.0f, 0.0f}, {0.5f, 1.0f}, {-1.5f, 0.25f}};
  uint64_t seed = 1;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (auto [alpha, beta] : kScalars) {
        // Stored shapes: A is (M,K) or (K,M); B is (K,N) or (N,K). Leading dims get padding.
        const int64_t a_rows = ta ? s.K : s.M, a_cols = ta ? s.M : s.K;
        const int64_t b_rows = tb ? s.N : s.K, b_cols = tb ? s.K : s.N;
        const int64_t lda = a_cols + 3, ldb = b_cols + 5, ldc = s.N + 2;
        auto A = random_vector(a_rows * lda, seed++);
        auto B = random_vector(b_rows * ldb, seed++);
        auto C = random_vector(s.M * ldc, seed++);
        // Padding columns of C must survive; with beta == 0 the live part may hold NaN.
        for (int64_t i = 0; i < s.M; ++i) {
          for (int64_t j = s.N; j < ldc; ++j) C[i * ldc + j] = kPad;
          if (beta == 0.0f) C[i * ldc] = std::numeric_limits<float>::quiet_NaN();
        }
        auto expected = C;
        naive_gemm(ta, tb, s.M, s.N, s.K, alpha, A.data(), lda, B.data(), ldb, beta,
                   expected.data(), ldc);
        gemm(ta, tb, s.M, s.N, s.K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
        SCOPED_TRACE(::testing::Message() << "M=" << s.M << " N=" << s.N << " K=" << s.K
                                          << " ta=" << ta << " tb=" << tb << " alpha=" << alpha
                                          << " beta=" << beta);
        // Sums of K products of values in [-1, 1]: absolute tolerance grows like sqrt(K).
        double atol = 1e-5 * std::sqrt(double(s.K) + 1);
        EXPECT_WITHIN(max_scaled_error(C.data(), expected.data(), s.M * ldc, atol, 1e-5), 1.0);
        for (int64_t i = 0; i < s.M; ++i) {
          for (int64_t j = s.N; j < ldc; ++j) ASSERT_EQ(C[i * ldc + j], kPad);
        }
      }
    }
  }
}

const GemmShape kGemmShapes[] = {{1, 1, 1},   {3, 17, 33},   {17, 3, 1},   {33, 127, 17},
                                 {127, 33, 300}, {70, 300, 513}, {1, 513, 64}, {129, 1, 257}};

TEST(Sgemm, BuiltinMatchesNaiveForAllTransposesAndScalars) {
  for (const auto& s : kGemmShapes) check_gemm(&sgemm_builtin, s);
}

TEST(Sgemm, DefaultMatchesNaiveForAllTransposesAndScalars) {
  for (const auto& s : kGemmShapes) check_gemm(&sgemm, s);
}

TEST(Sgemm, ZeroKScalesCByBeta) {
  for (GemmFn gemm : {&sgemm, &sgemm_builtin}) {
    std::vector<float> C = {1, 2, 3, 4, 5, 6};
    gemm(false, false, 2, 3, 0, 1.0f, nullptr, 0, nullptr, 3, 0.5f, C.data(), 3);
    EXPECT_EQ(C, (std::vector<float>{0.5f, 1, 1.5f, 2, 2.5f, 3}));
    C.assign(6, std::numeric_limits<float>::quiet_NaN());
    gemm(false, false, 2, 3, 0, 1.0f, nullptr, 0, nullptr, 3, 0.0f, C.data(), 3);
    EXPECT_EQ(C, std::vector<float>(6, 0.0f));
  }
}

TEST(Sgemm, BuiltinIsBitwiseReproducible) {
  const int64_t M = 200, N = 300, K = 400;
  auto A = random_vector(M * K, 7), B = random_vector(K * N, 8);
  std::vector<float> c1(M * N), c2(M * N, 1.0f);
  sgemm_builtin(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, c1.data(), N);
  sgemm_builtin(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, c2.data(), N);
  EXPECT_EQ(0, std::memcmp(c1.data(), c2.data(), c1.size() * sizeof(float)));
}

// The fixed-order GEMM's contract, bit for bit: each element of C is alpha times the fp32 sum of
// its K products added in index order, plus beta * C. That order is written here as a plain loop
// (both built with -ffp-contract=off), so a result that held on one machine holds on any: no
// kernel choice, vector width or thread count can enter it.
TEST(Sgemm, BuiltinSumsEveryElementInIndexOrderAtEveryThreadCount) {
  const GemmShape shapes[] = {{3, 17, 33}, {70, 300, 513}, {129, 257, 600}};
  uint64_t seed = 40;
  for (const GemmShape& s : shapes) {
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const auto A = random_vector(s.M * s.K, seed++), B = random_vector(s.K * s.N, seed++);
      const auto C0 = random_vector(s.M * s.N, seed++);
      const int64_t lda = ta ? s.M : s.K, ldb = tb ? s.K : s.N;
      for (float beta : {0.0f, 1.0f}) {
        std::vector<float> want = C0;
        for (int64_t i = 0; i < s.M; ++i) {
          for (int64_t j = 0; j < s.N; ++j) {
            float sum = 0.0f;
            for (int64_t k = 0; k < s.K; ++k) {
              const float a = ta ? A[k * lda + i] : A[i * lda + k];
              const float b = tb ? B[j * ldb + k] : B[k * ldb + j];
              sum += a * b;
            }
            const float scaled = 0.75f * sum;
            want[i * s.N + j] = beta == 0.0f ? scaled : scaled + beta * C0[i * s.N + j];
          }
        }
        for (int threads : {1, 2, 3}) {
          omp_set_num_threads(threads);
          std::vector<float> got = C0;
          sgemm_builtin(ta, tb, s.M, s.N, s.K, 0.75f, A.data(), lda, B.data(), ldb, beta, got.data(), s.N);
          ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
              << "M=" << s.M << " N=" << s.N << " K=" << s.K << " ta=" << ta << " tb=" << tb << " beta=" << beta
              << " threads=" << threads;
        }
      }
    }
  }
  omp_set_num_threads(omp_get_num_procs());
}

// STRATA_DETERMINISTIC_GEMM's switch: sgemm then is the fixed-order GEMM, bit for bit.
TEST(Sgemm, FixedOrderSettingRunsTheBuiltinGemm) {
  const int64_t M = 70, N = 300, K = 513;
  const auto A = random_vector(M * K, 91), B = random_vector(N * K, 92);
  std::vector<float> want(M * N), got(M * N);
  sgemm_builtin(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, want.data(), N);
  const bool before = fixed_order_gemm();
  set_fixed_order_gemm(true);
  sgemm(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, got.data(), N);
  set_fixed_order_gemm(before);
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));
}

TEST(Sgemm, DeterministicGemmSettingAcceptsOnlyZeroAndOne) {
  EXPECT_FALSE(parse_deterministic_gemm(nullptr).value());
  EXPECT_FALSE(parse_deterministic_gemm("").value());
  EXPECT_FALSE(parse_deterministic_gemm("0").value());
  EXPECT_TRUE(parse_deterministic_gemm("1").value());
  Result<bool> bad = parse_deterministic_gemm("yes");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("STRATA_DETERMINISTIC_GEMM='yes'"), std::string::npos);
}

struct LinearShape {
  int64_t N, IC, OC;
};
const LinearShape kLinearShapes[] = {{1, 1, 1}, {3, 17, 33}, {17, 33, 3}, {127, 64, 129},
                                     {33, 300, 70}};

TEST(Linear, FastForwardMatchesReference) {
  for (const auto& s : kLinearShapes) {
    for (bool with_bias : {false, true}) {
      auto x = random_vector(s.N * s.IC, 1), w = random_vector(s.OC * s.IC, 2);
      auto b = random_vector(s.OC, 3);
      const float* bias = with_bias ? b.data() : nullptr;
      std::vector<float> out_ref(s.N * s.OC), out(s.N * s.OC, NAN);
      ref::linear_forward(out_ref.data(), x.data(), w.data(), bias, s.N, s.IC, s.OC);
      cpu::linear_forward(out.data(), x.data(), w.data(), bias, s.N, s.IC, s.OC);
      SCOPED_TRACE(::testing::Message() << "N=" << s.N << " IC=" << s.IC << " OC=" << s.OC
                                        << " bias=" << with_bias);
      EXPECT_WITHIN(relative_error(out, out_ref), 1e-5);
    }
  }
}

TEST(Linear, FastBackwardMatchesReferenceAndAccumulatesParameterGradients) {
  for (const auto& s : kLinearShapes) {
    auto x = random_vector(s.N * s.IC, 1), w = random_vector(s.OC * s.IC, 2);
    auto dout = random_vector(s.N * s.OC, 4);
    // Parameter gradients start non-zero: both paths must add onto them.
    auto dw0 = random_vector(s.OC * s.IC, 5), db0 = random_vector(s.OC, 6);
    auto dw_ref = dw0, db_ref = db0, dw = dw0, db = db0;
    std::vector<float> dx_ref(s.N * s.IC, NAN), dx(s.N * s.IC, NAN);  // dx is overwritten
    ref::linear_backward(dx_ref.data(), dw_ref.data(), db_ref.data(), dout.data(), x.data(),
                         w.data(), s.N, s.IC, s.OC);
    cpu::linear_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), s.N,
                         s.IC, s.OC);
    SCOPED_TRACE(::testing::Message() << "N=" << s.N << " IC=" << s.IC << " OC=" << s.OC);
    EXPECT_WITHIN(relative_error(dx, dx_ref), 1e-5);
    EXPECT_WITHIN(relative_error(dw, dw_ref), 1e-5);
    EXPECT_WITHIN(relative_error(db, db_ref), 1e-5);

    // The reference itself: a second call adds the same increment again.
    auto dw_twice = dw_ref, db_twice = db_ref;
    ref::linear_backward(nullptr, dw_twice.data(), db_twice.data(), dout.data(), x.data(),
                         w.data(), s.N, s.IC, s.OC);
    std::vector<float> expect_dw(dw0.size()), expect_db(db0.size());
    for (size_t i = 0; i < dw0.size(); ++i) expect_dw[i] = dw0[i] + 2 * (dw_ref[i] - dw0[i]);
    for (size_t i = 0; i < db0.size(); ++i) expect_db[i] = db0[i] + 2 * (db_ref[i] - db0[i]);
    EXPECT_WITHIN(relative_error(dw_twice, expect_dw), 1e-5);
    EXPECT_WITHIN(relative_error(db_twice, expect_db), 1e-5);
  }
}

TEST(Linear, BackwardSkipsNullGradients) {
  const LinearShape s{5, 7, 9};
  auto x = random_vector(s.N * s.IC, 1), w = random_vector(s.OC * s.IC, 2);
  auto dout = random_vector(s.N * s.OC, 4);
  std::vector<float> dw_ref(s.OC * s.IC, 0.0f), dw(s.OC * s.IC, 0.0f);
  ref::linear_backward(nullptr, dw_ref.data(), nullptr, dout.data(), x.data(), w.data(), s.N,
                       s.IC, s.OC);
  cpu::linear_backward(nullptr, dw.data(), nullptr, dout.data(), x.data(), w.data(), s.N, s.IC,
                       s.OC);
  EXPECT_WITHIN(relative_error(dw, dw_ref), 1e-5);
  std::vector<float> dx(s.N * s.IC, NAN);
  cpu::linear_backward(dx.data(), nullptr, nullptr, dout.data(), x.data(), w.data(), s.N, s.IC,
                       s.OC);
  std::vector<float> dx_ref(s.N * s.IC);
  ref::linear_backward(dx_ref.data(), nullptr, nullptr, dout.data(), x.data(), w.data(), s.N,
                       s.IC, s.OC);
  EXPECT_WITHIN(relative_error(dx, dx_ref), 1e-5);
}

// The reference backward against central differences of L = sum(out * r).
TEST(Linear, ReferenceBackwardMatchesFiniteDifferences) {
  const LinearShape s{3, 17, 5};
  auto x = random_vector(s.N * s.IC, 1), w = random_vector(s.OC * s.IC, 2);
  auto b = random_vector(s.OC, 3), r = random_vector(s.N * s.OC, 4);
  std::vector<float> out(s.N * s.OC);
  auto loss = [&] {
    ref::linear_forward(out.data(), x.data(), w.data(), b.data(), s.N, s.IC, s.OC);
    double l = 0;
    for (size_t i = 0; i < out.size(); ++i) l += double(out[i]) * r[i];
    return l;
  };
  std::vector<float> dx(x.size()), dw(w.size(), 0.0f), db(b.size(), 0.0f);
  ref::linear_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), s.N, s.IC,
                       s.OC);
  const double h = 1e-2;
  auto numeric = [&](std::vector<float>& param) {
    std::vector<float> g(param.size());
    for (size_t i = 0; i < param.size(); ++i) g[i] = finite_difference(loss, &param[i], h);
    return g;
  };
  EXPECT_WITHIN(relative_error(dx, numeric(x)), 1e-3);
  EXPECT_WITHIN(relative_error(dw, numeric(w)), 1e-3);
  EXPECT_WITHIN(relative_error(db, numeric(b)), 1e-3);
}

TEST(Linear, FastBackwardIsBitwiseReproducible) {
  const LinearShape s{97, 130, 260};
  auto x = random_vector(s.N * s.IC, 1), w = random_vector(s.OC * s.IC, 2);
  auto dout = random_vector(s.N * s.OC, 4);
  std::vector<float> dx[2], dw[2], db[2];
  for (int run = 0; run < 2; ++run) {
    dx[run].assign(s.N * s.IC, 0.0f);
    dw[run].assign(s.OC * s.IC, 0.5f);
    db[run].assign(s.OC, 0.5f);
    cpu::linear_backward(dx[run].data(), dw[run].data(), db[run].data(), dout.data(), x.data(),
                         w.data(), s.N, s.IC, s.OC);
  }
  EXPECT_EQ(0, std::memcmp(dx[0].data(), dx[1].data(), dx[0].size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(dw[0].data(), dw[1].data(), dw[0].size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(db[0].data(), db[1].data(), db[0].size() * sizeof(float)));
}

}  // namespace
}  // namespace strata::kernels
