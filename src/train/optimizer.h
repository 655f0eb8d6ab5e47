// The optimizer's settings: AdamW (torch.optim.AdamW semantics) with global gradient-norm
// clipping (torch.nn.utils.clip_grad_norm_). The optimizer itself is PagedState's, run per
// group wherever the group's state lives (train/paged_state.h).
#pragma once

namespace strata {

struct OptimizerConfig {
  float lr = 3e-4f;  // the trainer passes the scheduled rate to step(); this is the peak
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;  // applied only to tensors with TensorSpec::weight_decay
  float grad_clip = 1.0f;     // max global gradient norm; <= 0 turns clipping off
};

}  // namespace strata
