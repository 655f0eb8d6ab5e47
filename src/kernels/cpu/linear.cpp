// Linear layer and the single-precision GEMM behind the fast CPU paths.
#include "kernels/linear.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/check.h"

#ifdef STRATA_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace strata::kernels {
namespace {

// Tile sizes of the built-in GEMM. One C tile (kTileM x kTileN) is owned by one thread and
// computed over the whole K, so the result never depends on the thread count. The packed
// panels of A (kTileM x kBlockK) and B (kBlockK x kTileN) together stay within L2.
constexpr int64_t kTileM = 64;
constexpr int64_t kTileN = 256;
constexpr int64_t kBlockK = 256;
// Rows of A processed together by the inner kernel: each loaded row of B feeds four rows of C.
constexpr int64_t kRowGroup = 4;

// C = beta * C, where beta == 0 overwrites (C may hold NaN or garbage, as in BLAS).
void scale_c(float* C, int64_t ldc, int64_t rows, int64_t cols, float beta) {
  for (int64_t i = 0; i < rows; ++i) {
    float* c = C + i * ldc;
    if (beta == 0.0f) {
      std::fill(c, c + cols, 0.0f);
    } else if (beta != 1.0f) {
      for (int64_t j = 0; j < cols; ++j) c[j] *= beta;
    }
  }
}

// Copies op(A)[i0:i0+mb, k0:k0+kb] into a (mb, kb) row-major panel.
void pack_a(float* dst, bool trans_a, const float* A, int64_t lda, int64_t i0, int64_t mb,
            int64_t k0, int64_t kb) {
  for (int64_t i = 0; i < mb; ++i) {
    float* d = dst + i * kb;
    if (!trans_a) {
      std::memcpy(d, A + (i0 + i) * lda + k0, static_cast<size_t>(kb) * sizeof(float));
    } else {
      for (int64_t k = 0; k < kb; ++k) d[k] = A[(k0 + k) * lda + i0 + i];
    }
  }
}

// Copies op(B)[k0:k0+kb, j0:j0+nb] into a (kb, nb) row-major panel.
void pack_b(float* dst, bool trans_b, const float* B, int64_t ldb, int64_t k0, int64_t kb,
            int64_t j0, int64_t nb) {
  if (!trans_b) {
    for (int64_t k = 0; k < kb; ++k) {
      std::memcpy(dst + k * nb, B + (k0 + k) * ldb + j0, static_cast<size_t>(nb) * sizeof(float));
    }
  } else {
    // op(B)[k][j] = B[j][k]: transpose in small square blocks so that both the reads and the
    // writes stay within a few cache lines at a time.
    constexpr int64_t kSq = 16;
    for (int64_t jj = 0; jj < nb; jj += kSq) {
      const int64_t je = std::min(nb, jj + kSq);
      for (int64_t kk = 0; kk < kb; kk += kSq) {
        const int64_t ke = std::min(kb, kk + kSq);
        for (int64_t j = jj; j < je; ++j) {
          const float* b = B + (j0 + j) * ldb + k0;
          for (int64_t k = kk; k < ke; ++k) dst[k * nb + j] = b[k];
        }
      }
    }
  }
}

// acc (mb, nb) += a (mb, kb) @ b (kb, nb), all contiguous. The j loops are unit-stride and
// free of dependences, so the compiler vectorises them.
void panel_multiply(float* acc, const float* a, const float* b, int64_t mb, int64_t kb,
                    int64_t nb) {
  int64_t i = 0;
  for (; i + kRowGroup <= mb; i += kRowGroup) {
    float* __restrict c0 = acc + (i + 0) * nb;
    float* __restrict c1 = acc + (i + 1) * nb;
    float* __restrict c2 = acc + (i + 2) * nb;
    float* __restrict c3 = acc + (i + 3) * nb;
    const float* a0 = a + (i + 0) * kb;
    const float* a1 = a + (i + 1) * kb;
    const float* a2 = a + (i + 2) * kb;
    const float* a3 = a + (i + 3) * kb;
    for (int64_t k = 0; k < kb; ++k) {
      const float* __restrict brow = b + k * nb;
      const float x0 = a0[k], x1 = a1[k], x2 = a2[k], x3 = a3[k];
      for (int64_t j = 0; j < nb; ++j) {
        const float bv = brow[j];
        c0[j] += x0 * bv;
        c1[j] += x1 * bv;
        c2[j] += x2 * bv;
        c3[j] += x3 * bv;
      }
    }
  }
  for (; i < mb; ++i) {
    float* __restrict c = acc + i * nb;
    const float* arow = a + i * kb;
    for (int64_t k = 0; k < kb; ++k) {
      const float* __restrict brow = b + k * nb;
      const float x = arow[k];
      for (int64_t j = 0; j < nb; ++j) c[j] += x * brow[j];
    }
  }
}

}  // namespace

