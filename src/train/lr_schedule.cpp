#include "train/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace strata {

double LrSchedule::lr(int64_t step) const {
  if (warmup_steps > 0 && step <= warmup_steps) return peak * static_cast<double>(step) / warmup_steps;
  if (kind == "constant") return peak;
  const double min_lr = peak * min_lr_ratio;
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup_steps);
  const double progress = std::clamp(static_cast<double>(step - warmup_steps) / decay_steps, 0.0, 1.0);
  if (kind == "linear") return peak - (peak - min_lr) * progress;
  return min_lr + 0.5 * (peak - min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace strata
