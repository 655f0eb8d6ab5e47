// SwiGLU on CUDA: out = silu(gate) * up, elementwise, fp32 math on bf16 storage. When every
// pointer is 16-byte aligned, threads move 8 values per access (vector_access.cuh) and the
// last n % 8 values go through the scalar path; otherwise everything is scalar. Each element's
// arithmetic is the same on both paths, so the path never changes a result.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/vector_access.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// sigmoid(g) = 1 / (1 + exp(-g)); exp(-g) overflows to +inf for g below about -88, which
// gives sigmoid 0 and silu 0, the right limits.
__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

__device__ __forceinline__ float swiglu(float g, float u) { return g * sigmoid(g) * u; }

// d silu(g) / dg = sig + g sig (1 - sig).
__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float& dg, float& du) {
  const float sig = sigmoid(g);
  const float silu = g * sig;
  dg = d * u * (sig + silu * (1.0f - sig));
  du = d * silu;
}

// kVector: elements [0, n / 8 * 8) in packs of 8, the rest one by one.
template <bool kVector>
__global__ void swiglu_forward_kernel(bf16* out, const bf16* gate, const bf16* up, int64_t n) {
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t scalar_begin = 0;
  if constexpr (kVector) {
    const int64_t packs = n / kBf16PerPack;
    for (int64_t p = first; p < packs; p += stride) {
      const int64_t i = p * kBf16PerPack;
      float g[kBf16PerPack], u[kBf16PerPack], o[kBf16PerPack];
      load_bf16x8(gate + i, g);
      load_bf16x8(up + i, u);
#pragma unroll
      for (int k = 0; k < kBf16PerPack; ++k) o[k] = swiglu(g[k], u[k]);
      store_bf16x8(out + i, o);
    }
    scalar_begin = packs * kBf16PerPack;
  }
  for (int64_t i = scalar_begin + first; i < n; i += stride) {
    out[i] = to_bf16(swiglu(to_float(gate[i]), to_float(up[i])));
  }
}

template <bool kVector>
__global__ void swiglu_backward_kernel(bf16* dgate, bf16* dup, const bf16* dout, const bf16* gate, const bf16* up,
                                       int64_t n) {
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t scalar_begin = 0;
  if constexpr (kVector) {
    const int64_t packs = n / kBf16PerPack;
    for (int64_t p = first; p < packs; p += stride) {
      const int64_t i = p * kBf16PerPack;
      float g[kBf16PerPack], u[kBf16PerPack], d[kBf16PerPack], dg[kBf16PerPack], du[kBf16PerPack];
      load_bf16x8(gate + i, g);
      load_bf16x8(up + i, u);
      load_bf16x8(dout + i, d);
#pragma unroll
      for (int k = 0; k < kBf16PerPack; ++k) swiglu_grad(d[k], g[k], u[k], dg[k], du[k]);
      store_bf16x8(dgate + i, dg);
      store_bf16x8(dup + i, du);
    }
    scalar_begin = packs * kBf16PerPack;
  }
  for (int64_t i = scalar_begin + first; i < n; i += stride) {
    float dg, du;
    swiglu_grad(to_float(dout[i]), to_float(gate[i]), to_float(up[i]), dg, du);
    dgate[i] = to_bf16(dg);
    dup[i] = to_bf16(du);
  }
}

}  // namespace

void swiglu_forward(bf16* out, const bf16* gate, const bf16* up, int64_t n, cudaStream_t stream) {
  CHECK(n >= 0);
  if (n == 0) return;
  if (aligned16(out) && aligned16(gate) && aligned16(up)) {
    const unsigned blocks = elementwise_blocks(ceil_div(n, kBf16PerPack), kThreads);
    swiglu_forward_kernel<true><<<blocks, kThreads, 0, stream>>>(out, gate, up, n);
  } else {
    swiglu_forward_kernel<false><<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(out, gate, up, n);
  }
  CUDA_CHECK_LAUNCH();
}

void swiglu_backward(bf16* dgate, bf16* dup, const bf16* dout, const bf16* gate, const bf16* up, int64_t n,
                     cudaStream_t stream) {
  CHECK(n >= 0);
  if (n == 0) return;
  if (aligned16(dgate) && aligned16(dup) && aligned16(dout) && aligned16(gate) && aligned16(up)) {
    const unsigned blocks = elementwise_blocks(ceil_div(n, kBf16PerPack), kThreads);
    swiglu_backward_kernel<true><<<blocks, kThreads, 0, stream>>>(dgate, dup, dout, gate, up, n);
  } else {
    swiglu_backward_kernel<false>
        <<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(dgate, dup, dout, gate, up, n);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
