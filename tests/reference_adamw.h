// The reference optimizer the tests hold the engine's against: AdamW over a model's flat
// parameter/gradient buffers (torch.optim.AdamW semantics), with global gradient-norm clipping
// as torch.nn.utils.clip_grad_norm_, in the plain order the paged optimizer must reproduce
// bitwise. Owns the moment buffers m and v, laid out like the parameters. Not thread-safe.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/grad_norm.h"
#include "model/params.h"
#include "train/optimizer.h"

namespace strata {

class AdamW {
 public:
  // Keeps a copy of the layout; m and v start at zero.
  AdamW(const model::ParamLayout& layout, const OptimizerConfig& config);
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;
  AdamW(AdamW&&) = default;
  AdamW& operator=(AdamW&&) = default;

  // Global L2 norm of grads (layout.total_size() elements), summed tensor by tensor in layout
  // order so that the result is deterministic.
  double grad_norm(const float* grads) const;
  // Returns the pre-clip norm and scales grads by min(1, max_norm / (norm + 1e-6)).
  double clip_gradients(float* grads, float max_norm);
  // One AdamW update of every tensor; increments step_count() first (bias correction uses the
  // 1-based count).
  void step(float* params, const float* grads, float lr);

  const OptimizerConfig& config() const { return config_; }
  const model::ParamLayout& layout() const { return layout_; }
  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t steps) { step_count_ = steps; }  // restoring a checkpoint
  float* m() { return m_.data(); }  // (total_size)
  const float* m() const { return m_.data(); }
  float* v() { return v_.data(); }  // (total_size)
  const float* v() const { return v_.data(); }

 private:
  model::ParamLayout layout_;
  OptimizerConfig config_;
  std::vector<float> m_;
  std::vector<float> v_;
  int64_t step_count_ = 0;
};

inline AdamW::AdamW(const model::ParamLayout& layout, const OptimizerConfig& config)
    : layout_(layout),
      config_(config),
      m_(static_cast<size_t>(layout.total_size()), 0.0f),
      v_(static_cast<size_t>(layout.total_size()), 0.0f) {}

inline double AdamW::grad_norm(const float* grads) const {
  double sum = 0;
  // Block by block for tensors in row blocks, as the paged state, which holds each block
  // apart, sums them: the same order of additions gives bitwise the same norm.
  for (const auto& t : layout_.tensors())
    for (int64_t b = 0; b < t.num_blocks(); ++b) sum += kernels::cpu::sum_squares(grads + t.block_offset(b), t.block_numel(b));
  return std::sqrt(sum);
}

inline double AdamW::clip_gradients(float* grads, float max_norm) {
  const double norm = grad_norm(grads);
  const float coefficient = kernels::clip_coefficient(norm, max_norm);
  if (coefficient != 1.0f) {
    for (const auto& t : layout_.tensors()) kernels::cpu::scale_inplace(grads + t.offset, t.numel, coefficient);
  }
  return norm;
}

inline void AdamW::step(float* params, const float* grads, float lr) {
  ++step_count_;
  kernels::AdamWParams p;
  p.lr = lr;
  p.beta1 = config_.beta1;
  p.beta2 = config_.beta2;
  p.eps = config_.eps;
  p.step = step_count_;
  for (const auto& t : layout_.tensors()) {
    if (t.frozen) continue;  // kept as loaded (model/params.h), as the paged optimizer does
    p.weight_decay = t.weight_decay ? config_.weight_decay : 0.0f;
    kernels::cpu::adamw_step(params + t.offset, grads + t.offset, m_.data() + t.offset,
                             v_.data() + t.offset, t.numel, p);
  }
}

}  // namespace strata
