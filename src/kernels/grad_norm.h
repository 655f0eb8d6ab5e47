// Pieces of global gradient-norm clipping (torch.nn.utils.clip_grad_norm_): the caller sums
// squares over every gradient buffer (and later over ranks), takes the square root, and when
// norm > max_norm scales every gradient by max_norm / (norm + 1e-6).
#pragma once
#include <cstdint>

namespace strata::kernels {
#define STRATA_GRAD_NORM_OPS                                                                      \
  /* sum of x[i]^2, accumulated in double */                                                      \
  double sum_squares(const float* x /*(n)*/, int64_t n);                                          \
  /* x *= s */                                                                                     \
  void scale_inplace(float* x /*(n)*/, int64_t n, float s);
namespace ref { STRATA_GRAD_NORM_OPS }
namespace cpu { STRATA_GRAD_NORM_OPS }
#undef STRATA_GRAD_NORM_OPS

// The factor clip_grad_norm_ multiplies by: min(1, max_norm / (norm + 1e-6)); 1 when
// max_norm <= 0 (clipping off).
float clip_coefficient(double norm, double max_norm);
}  // namespace strata::kernels
