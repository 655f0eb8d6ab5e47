// Learning rate per optimizer step: linear warmup from 0, then cosine or linear decay to
// min_lr_ratio * peak at the last step, or constant.
#pragma once

#include <cstdint>
#include <string>

namespace strata {

struct LrSchedule {
  double peak = 0;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_lr_ratio = 0;
  std::string kind = "cosine";  // cosine | linear | constant

  // step is 1-based: the first update uses lr(1).
  double lr(int64_t step) const;
};

}  // namespace strata