void sgemm_builtin(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                   const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                   int64_t ldc) {
  CHECK(M >= 0 && N >= 0 && K >= 0);
  if (M == 0 || N == 0) return;
  if (K == 0 || alpha == 0.0f) {
    scale_c(C, ldc, M, N, beta);
    return;
  }
  const int64_t tiles_m = (M + kTileM - 1) / kTileM;
  const int64_t tiles_n = (N + kTileN - 1) / kTileN;
  const int64_t tiles = tiles_m * tiles_n;
  const bool parallel = tiles > 1 && M * N * K >= (int64_t{1} << 15);

#pragma omp parallel if (parallel)
  {
    std::vector<float> a_panel(kTileM * kBlockK);
    std::vector<float> b_panel(kBlockK * kTileN);
    std::vector<float> acc(kTileM * kTileN);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t i0 = (t / tiles_n) * kTileM;
      const int64_t j0 = (t % tiles_n) * kTileN;
      const int64_t mb = std::min(kTileM, M - i0);
      const int64_t nb = std::min(kTileN, N - j0);
      std::fill(acc.begin(), acc.begin() + mb * nb, 0.0f);
      for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
        const int64_t kb = std::min(kBlockK, K - k0);
        pack_a(a_panel.data(), trans_a, A, lda, i0, mb, k0, kb);
        pack_b(b_panel.data(), trans_b, B, ldb, k0, kb, j0, nb);
        panel_multiply(acc.data(), a_panel.data(), b_panel.data(), mb, kb, nb);
      }
      for (int64_t i = 0; i < mb; ++i) {
        float* c = C + (i0 + i) * ldc + j0;
        const float* r = acc.data() + i * nb;
        if (beta == 0.0f) {
          for (int64_t j = 0; j < nb; ++j) c[j] = alpha * r[j];
        } else {
          for (int64_t j = 0; j < nb; ++j) c[j] = alpha * r[j] + beta * c[j];
        }
      }
    }
  }
}

Result<bool> parse_deterministic_gemm(const char* value) {
  const std::string_view v = value == nullptr ? "" : value;
  if (v.empty() || v == "0") return false;
  if (v == "1") return true;
  return Status::InvalidArgument("STRATA_DETERMINISTIC_GEMM='" + std::string(v) +
                                 "' is not 0 or 1 (1 runs strata's fixed-order GEMM instead of OpenBLAS, "
                                 "so that a run repeats bitwise on other CPUs)");
}

namespace {

// -1: not read yet; 0 or 1 afterwards. A malformed value counts as off here (the CLI refuses it
// before any GEMM runs).
std::atomic<int> fixed_order_state{-1};

}  // namespace

bool fixed_order_gemm() {
  int s = fixed_order_state.load(std::memory_order_relaxed);
  if (s < 0) {
    Result<bool> env = parse_deterministic_gemm(std::getenv("STRATA_DETERMINISTIC_GEMM"));
    int want = env.ok() && *env ? 1 : 0;
    fixed_order_state.compare_exchange_strong(s, want, std::memory_order_relaxed);
    s = fixed_order_state.load(std::memory_order_relaxed);
  }
  return s == 1;
}

