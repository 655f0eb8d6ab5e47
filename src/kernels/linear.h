// Linear layer: out (N, OC) = x (N, IC) @ weight (OC, IC)^T + bias (OC). Weight layout is the
// PyTorch/Hugging Face one (out_features, in_features). The fast path uses OpenBLAS when the
// build found it (STRATA_HAVE_OPENBLAS) and a built-in blocked GEMM otherwise.
#pragma once
#include <cstdint>

namespace strata::kernels {
#define STRATA_LINEAR_OPS                                                                         \
  /* bias may be null */                                                                          \
  void linear_forward(float* out /*(N,OC)*/, const float* x /*(N,IC)*/,                           \
                      const float* weight /*(OC,IC)*/, const float* bias /*(OC) or null*/,        \
                      int64_t N, int64_t IC, int64_t OC);                                         \
  /* dx (N,IC) = (skipped when null); dweight (OC,IC) += ; dbias (OC) += (skipped when null) */    \
  void linear_backward(float* dx, float* dweight, float* dbias, const float* dout /*(N,OC)*/,     \
                       const float* x /*(N,IC)*/, const float* weight /*(OC,IC)*/, int64_t N,     \
                       int64_t IC, int64_t OC);
namespace ref { STRATA_LINEAR_OPS }
namespace cpu { STRATA_LINEAR_OPS }
#undef STRATA_LINEAR_OPS

// General row-major single-precision GEMM used by the fast paths:
// C (M,N) = alpha * op(A) @ op(B) + beta * C, op(X) = X or X^T. lda/ldb/ldc are row strides.
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
           int64_t ldc);
// The built-in blocked GEMM (what sgemm uses without OpenBLAS); exposed so tests cover it
// even when OpenBLAS is present.
void sgemm_builtin(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                   const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                   int64_t ldc);
}  // namespace strata::kernels
