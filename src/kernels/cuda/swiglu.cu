// SwiGLU on CUDA: out = silu(gate) * up, elementwise, fp32 math on bf16 storage.
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// sigmoid(g) = 1 / (1 + exp(-g)); exp(-g) overflows to +inf for g below about -88, which
// gives sigmoid 0 and silu 0, the right limits.
__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

__global__ void swiglu_forward_kernel(bf16* out, const bf16* gate, const bf16* up, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float g = to_float(gate[i]);
    out[i] = to_bf16(g * sigmoid(g) * to_float(up[i]));
  }
}

// d silu(g) / dg = sig + g sig (1 - sig).
__global__ void swiglu_backward_kernel(bf16* dgate, bf16* dup, const bf16* dout,
                                       const bf16* gate, const bf16* up, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float g = to_float(gate[i]), u = to_float(up[i]), d = to_float(dout[i]);
    const float sig = sigmoid(g);
    const float silu = g * sig;
    dgate[i] = to_bf16(d * u * (sig + silu * (1.0f - sig)));
    dup[i] = to_bf16(d * silu);
  }
}

}  // namespace

void swiglu_forward(bf16* out, const bf16* gate, const bf16* up, int64_t n, cudaStream_t stream) {
  CHECK(n >= 0);
  if (n == 0) return;
  swiglu_forward_kernel<<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(out, gate, up,
                                                                                 n);
  CUDA_CHECK_LAUNCH();
}

void swiglu_backward(bf16* dgate, bf16* dup, const bf16* dout, const bf16* gate, const bf16* up,
                     int64_t n, cudaStream_t stream) {
  CHECK(n >= 0);
  if (n == 0) return;
  swiglu_backward_kernel<<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(
      dgate, dup, dout, gate, up, n);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
