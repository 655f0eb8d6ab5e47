// Rotary position embedding on CUDA ("rotate_half" pairs i and i + D/2), forward and backward.
// When D/2 is a multiple of 8 and both pointers are 16-byte aligned, a thread rotates 8
// consecutive pairs with 16-byte accesses; otherwise one pair per thread. The per-pair
// arithmetic is the same on both paths.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/vector_access.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// The angle is rounded to fp32 as transformers' freqs are; sincosf is the accurate one (this
// backend is not built with fast math). Rotates (x1, x2) by sign * t * inv_freq and multiplies
// by scale, which transformers applies to cos and sin in fp32 (exact for a scale of 1).
__device__ __forceinline__ void rotate(float& x1, float& x2, int64_t t, float inv_freq, float sign, float scale) {
  const float angle = static_cast<float>(t) * inv_freq;
  float s, c;
  sincosf(angle, &s, &c);
  c *= scale;
  s = sign * (s * scale);
  const float r1 = x1 * c - x2 * s;
  const float r2 = x2 * c + x1 * s;
  x1 = r1;
  x2 = r2;
}

// One thread per (b, t, h) row and group of kWidth pairs (i .. i + kWidth - 1 < D/2). Both
// inputs of a pair are read before either output is written, so out may alias x.
// kWidth == 8 REQUIRES D/2 % 8 == 0 and out, x 16-byte aligned.
template <int kWidth>
__global__ void rope_kernel(bf16* out, const bf16* x, const float* inv_freq, int64_t B, int64_t T, int64_t H, int64_t D,
                            float sign, float scale, int64_t past, const int32_t* positions) {
  const int64_t half = D / 2;
  const int64_t groups = half / kWidth;  // per row
  const int64_t total = B * T * H * groups;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = (idx % groups) * kWidth;
    const int64_t row = idx / groups;  // (b * T + t) * H + h
    // The position: past + t, or the token's position in its document.
    const int64_t t = positions != nullptr ? int64_t{positions[row / H]} : past + (row / H) % T;
    const int64_t base = row * D;
    if constexpr (kWidth == kBf16PerPack) {
      float x1[kBf16PerPack], x2[kBf16PerPack];
      load_bf16x8(x + base + i, x1);
      load_bf16x8(x + base + i + half, x2);
#pragma unroll
      for (int k = 0; k < kBf16PerPack; ++k) rotate(x1[k], x2[k], t, inv_freq[i + k], sign, scale);
      store_bf16x8(out + base + i, x1);
      store_bf16x8(out + base + i + half, x2);
    } else {
      static_assert(kWidth == 1, "rope_kernel: one pair or a pack of 8 per thread");
      float x1 = to_float(x[base + i]), x2 = to_float(x[base + i + half]);
      rotate(x1, x2, t, inv_freq[i], sign, scale);
      out[base + i] = to_bf16(x1);
      out[base + i + half] = to_bf16(x2);
    }
  }
}

void rope(bf16* out, const bf16* x, const float* inv_freq, int64_t B, int64_t T, int64_t H, int64_t D, float sign,
          float scale, int64_t past, const int32_t* positions, cudaStream_t stream) {
  CHECK(B >= 0 && T >= 0 && H >= 0 && D > 0 && past >= 0);
  CHECK_MSG(positions == nullptr || past == 0, "rope: document positions take no cached positions");
  CHECK_MSG(D % 2 == 0, "rope needs an even head dimension, got " + std::to_string(D));
  const int64_t pairs = B * T * H * (D / 2);
  if (pairs == 0) return;
  if ((D / 2) % kBf16PerPack == 0 && aligned16(out) && aligned16(x)) {
    rope_kernel<kBf16PerPack><<<elementwise_blocks(pairs / kBf16PerPack, kThreads), kThreads, 0, stream>>>(
        out, x, inv_freq, B, T, H, D, sign, scale, past, positions);
  } else {
    rope_kernel<1><<<elementwise_blocks(pairs, kThreads), kThreads, 0, stream>>>(out, x, inv_freq, B, T, H, D, sign, scale,
                                                                                      past, positions);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void rope_forward(bf16* out, const bf16* x, const float* inv_freq, int64_t B, int64_t T, int64_t H, int64_t D,
                  float scale, int64_t past, cudaStream_t stream, const int32_t* positions) {
  rope(out, x, inv_freq, B, T, H, D, 1.0f, scale, past, positions, stream);
}

// dx = scale * (rotation by -angle) dout: the transpose of a rotation is its inverse.
void rope_backward(bf16* dx, const bf16* dout, const float* inv_freq, int64_t B, int64_t T, int64_t H, int64_t D,
                   float scale, cudaStream_t stream, const int32_t* positions) {
  rope(dx, dout, inv_freq, B, T, H, D, -1.0f, scale, 0, positions, stream);
}

}  // namespace strata::kernels::cuda
