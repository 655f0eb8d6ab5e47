#include "model/cuda/elementwise.h"

#include "kernels/cuda/common.cuh"

namespace strata::model::cuda {
namespace {

using kernels::cuda::to_bf16;
using kernels::cuda::to_float;

constexpr int kThreads = 256;

// ---- CUDA kernels -----------------------------------------------------------------------------

__global__ void f32_to_bf16_kernel(bf16* out, const float* in, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = to_bf16(in[i]);
  }
}

__global__ void add_inplace_kernel(bf16* a, const bf16* b, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    a[i] = to_bf16(to_float(a[i]) + to_float(b[i]));
  }
}

}  // namespace

// ---- kernel launchers -------------------------------------------------------------------------

void f32_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t stream) {
  CHECK(n >= 0);
  if (n == 0) return;
  f32_to_bf16_kernel<<<kernels::cuda::elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(out, in, n);
  CUDA_CHECK_LAUNCH();
}

void add_inplace(bf16* a, const bf16* b, int64_t n, cudaStream_t stream) {
  CHECK(n >= 0);
  if (n == 0) return;
  add_inplace_kernel<<<kernels::cuda::elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(a, b, n);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::model::cuda
