// Token embedding lookup and its scatter-add backward.
#include "kernels/embedding.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/check.h"

namespace strata::kernels {
namespace {

// Positions 0..N-1 ordered by token, ties kept in position order. Both backward paths walk
// each token's positions in this order, which is what makes them independent of threading.
std::vector<int64_t> positions_by_token(const int32_t* tokens, int64_t N) {
  std::vector<int64_t> order(static_cast<size_t>(N));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [tokens](int64_t a, int64_t b) { return tokens[a] < tokens[b]; });
  return order;
}

void check_token(int32_t token, int64_t pos) {
  CHECK_MSG(token >= 0, "negative token id " + std::to_string(token) + " at position " +
                            std::to_string(pos));
}

}  // namespace

namespace ref {

void embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t N,
                       int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    check_token(tokens[n], n);
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = table[int64_t{tokens[n]} * C + c];
  }
}

void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t N,
                        int64_t C) {
  // Sum every occurrence of a token in double, then add the sum to its row once.
  const std::vector<int64_t> order = positions_by_token(tokens, N);
  std::vector<double> sum(static_cast<size_t>(C));
  for (int64_t begin = 0; begin < N;) {
    const int32_t token = tokens[order[begin]];
    check_token(token, order[begin]);
    std::fill(sum.begin(), sum.end(), 0.0);
    int64_t end = begin;
    for (; end < N && tokens[order[end]] == token; ++end) {
      for (int64_t c = 0; c < C; ++c) sum[c] += double(dout[order[end] * C + c]);
    }
    float* row = dtable + int64_t{token} * C;
    for (int64_t c = 0; c < C; ++c) row[c] = static_cast<float>(double(row[c]) + sum[c]);
    begin = end;
  }
}

}  // namespace ref

namespace cpu {

void embedding_forward_blocked(float* out, const int32_t* tokens, const float* const* table_blocks,
                               int64_t block_rows, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static) if (N * C >= (int64_t{1} << 16))
  for (int64_t n = 0; n < N; ++n) {
    check_token(tokens[n], n);
    const int64_t v = tokens[n];
    std::memcpy(out + n * C, table_blocks[v / block_rows] + (v % block_rows) * C,
                static_cast<size_t>(C) * sizeof(float));
  }
}

void embedding_backward_blocked(float* const* dtable_blocks, int64_t block_rows, const float* dout,
                                const int32_t* tokens, int64_t N, int64_t C) {
  // Group positions by token; one thread owns each distinct token's row and adds its
  // occurrences in position order. No two threads touch the same row, and the order of the
  // additions never depends on the thread count, so the result is bitwise reproducible.
  const std::vector<int64_t> order = positions_by_token(tokens, N);
  std::vector<int64_t> group_starts;
  for (int64_t i = 0; i < N; ++i) {
    if (i == 0 || tokens[order[i]] != tokens[order[i - 1]]) group_starts.push_back(i);
  }
  const int64_t groups = static_cast<int64_t>(group_starts.size());
  group_starts.push_back(N);

#pragma omp parallel for schedule(dynamic, 16) if (N * C >= (int64_t{1} << 16))
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = group_starts[g], end = group_starts[g + 1];
    const int32_t token = tokens[order[begin]];
    check_token(token, order[begin]);
    float* __restrict row = dtable_blocks[token / block_rows] + (token % block_rows) * C;
    for (int64_t i = begin; i < end; ++i) {
      const float* __restrict src = dout + order[i] * C;
      for (int64_t c = 0; c < C; ++c) row[c] += src[c];
    }
  }
}

void embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t N,
                       int64_t C) {
  const float* const blocks[1] = {table};
  embedding_forward_blocked(out, tokens, blocks, std::numeric_limits<int32_t>::max(), N, C);
}

void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t N,
                        int64_t C) {
  float* const blocks[1] = {dtable};
  embedding_backward_blocked(blocks, std::numeric_limits<int32_t>::max(), dout, tokens, N, C);
}

}  // namespace cpu
}  // namespace strata::kernels
