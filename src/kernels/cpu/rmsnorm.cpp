// RMSNorm forward and backward.
#include "kernels/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace strata::kernels {
namespace {

// Lanes of the partial sums below: independent accumulators the compiler keeps in vector
// registers, combined in a fixed order so every row's result is reproducible.
constexpr int64_t kLanes = 16;

// sum(a[i] * b[i]) with fp32 lane partials combined in double.
double dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += a[i + j] * b[i + j];
  }
  double s = 0;
  for (int64_t j = 0; j < kLanes; ++j) s += lanes[j];
  for (; i < n; ++i) s += double(a[i]) * b[i];
  return s;
}

// Rows of one chunk in the fast backward: the chunk count depends on N only (not on the
// number of threads), so dweight's partial sums and their reduction order are fixed.
constexpr int64_t kMaxChunks = 64;

}  // namespace

namespace ref {

void rmsnorm_forward(float* out, float* rstd, const float* x, const float* weight, int64_t N,
                     int64_t C, float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += double(xr[c]) * xr[c];
    const double r = 1.0 / std::sqrt(ss / double(C) + double(eps));
    rstd[n] = static_cast<float>(r);
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = static_cast<float>(xr[c] * r * weight[c]);
  }
}

void rmsnorm_backward(float* dx, float* dweight, const float* dout, const float* x,
                      const float* weight, const float* rstd, int64_t N, int64_t C) {
  // out_i = x_i r w_i with r = (mean(x^2) + eps)^(-1/2), dr/dx_j = -r^3 x_j / C, so
  // dx_j = r w_j g_j - r^3 x_j / C * sum_i g_i w_i x_i.
  std::vector<double> dw(static_cast<size_t>(C), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    const float* g = dout + n * C;
    const double r = rstd[n];
    double s = 0;
    for (int64_t c = 0; c < C; ++c) s += double(g[c]) * weight[c] * xr[c];
    for (int64_t c = 0; c < C; ++c) {
      dx[n * C + c] = static_cast<float>(r * weight[c] * g[c] - r * r * r * xr[c] * s / double(C));
      dw[c] += double(g[c]) * xr[c] * r;
    }
  }
  if (dweight != nullptr)
    for (int64_t c = 0; c < C; ++c) dweight[c] = static_cast<float>(double(dweight[c]) + dw[c]);
}

}  // namespace ref

namespace cpu {

void rmsnorm_forward(float* out, float* rstd, const float* x, const float* weight, int64_t N,
                     int64_t C, float eps) {
#pragma omp parallel for schedule(static) if (N * C >= (int64_t{1} << 15))
  for (int64_t n = 0; n < N; ++n) {
    const float* __restrict xr = x + n * C;
    float* __restrict o = out + n * C;
    const float r = static_cast<float>(1.0 / std::sqrt(dot(xr, xr, C) / double(C) + double(eps)));
    rstd[n] = r;
    for (int64_t c = 0; c < C; ++c) o[c] = xr[c] * r * weight[c];
  }
}

void rmsnorm_backward(float* dx, float* dweight, const float* dout, const float* x,
                      const float* weight, const float* rstd, int64_t N, int64_t C) {
  if (N == 0 || C == 0) return;
  const int64_t rows_per_chunk = (N + kMaxChunks - 1) / kMaxChunks;
  const int64_t chunks = (N + rows_per_chunk - 1) / rows_per_chunk;
  // partial[k] holds chunk k's contribution to dweight, accumulated row by row.
  std::vector<float> partial(static_cast<size_t>(chunks * C), 0.0f);
  const bool parallel = N * C >= (int64_t{1} << 15);

#pragma omp parallel if (parallel)
  {
    std::vector<float> gw(static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t k = 0; k < chunks; ++k) {
      float* __restrict dw = partial.data() + k * C;
      const int64_t n_end = std::min(N, (k + 1) * rows_per_chunk);
      for (int64_t n = k * rows_per_chunk; n < n_end; ++n) {
        const float* __restrict xr = x + n * C;
        const float* __restrict g = dout + n * C;
        float* __restrict d = dx + n * C;
        const float r = rstd[n];
        for (int64_t c = 0; c < C; ++c) gw[c] = g[c] * weight[c];
        const float coef = static_cast<float>(double(r) * r * r * dot(gw.data(), xr, C) / double(C));
        for (int64_t c = 0; c < C; ++c) {
          d[c] = r * gw[c] - coef * xr[c];
          dw[c] += g[c] * xr[c] * r;
        }
      }
    }
    // Reduce the chunks in index order for every column (none for a frozen weight).
#pragma omp for schedule(static)
    for (int64_t c = 0; c < (dweight != nullptr ? C : 0); ++c) {
      double s = 0;
      for (int64_t k = 0; k < chunks; ++k) s += partial[k * C + c];
      dweight[c] = static_cast<float>(double(dweight[c]) + s);
    }
  }
}

}  // namespace cpu
}  // namespace strata::kernels
