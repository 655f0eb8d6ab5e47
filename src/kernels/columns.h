// Column copies between row-major matrices, for the layers that split a projection's output into
// parts or assemble one from them (multi-head latent attention, model/mla_layer.h): a head's
// key is its own no-RoPE part beside a RoPE part all heads share, and RoPE turns a contiguous
// copy of the RoPE dims.
//
// DeepSeek's checkpoints hold a head's RoPE dims interleaved (pairs 2i, 2i+1 turn together);
// its modeling code de-interleaves them (first the even dims, then the odd) before the
// rotate-half RoPE the other models use. The copies can do that permutation and its inverse.
#pragma once

#include <cstdint>

#include "kernels/bf16.h"

namespace strata::kernels {

enum class ColumnOrder : uint8_t {
  kSame,          // dst[c] = src[c]
  kDeinterleave,  // dst[i] = src[2i], dst[cols/2 + i] = src[2i + 1] (cols even)
  kInterleave,    // the inverse: dst[2i] = src[i], dst[2i + 1] = src[cols/2 + i]
};

#define STRATA_COLUMN_OPS(Act)                                                                     \
  /* dst[r*ld_dst + c] = src[r*ld_src + order(c)] for r < rows, c < cols. */                       \
  void copy_columns(Act* dst, int64_t ld_dst, const Act* src, int64_t ld_src, int64_t rows, int64_t cols, \
                    ColumnOrder order);                                                            \
  /* dst (rows, cols) = sum over h < heads of src[r*ld_src + h*head_stride + c]: summed in fp32,  \
     in order of h, and rounded once. */                                                           \
  void sum_head_columns(Act* dst, const Act* src, int64_t ld_src, int64_t head_stride, int64_t rows, \
                        int64_t heads, int64_t cols);

namespace cpu {

// The column of src that column c of dst takes.
inline int64_t source_column(int64_t c, int64_t cols, ColumnOrder order) {
  const int64_t half = cols / 2;
  switch (order) {
    case ColumnOrder::kSame: return c;
    case ColumnOrder::kDeinterleave: return c < half ? 2 * c : 2 * (c - half) + 1;
    case ColumnOrder::kInterleave: return c % 2 == 0 ? c / 2 : half + c / 2;
  }
  return c;
}

// The CPU ops of both recipes (T = float or Bf16): copies move bits; the sums are fp32.
template <class T>
void copy_columns(T* dst, int64_t ld_dst, const T* src, int64_t ld_src, int64_t rows, int64_t cols, ColumnOrder order) {
#pragma omp parallel for schedule(static) if (rows * cols >= (int64_t{1} << 16))
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[r * ld_dst + c] = src[r * ld_src + source_column(c, cols, order)];
  }
}

inline float column_value(float v) { return v; }
inline float column_value(Bf16 v) { return to_f32(v); }
inline void store_column(float* dst, float v) { *dst = v; }
inline void store_column(Bf16* dst, float v) { *dst = to_bf16(v); }

template <class T>
void sum_head_columns(T* dst, const T* src, int64_t ld_src, int64_t head_stride, int64_t rows, int64_t heads,
                      int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols * heads >= (int64_t{1} << 16))
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float sum = 0.0f;
      for (int64_t h = 0; h < heads; ++h) sum += column_value(src[r * ld_src + h * head_stride + c]);
      store_column(dst + r * cols + c, sum);
    }
  }
}

}  // namespace cpu
}  // namespace strata::kernels
