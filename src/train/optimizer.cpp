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
  // Block by block for tensors in row blocks, as the paged state, which holds each block
  // apart, sums them: the same order of additions gives bitwise the same norm.
  for (const auto& t : layout_.tensors())
    for (int64_t b = 0; b < t.num_blocks(); ++b) sum += kernels::cpu::sum_squares(grads + t.block_offset(b), t.block_numel(b));
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
