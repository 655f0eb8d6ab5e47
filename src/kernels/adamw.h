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

#define STRATA_ADAMW_OPS                                                                          \
  void adamw_step(float* param /*(n)*/, const float* grad /*(n)*/, float* m /*(n)*/,              \
                  float* v /*(n)*/, int64_t n, const AdamWParams& p);
namespace ref { STRATA_ADAMW_OPS }
namespace cpu { STRATA_ADAMW_OPS }
#undef STRATA_ADAMW_OPS
}  // namespace strata::kernels
