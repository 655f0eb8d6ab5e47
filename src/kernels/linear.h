// Linear layer: out (N, OC) = x (N, IC) @ weight (OC, IC)^T + bias (OC). Weight layout is the
// PyTorch/Hugging Face one (out_features, in_features). The fast path uses OpenBLAS when the
// build found it (STRATA_HAVE_OPENBLAS) and a built-in blocked GEMM otherwise.
#pragma once
#include <cstdint>

#include "core/status.h"

namespace strata::kernels {
#define STRATA_LINEAR_OPS                                                                         \
  /* bias may be null */                                                                          \
  void linear_forward(float* out /*(N,OC)*/, const float* x /*(N,IC)*/,                           \
                      const float* weight /*(OC,IC)*/, const float* bias /*(OC) or null*/,        \
                      int64_t N, int64_t IC, int64_t OC);                                         \
  /* dx (N,IC) = (skipped when null); dweight (OC,IC) += (skipped when null); dbias (OC) += (skipped when null) */    \
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
// The built-in blocked GEMM (what sgemm uses without OpenBLAS, or with fixed_order_gemm()):
// every element of C is alpha times the sum of its K products added one by one in index order
// (then plus beta * C), whatever the machine and the thread count. Exposed so tests cover it
// even when OpenBLAS is present.
void sgemm_builtin(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                   const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                   int64_t ldc);

// Which GEMM sgemm runs. OpenBLAS (where strata is built with it) is the fast one, but it picks
// its kernels by CPU, so its summation order, and with it the last bits of every result, differs
// between CPU models. With fixed_order_gemm() on, sgemm runs sgemm_builtin, whose order is the
// same everywhere: a run then repeats bitwise on other x86-64 machines too (about 2-4 times
// slower GEMMs). The initial value comes from STRATA_DETERMINISTIC_GEMM (1 on, 0 or unset off);
// the setter is for tests and tools. Safe for concurrent use.
bool fixed_order_gemm();
void set_fixed_order_gemm(bool on);
// STRATA_DETERMINISTIC_GEMM's value as a setting: "" and "0" off, "1" on, anything else an
// error naming the variable (the CLI checks it at start).
Result<bool> parse_deterministic_gemm(const char* value);

}  // namespace strata::kernels
