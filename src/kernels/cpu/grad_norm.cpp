// Pieces of global gradient-norm clipping.
#include "kernels/grad_norm.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace strata::kernels {

namespace ref {

double sum_squares(const float* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(x[i]) * x[i];
  return s;
}

void scale_inplace(float* x, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace ref

namespace cpu {

double sum_squares(const float* x, int64_t n) {
  // Fixed-size blocks, each summed by kLanes interleaved double accumulators, then the block
  // sums added in block order: the result depends on n only, never on the thread count.
  constexpr int64_t kBlock = 1 << 14;
  constexpr int64_t kLanes = 8;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> block_sums(static_cast<size_t>(blocks));
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    const int64_t len = std::min(kBlock, n - b * kBlock);
    double lanes[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= len; i += kLanes) {
      for (int64_t j = 0; j < kLanes; ++j) lanes[j] += double(xb[i + j]) * xb[i + j];
    }
    for (; i < len; ++i) lanes[i % kLanes] += double(xb[i]) * xb[i];
    double s = 0;
    for (int64_t j = 0; j < kLanes; ++j) s += lanes[j];
    block_sums[b] = s;
  }
  double total = 0;
  for (double s : block_sums) total += s;
  return total;
}

void scale_inplace(float* x, int64_t n, float s) {
#pragma omp parallel for schedule(static) if (n >= (int64_t{1} << 16))
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace cpu

float clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0f;
  // As clip_grad_norm_: an infinite norm gives 0 and a NaN norm gives NaN (min would drop it).
  const double coef = max_norm / (norm + 1e-6);
  if (std::isnan(coef)) return std::numeric_limits<float>::quiet_NaN();
  return static_cast<float>(std::min(coef, 1.0));
}

}  // namespace strata::kernels
