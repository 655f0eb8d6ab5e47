#include "kernels/bf16.h"

namespace strata::kernels {

void round_to_bf16(uint16_t* out, const float* in, int64_t n) {
#pragma omp parallel for schedule(static) if (n > (int64_t{1} << 16))
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(in[i]);
}

}  // namespace strata::kernels
