// Rotary position embedding on CUDA ("rotate_half" pairs i and i + D/2), forward and backward.
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per (b, t, h, i < D/2) pair. Rotates by sign * t * inv_freq[i]. Both inputs of a
// pair are read before either output is written, so out may alias x.
__global__ void rope_kernel(bf16* out, const bf16* x, const float* inv_freq, int64_t B,
                            int64_t T, int64_t H, int64_t D, float sign) {
  const int64_t half = D / 2;
  const int64_t total = B * T * H * half;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = idx % half;
    const int64_t row = idx / half;           // (b * T + t) * H + h
    const int64_t t = (row / H) % T;
    // The angle is rounded to fp32 as transformers' freqs are; sincosf is the accurate one
    // (this backend is not built with fast math).
    const float angle = static_cast<float>(t) * inv_freq[i];
    float s, c;
    sincosf(angle, &s, &c);
    s *= sign;
    const int64_t base = row * D;
    const float x1 = to_float(x[base + i]);
    const float x2 = to_float(x[base + i + half]);
    out[base + i] = to_bf16(x1 * c - x2 * s);
    out[base + i + half] = to_bf16(x2 * c + x1 * s);
  }
}

void rope(bf16* out, const bf16* x, const float* inv_freq, int64_t B, int64_t T, int64_t H,
          int64_t D, float sign, cudaStream_t stream) {
  CHECK(B >= 0 && T >= 0 && H >= 0 && D > 0);
  CHECK_MSG(D % 2 == 0, "rope needs an even head dimension, got " + std::to_string(D));
  const int64_t total = B * T * H * (D / 2);
  if (total == 0) return;
  rope_kernel<<<elementwise_blocks(total, kThreads), kThreads, 0, stream>>>(out, x, inv_freq, B,
                                                                           T, H, D, sign);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void rope_forward(bf16* out, const bf16* x, const float* inv_freq, int64_t B, int64_t T,
                  int64_t H, int64_t D, cudaStream_t stream) {
  rope(out, x, inv_freq, B, T, H, D, 1.0f, stream);
}

// dx = (rotation by -angle) dout: the transpose of a rotation is its inverse.
void rope_backward(bf16* dx, const bf16* dout, const float* inv_freq, int64_t B, int64_t T,
                   int64_t H, int64_t D, cudaStream_t stream) {
  rope(dx, dout, inv_freq, B, T, H, D, -1.0f, stream);
}

}  // namespace strata::kernels::cuda
