// Helpers shared by the .cu files of this folder (device side and launch checks). Includes
// only CUDA headers and plain strata headers, so that it compiles under nvcc in C++17.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/check.h"
#include "core/cuda/cuda_check.h"
#include "kernels/cuda/ops.h"

// After every launch: a bad configuration (too many threads, too much shared memory) shows up
// here, with the launcher's file and line.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

namespace strata::kernels::cuda {

constexpr int kWarpSize = 32;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks for a grid-stride loop over n elements: enough to fill the GPU, a fixed number so the
// launch shape depends on n only.
inline unsigned elementwise_blocks(int64_t n, int threads) {
  const int64_t blocks = ceil_div(n, threads);
  return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 to_bf16(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}
__device__ __forceinline__ double warp_max(double v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = fmax(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Sum over the block; every thread gets the result. REQUIRES blockDim.x a multiple of 32 and
// at most 1024; `shared` holds 32 values. Called by every thread of the block. The order of
// the additions is fixed by blockDim, so the result is reproducible.
template <typename T>
__device__ T block_sum(T v, T* shared) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  v = warp_sum(v);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : T(0);
  return warp_sum(v);
}

}  // namespace strata::kernels::cuda
