// Ring attention's blocks on CUDA (ops.h): the merge of one block's attention into the running
// fp32 sums by their log-sum-exps, and the fp32 sums of the gradients. The blocks themselves run
// on cuDNN's fused attention (cudnn_attention.cpp) or the WMMA kernel, as whole sequences do.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 128;

// One block of threads per row (b, t, h): every thread reads the row's two lse values, the
// threads then write their elements of out, and the first writes the merged lse once all have
// read the old one. The arithmetic is the CPU's (kernels/cpu/attention.cpp, store_row) in fp32.
__global__ void attention_merge_kernel(float* out, float* lse, const bf16* block_out, const float* block_lse,
                                       int64_t T, int64_t Hq, int64_t Dv, bool accumulate) {
  const int64_t row = blockIdx.x;  // (b * T + t) * Hq + h
  const int64_t h = row % Hq, t = (row / Hq) % T, b = row / (Hq * T);
  const int64_t at = (b * Hq + h) * T + t;
  const float fresh = block_lse[at];
  const float old = accumulate ? lse[at] : -INFINITY;
  float w_old = 0.0f, w_new = 1.0f, merged = fresh;
  if (old != -INFINITY) {
    const float hi = fmaxf(old, fresh);
    merged = hi + logf(expf(old - hi) + expf(fresh - hi));
    w_old = expf(old - merged);
    w_new = expf(fresh - merged);
  }
  float* o = out + row * Dv;
  const bf16* x = block_out + row * Dv;
  for (int64_t d = threadIdx.x; d < Dv; d += blockDim.x) {
    const float prior = old != -INFINITY ? w_old * o[d] : 0.0f;
    o[d] = prior + w_new * to_float(x[d]);
  }
  __syncthreads();
  if (threadIdx.x == 0) lse[at] = merged;
}

__global__ void add_bf16_to_f32_kernel(float* sum, const bf16* x, int64_t n, bool accumulate) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < n; i += stride) sum[i] = (accumulate ? sum[i] : 0.0f) + to_float(x[i]);
}

}  // namespace

void attention_merge(float* out, float* lse, const bf16* block_out, const float* block_lse, int64_t B, int64_t T,
                     int64_t Hq, int64_t Dv, bool accumulate, cudaStream_t stream) {
  CHECK(B >= 0 && T >= 0 && Hq > 0 && Dv > 0);
  const int64_t rows = B * T * Hq;
  if (rows == 0) return;
  CHECK_MSG(rows <= int64_t{0x7fffffff}, "attention_merge: too many rows for one grid");
  attention_merge_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(out, lse, block_out, block_lse, T, Hq,
                                                                               Dv, accumulate);
  CUDA_CHECK_LAUNCH();
}

void add_bf16_to_f32(float* sum, const bf16* x, int64_t n, bool accumulate, cudaStream_t stream) {
  CHECK(n >= 0);
  if (n == 0) return;
  add_bf16_to_f32_kernel<<<elementwise_blocks(n, 256), 256, 0, stream>>>(sum, x, n, accumulate);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
