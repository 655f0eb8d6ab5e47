// RMSNorm: out = x / sqrt(mean(x^2) + eps) * weight (Llama; weight is not offset by 1).
#pragma once
#include <cstdint>

namespace strata::kernels {
#define STRATA_RMSNORM_OPS                                                                        \
  /* rstd (N) is saved for backward */                                                            \
  void rmsnorm_forward(float* out /*(N,C)*/, float* rstd /*(N)*/, const float* x /*(N,C)*/,       \
                       const float* weight /*(C)*/, int64_t N, int64_t C, float eps);            \
  /* dx (N,C) = ; dweight (C) += (null: skipped) */                                                               \
  void rmsnorm_backward(float* dx /*(N,C)*/, float* dweight /*(C)*/, const float* dout /*(N,C)*/, \
                        const float* x /*(N,C)*/, const float* weight /*(C)*/,                    \
                        const float* rstd /*(N)*/, int64_t N, int64_t C);
namespace ref { STRATA_RMSNORM_OPS }
namespace cpu { STRATA_RMSNORM_OPS }
#undef STRATA_RMSNORM_OPS
}  // namespace strata::kernels
