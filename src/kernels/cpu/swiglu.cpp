// SwiGLU: out = silu(gate) * up.
#include "kernels/swiglu.h"

#include <cmath>

namespace strata::kernels {

namespace ref {

void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    const double sig = 1.0 / (1.0 + std::exp(-g));
    out[i] = static_cast<float>(g * sig * up[i]);
  }
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                     const float* up, int64_t n) {
  // d silu(g) / dg = sig + g sig (1 - sig) = sig (1 + g (1 - sig)).
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    const double sig = 1.0 / (1.0 + std::exp(-g));
    dgate[i] = static_cast<float>(double(dout[i]) * up[i] * sig * (1.0 + g * (1.0 - sig)));
    dup[i] = static_cast<float>(double(dout[i]) * g * sig);
  }
}

}  // namespace ref

namespace cpu {

// exp(-g) overflows to +inf for g below about -88; sig then becomes 0 and silu(g) 0, the
// correct limit, so no clamping is needed.
void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= (int64_t{1} << 16))
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float sig = 1.0f / (1.0f + std::exp(-g));
    out[i] = g * sig * up[i];
  }
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                     const float* up, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= (int64_t{1} << 16))
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float sig = 1.0f / (1.0f + std::exp(-g));
    const float silu = g * sig;
    dgate[i] = dout[i] * up[i] * (sig + silu * (1.0f - sig));
    dup[i] = dout[i] * silu;
  }
}

}  // namespace cpu
}  // namespace strata::kernels