void set_fixed_order_gemm(bool on) { fixed_order_state.store(on ? 1 : 0, std::memory_order_relaxed); }

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
           int64_t ldc) {
#ifdef STRATA_HAVE_OPENBLAS
  if (fixed_order_gemm()) {
    sgemm_builtin(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  CHECK(M >= 0 && N >= 0 && K >= 0);
  if (M == 0 || N == 0) return;
  // BLAS rejects lda < max(1, K) even though nothing is read when K == 0; scale C here instead.
  if (K == 0) {
    scale_c(C, ldc, M, N, beta);
    return;
  }
  // OpenBLAS runs single-threaded. Its own worker threads and the OpenMP workers of the other
  // ops, which spin for a while after each parallel region, would otherwise compete for the
  // same cores: the default tiny run took 170 ms a step that way on two cores, 100 ms like this.
  // It also keeps the GEMM's result independent of the machine's core count.
  static std::once_flag single_threaded;
  std::call_once(single_threaded, [] { openblas_set_num_threads(1); });
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(M),
              static_cast<blasint>(N), static_cast<blasint>(K), alpha, A,
              static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C,
              static_cast<blasint>(ldc));
#else
  sgemm_builtin(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
}

namespace ref {

void linear_forward(float* out, const float* x, const float* weight, const float* bias, int64_t N,
                    int64_t IC, int64_t OC) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t o = 0; o < OC; ++o) {
      double s = bias ? double(bias[o]) : 0.0;
      for (int64_t i = 0; i < IC; ++i) s += double(x[n * IC + i]) * double(weight[o * IC + i]);
      out[n * OC + o] = static_cast<float>(s);
    }
  }
}

void linear_backward(float* dx, float* dweight, float* dbias, const float* dout, const float* x,
                     const float* weight, int64_t N, int64_t IC, int64_t OC) {
  if (dx) {
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t i = 0; i < IC; ++i) {
        double s = 0;
        for (int64_t o = 0; o < OC; ++o) s += double(dout[n * OC + o]) * double(weight[o * IC + i]);
        dx[n * IC + i] = static_cast<float>(s);
      }
    }
  }
  if (dweight) {
    for (int64_t o = 0; o < OC; ++o) {
      for (int64_t i = 0; i < IC; ++i) {
        double s = 0;
        for (int64_t n = 0; n < N; ++n) s += double(dout[n * OC + o]) * double(x[n * IC + i]);
        dweight[o * IC + i] = static_cast<float>(double(dweight[o * IC + i]) + s);
      }
    }
  }
  if (dbias) {
    for (int64_t o = 0; o < OC; ++o) {
      double s = 0;
      for (int64_t n = 0; n < N; ++n) s += double(dout[n * OC + o]);
      dbias[o] = static_cast<float>(double(dbias[o]) + s);
    }
  }
}

}  // namespace ref

namespace cpu {

void linear_forward(float* out, const float* x, const float* weight, const float* bias, int64_t N,
                    int64_t IC, int64_t OC) {
  // Seed out with the bias and let the GEMM add onto it (beta = 1): one pass over out fewer.
  float beta = 0.0f;
  if (bias) {
#pragma omp parallel for schedule(static) if (N * OC >= (int64_t{1} << 16))
    for (int64_t n = 0; n < N; ++n) std::memcpy(out + n * OC, bias, OC * sizeof(float));
    beta = 1.0f;
  }
  sgemm(false, true, N, OC, IC, 1.0f, x, IC, weight, IC, beta, out, OC);
}

void linear_backward(float* dx, float* dweight, float* dbias, const float* dout, const float* x,
                     const float* weight, int64_t N, int64_t IC, int64_t OC) {
  if (dx) sgemm(false, false, N, IC, OC, 1.0f, dout, OC, weight, IC, 0.0f, dx, IC);
  if (dweight) sgemm(true, false, OC, IC, N, 1.0f, dout, OC, x, IC, 1.0f, dweight, IC);
  if (dbias) {
    // Column sums of dout: each thread owns a fixed range of columns and walks the rows in
    // order, so the sums do not depend on the thread count.
    constexpr int64_t kCols = 64;
    const int64_t blocks = (OC + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) if (blocks > 1 && N * OC >= (int64_t{1} << 16))
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t o0 = b * kCols;
      const int64_t cols = std::min(kCols, OC - o0);
      double sums[kCols] = {};
      for (int64_t n = 0; n < N; ++n) {
        const float* row = dout + n * OC + o0;
        for (int64_t j = 0; j < cols; ++j) sums[j] += double(row[j]);
      }
      for (int64_t j = 0; j < cols; ++j) {
        dbias[o0 + j] = static_cast<float>(double(dbias[o0 + j]) + sums[j]);
      }
    }
  }
}

}  // namespace cpu
}  // namespace strata::kernels
