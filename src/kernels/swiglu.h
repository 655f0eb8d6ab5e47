// SwiGLU activation: out = silu(gate) * up, silu(x) = x * sigmoid(x). The MLP around it is
// down(swiglu(gate(x), up(x))), composed from linear ops by the model.
#pragma once
#include <cstdint>

namespace strata::kernels {
#define STRATA_SWIGLU_OPS                                                                         \
  void swiglu_forward(float* out /*(n)*/, const float* gate /*(n)*/, const float* up /*(n)*/,     \
                      int64_t n);                                                                  \
  /* dgate, dup = (overwritten) */                                                                \
  void swiglu_backward(float* dgate /*(n)*/, float* dup /*(n)*/, const float* dout /*(n)*/,       \
                       const float* gate /*(n)*/, const float* up /*(n)*/, int64_t n);
namespace ref { STRATA_SWIGLU_OPS }
namespace cpu { STRATA_SWIGLU_OPS }
#undef STRATA_SWIGLU_OPS
}  // namespace strata::kernels
