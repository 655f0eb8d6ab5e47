#include "train/optimizer.h"

#include <cmath>

#include "kernels/adamw.h"
#include "kernels/grad_norm.h"

namespace strata {

AdamW::AdamW(const model::ParamLayout& layout, const OptimizerConfig& config)
    : layout_(layout),
      config_(config),
      m_(static_cast<size_t>(layout.total_size()), 0.0f),
      v_(static_cast<size_t>(layout.total_size()), 0.0f) {}

double AdamW::grad_norm(const float* grads) const {
  double sum = 0;
  for (const auto& t : layout_.tensors()) sum += kernels::cpu::sum_squares(grads + t.offset, t.numel);
  return std::sqrt(sum);
}

double AdamW::clip_gradients(float* grads, float max_norm) {
  const double norm = grad_norm(grads);
  const float coefficient = kernels::clip_coefficient(norm, max_norm);
  if (coefficient != 1.0f) {
    for (const auto& t : layout_.tensors()) kernels::cpu::scale_inplace(grads + t.offset, t.numel, coefficient);
  }
  return norm;
}

void AdamW::step(float* params, const float* grads, float lr) {
  ++step_count_;
  kernels::AdamWParams p;
  p.lr = lr;
  p.beta1 = config_.beta1;
  p.beta2 = config_.beta2;
  p.eps = config_.eps;
  p.step = step_count_;
  for (const auto& t : layout_.tensors()) {
    p.weight_decay = t.weight_decay ? config_.weight_decay : 0.0f;
    kernels::cpu::adamw_step(params + t.offset, grads + t.offset, m_.data() + t.offset,
                             v_.data() + t.offset, t.numel, p);
  }
}

}  // namespace strata
