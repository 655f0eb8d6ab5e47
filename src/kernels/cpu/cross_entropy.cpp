// LM head fused with cross-entropy on the CPU: the reference (one token at a
// time, double) and the fast path (chunk_tokens tokens at a time through sgemm,
// so only chunk_tokens x V logits ever exist).
#include "kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"
#include "kernels/linear.h"

namespace strata::kernels {

namespace {
void check_args(const int32_t *targets, int64_t N, int64_t C, int64_t V,
                int64_t chunk_tokens) {
  CHECK(N >= 0 && C > 0 && V > 0);
  CHECK_MSG(chunk_tokens > 0, "chunk_tokens must be positive, got " +
                                  std::to_string(chunk_tokens));
  for (int64_t n = 0; n < N; ++n) {
    CHECK_MSG(targets[n] < V, "target " + std::to_string(targets[n]) +
                                  " at token " + std::to_string(n) +
                                  " is outside the vocabulary of " +
                                  std::to_string(V));
  }
}
} // namespace

namespace ref {

// dx is overwritten, dweight accumulates.
double lm_head_cross_entropy(float *dx, float *dweight, const float *x,
                             const float *weight, const int32_t *targets,
                             int64_t N, int64_t C, int64_t V, float grad_scale,
                             int64_t chunk_tokens) {
  check_args(targets, N, C, V, chunk_tokens);
  std::vector<double> logits(static_cast<size_t>(V));
  std::vector<double> dx_row(static_cast<size_t>(C));
  std::vector<double> dw_acc;
  if (dweight)
    dw_acc.assign(static_cast<size_t>(V * C), 0.0);
  double loss = 0;
  for (int64_t n = 0; n < N; ++n) {
    const float *xn = x + n * C;
    if (targets[n] < 0) { // masked position: no loss, no gradient
      if (dx)
        std::fill_n(dx + n * C, C, 0.0f);
      continue;
    }
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t v = 0; v < V; ++v) {
      double s = 0;
      for (int64_t c = 0; c < C; ++c)
        s += double(xn[c]) * double(weight[v * C + c]);
      logits[v] = s;
      m = std::max(m, s);
    }
    double sum = 0;
    for (int64_t v = 0; v < V; ++v)
      sum += std::exp(logits[v] - m);
    const double lse = m + std::log(sum);
    loss += lse - logits[targets[n]];

    std::fill(dx_row.begin(), dx_row.end(), 0.0);
    for (int64_t v = 0; v < V; ++v) {
      const double onehot = v == targets[n] ? 1.0 : 0.0;
      const double g =
          (std::exp(logits[v] - lse) - onehot) * double(grad_scale);
      for (int64_t c = 0; c < C; ++c) {
        dx_row[c] += g * weight[v * C + c];
        if (dweight)
          dw_acc[v * C + c] += g * xn[c];
      }
    }
    if (dx) {
      for (int64_t c = 0; c < C; ++c)
        dx[n * C + c] = static_cast<float>(dx_row[c]);
    }
  }
  if (dweight) {
    for (int64_t i = 0; i < V * C; ++i)
      dweight[i] += static_cast<float>(dw_acc[i]);
  }
  return loss;
}

} // namespace ref

namespace cpu {

// dx is overwritten, dweight accumulates. Per-row losses are kept and summed
// serially in token order, so the returned loss does not depend on the thread
// count. With one block this is the unblocked computation, call for call.
double lm_head_cross_entropy_blocked(float *dx, float *const *dweight_blocks,
                                     const float *x,
                                     const float *const *weight_blocks,
                                     int64_t block_rows, const int32_t *targets,
                                     int64_t N, int64_t C, int64_t V,
                                     float grad_scale, int64_t chunk_tokens) {
  check_args(targets, N, C, V, chunk_tokens);
  CHECK(block_rows > 0);
  const int64_t blocks = (V + block_rows - 1) / block_rows;
  auto rows_of = [&](int64_t b) { return std::min(block_rows, V - b * block_rows); };
  const int64_t chunk = std::min(chunk_tokens, std::max<int64_t>(N, 1));
  // Logits of one chunk, overwritten in place by their gradient.
  std::vector<float> buf(static_cast<size_t>(chunk * V));
  std::vector<double> row_loss(static_cast<size_t>(chunk));
  const bool want_grad = dx != nullptr || dweight_blocks != nullptr;
  double loss = 0;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t n = std::min(chunk, N - n0);
    const float *xc = x + n0 * C;
    const int32_t *tc = targets + n0;
    bool any_valid = false;
    for (int64_t r = 0; r < n; ++r)
      any_valid = any_valid || tc[r] >= 0;
    if (!any_valid) {
      if (dx)
        std::fill_n(dx + n0 * C, n * C, 0.0f);
      continue;
    }

    // Each block's logits are columns [b * block_rows, ...) of the chunk's rows.
    for (int64_t b = 0; b < blocks; ++b)
      sgemm(false, true, n, rows_of(b), C, 1.0f, xc, C, weight_blocks[b], C,
            0.0f, buf.data() + b * block_rows, V);

#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      float *row = buf.data() + r * V;
      const int32_t target = tc[r];
      if (target < 0) {
        row_loss[r] = 0;
        std::fill_n(row, V, 0.0f);
        continue;
      }
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t v = 0; v < V; ++v)
        m = std::max(m, row[v]);
      const float shifted_target = row[target] - m;
      double sum = 0; // double: V is often above 100k terms
      for (int64_t v = 0; v < V; ++v) {
        row[v] = std::exp(row[v] - m);
        sum += row[v];
      }
      row_loss[r] = std::log(sum) - double(shifted_target);
      // dlogits = (softmax - onehot) * grad_scale, the two factors folded into
      // one multiply.
      const float scale = static_cast<float>(double(grad_scale) / sum);
#pragma omp simd
      for (int64_t v = 0; v < V; ++v)
        row[v] *= scale;
      row[target] -= grad_scale;
    }
    for (int64_t r = 0; r < n; ++r)
      loss += row_loss[r];
    if (!want_grad)
      continue;

    // dx sums over the vocabulary block by block, in block order.
    for (int64_t b = 0; dx && b < blocks; ++b)
      sgemm(false, false, n, C, rows_of(b), 1.0f, buf.data() + b * block_rows,
            V, weight_blocks[b], C, b == 0 ? 0.0f : 1.0f, dx + n0 * C, C);
    for (int64_t b = 0; dweight_blocks && b < blocks; ++b)
      sgemm(true, false, rows_of(b), C, n, 1.0f, buf.data() + b * block_rows,
            V, xc, C, 1.0f, dweight_blocks[b], C);
  }
  return loss;
}

double lm_head_cross_entropy(float *dx, float *dweight, const float *x,
                             const float *weight, const int32_t *targets,
                             int64_t N, int64_t C, int64_t V, float grad_scale,
                             int64_t chunk_tokens) {
  float *const dweight_blocks[1] = {dweight};
  const float *const weight_blocks[1] = {weight};
  return lm_head_cross_entropy_blocked(dx, dweight ? dweight_blocks : nullptr,
                                       x, weight_blocks, V, targets, N, C, V,
                                       grad_scale, chunk_tokens);
}

} // namespace cpu
} // namespace strata::kernels
