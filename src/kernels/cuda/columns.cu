// The column ops of elementwise.h (kernels/columns.h): one thread per output element.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/elementwise.h"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// kernels::cpu::source_column's rule (order 0 same, 1 de-interleave, 2 interleave).
__device__ int64_t source_column(int64_t c, int64_t cols, int order) {
  const int64_t half = cols / 2;
  if (order == 1) return c < half ? 2 * c : 2 * (c - half) + 1;
  if (order == 2) return c % 2 == 0 ? c / 2 : half + c / 2;
  return c;
}

__global__ void copy_columns_kernel(bf16* dst, int64_t ld_dst, const bf16* src, int64_t ld_src, int64_t rows,
                                    int64_t cols, int order) {
  const int64_t n = rows * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / cols, c = i % cols;
    dst[r * ld_dst + c] = src[r * ld_src + source_column(c, cols, order)];
  }
}

__global__ void sum_head_columns_kernel(bf16* dst, const bf16* src, int64_t ld_src, int64_t head_stride,
                                        int64_t rows, int64_t heads, int64_t cols) {
  const int64_t n = rows * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / cols, c = i % cols;
    float sum = 0.0f;
    for (int64_t h = 0; h < heads; ++h) sum += to_float(src[r * ld_src + h * head_stride + c]);
    dst[i] = to_bf16(sum);
  }
}

}  // namespace

void copy_columns(bf16* dst, int64_t ld_dst, const bf16* src, int64_t ld_src, int64_t rows, int64_t cols, int order,
                  cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  copy_columns_kernel<<<elementwise_blocks(rows * cols, kThreads), kThreads, 0, stream>>>(dst, ld_dst, src, ld_src,
                                                                                          rows, cols, order);
  CUDA_CHECK_LAUNCH();
}

void sum_head_columns(bf16* dst, const bf16* src, int64_t ld_src, int64_t head_stride, int64_t rows, int64_t heads,
                      int64_t cols, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  sum_head_columns_kernel<<<elementwise_blocks(rows * cols, kThreads), kThreads, 0, stream>>>(
      dst, src, ld_src, head_stride, rows, heads, cols);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
