// AdamW over a model's flat parameter/gradient buffers (torch.optim.AdamW semantics), with
// global gradient-norm clipping as torch.nn.utils.clip_grad_norm_. Owns the moment buffers m and
// v, laid out like the parameters (same ParamLayout, same offsets). Not thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "model/params.h"

namespace strata {

struct OptimizerConfig {
  float lr = 3e-4f;  // the trainer passes the scheduled rate to step(); this is the peak
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;  // applied only to tensors with TensorSpec::weight_decay
  float grad_clip = 1.0f;     // max global gradient norm; <= 0 turns clipping off
};

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

}  // namespace strata
