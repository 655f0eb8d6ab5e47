// NF4 dequantisation into bf16 (kernels/cuda/nf4.h). One thread per byte of indices (two
// elements, always of the same 64-element block). The tables travel as a kernel argument, in
// the constant bank, so no device needs them initialised first; the 16 NF4 values are copied
// into shared memory, where threads of a warp read different entries without serialising.
// __fmul_rn / __fadd_rn keep each product and sum a separate fp32 rounding, as the CPU
// reference computes them (nvcc would otherwise fuse them into FMAs).
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/nf4.h"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;

struct Nf4Tables {
  float scale_map[256];
  float values[16];
};

__global__ void nf4_dequantize_kernel(bf16* out, const uint8_t* q, int64_t n, Nf4Layout l, Nf4Tables tables) {
  __shared__ float values[16];
  if (threadIdx.x < 16) values[threadIdx.x] = tables.values[threadIdx.x];
  __syncthreads();
  const float mean = *reinterpret_cast<const float*>(q + l.mean_offset);
  const float* scales = reinterpret_cast<const float*>(q + l.scales_offset);
  const int64_t bytes = (n + 1) / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t byte = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; byte < bytes; byte += stride) {
    const int64_t i = 2 * byte;
    const int64_t b = i / kNf4Block;
    const float a = __fadd_rn(__fmul_rn(tables.scale_map[q[l.codes_offset + b]], scales[b / kNf4ScaleBlock]), mean);
    const uint8_t v = q[l.indices_offset + byte];
    out[i] = __float2bfloat16_rn(__fmul_rn(values[v >> 4], a));
    if (i + 1 < n) out[i + 1] = __float2bfloat16_rn(__fmul_rn(values[v & 0x0F], a));
  }
}

}  // namespace

void nf4_dequantize_bf16(bf16* out, const uint8_t* q, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  Nf4Tables tables;
  std::copy(nf4_scale_map().begin(), nf4_scale_map().end(), tables.scale_map);
  std::copy(nf4_values().begin(), nf4_values().end(), tables.values);
  const int64_t bytes = (n + 1) / 2;
  const int64_t blocks = std::min<int64_t>((bytes + kThreads - 1) / kThreads, 65535);
  nf4_dequantize_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(out, q, n, nf4_layout(n), tables);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
