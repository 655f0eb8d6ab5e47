#include "kernels/cuda/elementwise.h"

#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

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

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

__global__ void shared_expert_combine_kernel(bf16* out, const bf16* shared_out, const float* logit, int64_t N,
                                             int64_t C) {
  const int64_t n_all = N * C;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_all; i += stride) {
    const float s = sigmoid(logit[i / C]);
    out[i] = to_bf16(to_float(out[i]) + s * to_float(shared_out[i]));
  }
}

// One warp per token.
__global__ void shared_expert_backward_kernel(bf16* dshared, float* dlogit, const bf16* dout, const bf16* shared_out,
                                              const float* logit, int64_t N, int64_t C) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  if (n >= N) return;
  const float s = sigmoid(logit[n]);
  float dot = 0.0f;
  for (int64_t c = lane; c < C; c += kWarpSize) {
    const float d = to_float(dout[n * C + c]);
    dot += d * to_float(shared_out[n * C + c]);
    dshared[n * C + c] = to_bf16(s * d);
  }
  dot = warp_sum(dot);
  if (lane == 0) dlogit[n] = dot * s * (1.0f - s);
}

}  // namespace

// ---- kernel launchers -------------------------------------------------------------------------

void f32_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t stream) {
  CHECK(n >= 0);
  if (n == 0) return;
  f32_to_bf16_kernel<<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(out, in, n);
  CUDA_CHECK_LAUNCH();
}

void add_inplace(bf16* a, const bf16* b, int64_t n, cudaStream_t stream) {
  CHECK(n >= 0);
  if (n == 0) return;
  add_inplace_kernel<<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(a, b, n);
  CUDA_CHECK_LAUNCH();
}

void shared_expert_combine(bf16* out, const bf16* shared_out, const float* logit, int64_t N, int64_t C,
                           cudaStream_t stream) {
  CHECK(N >= 0 && C > 0);
  if (N == 0) return;
  shared_expert_combine_kernel<<<elementwise_blocks(N * C, kThreads), kThreads, 0, stream>>>(out, shared_out, logit,
                                                                                              N, C);
  CUDA_CHECK_LAUNCH();
}

void shared_expert_backward(bf16* dshared, float* dlogit, const bf16* dout, const bf16* shared_out,
                            const float* logit, int64_t N, int64_t C, cudaStream_t stream) {
  CHECK(N >= 0 && C > 0);
  if (N == 0) return;
  const int warps = kThreads / kWarpSize;
  shared_expert_backward_kernel<<<static_cast<unsigned>(ceil_div(N, warps)), kThreads, 0, stream>>>(
      dshared, dlogit, dout, shared_out, logit, N, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
