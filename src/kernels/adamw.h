// AdamW with decoupled weight decay, exactly as torch.optim.AdamW (non-amsgrad):
//   param *= 1 - lr * weight_decay
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
//   param -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
#pragma once
#include <cstdint>

namespace strata::kernels {

struct AdamWParams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  int64_t step = 1;  // 1-based count of updates including this one (bias correction)
};

// The fp32 scalars one step applies, formed in double and rounded once, so that every
// implementation (reference, SIMD, CUDA) multiplies by exactly the same numbers.
struct AdamWScalars {
  float decay;           // 1 - lr * weight_decay
  float lerp_weight;     // w = 1 - beta1: exp_avg.lerp_(grad, w)
  float one_minus_lerp;  // 1 - w, rounded in fp32 as PyTorch's lerp does
  bool lerp_small;       // which of lerp's two formulas PyTorch uses (w < 0.5)
  float lerp_factor;     // w when lerp_small (m + w * (g - m)), else 1 - w (g - (g - m) * (1 - w))
  float beta2;           // exp_avg_sq.mul_(beta2)
  float one_minus_b2;    // .addcmul_(grad, grad, value=1 - beta2)
  float bc2_sqrt;        // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;   // -lr / (1 - beta1^step)
};
// REQUIRES: p.step >= 1.
AdamWScalars adamw_scalars(const AdamWParams& p);

// Returns whether every parameter value it wrote is finite (no NaN or Inf), found in the loop
// that writes them. A finite gradient does not prove it: eps = 0 divides 0 by 0 where a
// gradient and its moments are 0.
#define STRATA_ADAMW_OPS                                                                                          \
  bool adamw_step(float* param /*(n)*/, const float* grad /*(n)*/, float* m /*(n)*/, float* v /*(n)*/, int64_t n, \
                  const AdamWParams& p);
namespace ref { STRATA_ADAMW_OPS }
namespace cpu { STRATA_ADAMW_OPS }
#undef STRATA_ADAMW_OPS
}  // namespace strata::kernels
