// Element-wise kernels of elementwise.h. Where every pointer is 16-byte aligned (and, for the
// per-token ops, rows are whole packs of 8), threads move 8 values per access; the scalar path
// takes the tail and misaligned pointers. Per-element arithmetic is the same on both paths.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/vector_access.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// Grid for a kernel that handles n elements, in packs of 8 when `vector`.
unsigned blocks_for(int64_t n, bool vector) {
  return elementwise_blocks(vector ? ceil_div(n, kBf16PerPack) : n, kThreads);
}

// ---- CUDA kernels -----------------------------------------------------------------------------

template <bool kVector>
__global__ void f32_to_bf16_kernel(bf16* out, const float* in, int64_t n) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t scalar_begin = 0;
  if constexpr (kVector) {
    const int64_t packs = n / kBf16PerPack;
    for (int64_t p = first; p < packs; p += stride) {
      const int64_t i = p * kBf16PerPack;
      float lo[kF32PerPack], hi[kF32PerPack], v[kBf16PerPack];
      load_f32x4(in + i, lo);
      load_f32x4(in + i + kF32PerPack, hi);
#pragma unroll
      for (int k = 0; k < kF32PerPack; ++k) {
        v[k] = lo[k];
        v[k + kF32PerPack] = hi[k];
      }
      store_bf16x8(out + i, v);
    }
    scalar_begin = packs * kBf16PerPack;
  }
  for (int64_t i = scalar_begin + first; i < n; i += stride) out[i] = to_bf16(in[i]);
}

template <bool kVector>
__global__ void add_inplace_kernel(bf16* a, const bf16* b, int64_t n) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t scalar_begin = 0;
  if constexpr (kVector) {
    const int64_t packs = n / kBf16PerPack;
    for (int64_t p = first; p < packs; p += stride) {
      const int64_t i = p * kBf16PerPack;
      float va[kBf16PerPack], vb[kBf16PerPack];
      load_bf16x8(a + i, va);
      load_bf16x8(b + i, vb);
#pragma unroll
      for (int k = 0; k < kBf16PerPack; ++k) va[k] += vb[k];
      store_bf16x8(a + i, va);
    }
    scalar_begin = packs * kBf16PerPack;
  }
  for (int64_t i = scalar_begin + first; i < n; i += stride) a[i] = to_bf16(to_float(a[i]) + to_float(b[i]));
}

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// kVector REQUIRES C % 8 == 0: a pack then lies in one token's row, and takes its gate once.
template <bool kVector>
__global__ void shared_expert_combine_kernel(bf16* out, const bf16* shared_out, const float* logit, int64_t N,
                                             int64_t C) {
  const int64_t n_all = N * C;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if constexpr (kVector) {
    for (int64_t p = first; p < n_all / kBf16PerPack; p += stride) {
      const int64_t i = p * kBf16PerPack;
      const float s = sigmoid(logit[i / C]);
      float vo[kBf16PerPack], vs[kBf16PerPack];
      load_bf16x8(out + i, vo);
      load_bf16x8(shared_out + i, vs);
#pragma unroll
      for (int k = 0; k < kBf16PerPack; ++k) vo[k] = vo[k] + s * vs[k];
      store_bf16x8(out + i, vo);
    }
  } else {
    for (int64_t i = first; i < n_all; i += stride) {
      const float s = sigmoid(logit[i / C]);
      out[i] = to_bf16(to_float(out[i]) + s * to_float(shared_out[i]));
    }
  }
}

// One warp per token. kVector REQUIRES C % 8 == 0: lane l takes packs l, l + 32, ... of the
// row, which changes the order of the dot product's additions from the scalar path's (each
// order is fixed, so either is reproducible run to run).
template <bool kVector>
__global__ void shared_expert_backward_kernel(bf16* dshared, float* dlogit, const bf16* dout, const bf16* shared_out,
                                              const float* logit, int64_t N, int64_t C) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  if (n >= N) return;
  const float s = sigmoid(logit[n]);
  float dot = 0.0f;
  if constexpr (kVector) {
    for (int64_t c = int64_t{lane} * kBf16PerPack; c < C; c += kWarpSize * kBf16PerPack) {
      float d[kBf16PerPack], y[kBf16PerPack], ds[kBf16PerPack];
      load_bf16x8(dout + n * C + c, d);
      load_bf16x8(shared_out + n * C + c, y);
#pragma unroll
      for (int k = 0; k < kBf16PerPack; ++k) {
        dot += d[k] * y[k];
        ds[k] = s * d[k];
      }
      store_bf16x8(dshared + n * C + c, ds);
    }
  } else {
    for (int64_t c = lane; c < C; c += kWarpSize) {
      const float d = to_float(dout[n * C + c]);
      dot += d * to_float(shared_out[n * C + c]);
      dshared[n * C + c] = to_bf16(s * d);
    }
  }
  dot = warp_sum(dot);
  if (lane == 0) dlogit[n] = dot * s * (1.0f - s);
}

}  // namespace

// ---- kernel launchers -------------------------------------------------------------------------

void f32_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t stream) {
  CHECK(n >= 0);
  if (n == 0) return;
  if (aligned16(out) && aligned16(in)) {
    f32_to_bf16_kernel<true><<<blocks_for(n, true), kThreads, 0, stream>>>(out, in, n);
  } else {
    f32_to_bf16_kernel<false><<<blocks_for(n, false), kThreads, 0, stream>>>(out, in, n);
  }
  CUDA_CHECK_LAUNCH();
}

void add_inplace(bf16* a, const bf16* b, int64_t n, cudaStream_t stream) {
  CHECK(n >= 0);
  if (n == 0) return;
  if (aligned16(a) && aligned16(b)) {
    add_inplace_kernel<true><<<blocks_for(n, true), kThreads, 0, stream>>>(a, b, n);
  } else {
    add_inplace_kernel<false><<<blocks_for(n, false), kThreads, 0, stream>>>(a, b, n);
  }
  CUDA_CHECK_LAUNCH();
}

void shared_expert_combine(bf16* out, const bf16* shared_out, const float* logit, int64_t N, int64_t C,
                           cudaStream_t stream) {
  CHECK(N >= 0 && C > 0);
  if (N == 0) return;
  if (C % kBf16PerPack == 0 && aligned16(out) && aligned16(shared_out)) {
    shared_expert_combine_kernel<true><<<blocks_for(N * C, true), kThreads, 0, stream>>>(out, shared_out, logit, N, C);
  } else {
    shared_expert_combine_kernel<false>
        <<<blocks_for(N * C, false), kThreads, 0, stream>>>(out, shared_out, logit, N, C);
  }
  CUDA_CHECK_LAUNCH();
}

void shared_expert_backward(bf16* dshared, float* dlogit, const bf16* dout, const bf16* shared_out, const float* logit,
                            int64_t N, int64_t C, cudaStream_t stream) {
  CHECK(N >= 0 && C > 0);
  if (N == 0) return;
  const int warps = kThreads / kWarpSize;
  const unsigned blocks = static_cast<unsigned>(ceil_div(N, warps));
  if (C % kBf16PerPack == 0 && aligned16(dshared) && aligned16(dout) && aligned16(shared_out)) {
    shared_expert_backward_kernel<true>
        <<<blocks, kThreads, 0, stream>>>(dshared, dlogit, dout, shared_out, logit, N, C);
  } else {
    shared_expert_backward_kernel<false>
        <<<blocks, kThreads, 0, stream>>>(dshared, dlogit, dout, shared_out, logit, N, C);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
