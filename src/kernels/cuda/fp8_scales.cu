// Scale layouts for cuBLASLt's FP8 block-scaling modes (kernels/cuda/fp8.h).
//
// kernels/fp8.h keeps scales row-major with the K block index innermost: (rows, L) for 1 x 128
// tiles, (row blocks, L) for 128 x 128 blocks (L = fp8_blocks(K)). cuBLASLt reads, for an
// operand stored as rows of K contiguous elements (the cuBLAS documentation's "Scaling factors
// layouts", as PyTorch's scaled_mm states and checks them for its 1x128 / 128x128 modes; the
// 4-block padding was added there after silent wrong results with fp8_blocks(K) % 4 != 0):
//   VEC128_32F     the K block index OUTERMOST: scale (row r, block kb) at kb * rows + r, so the
//                  scales of one K block for consecutive rows are contiguous (a kernel loads
//                  one K block's scales for its whole tile of rows at once). A transpose.
//   BLK128x128_32F the K block index innermost as in kernels/fp8.h, but each row of blocks
//                  padded to L4 = L rounded up to a multiple of 4 (16 bytes): scale (rb, kb) at
//                  rb * L4 + kb. When L % 4 == 0 the stored layout IS this one.
// Both kernels are tiny next to the GEMM (one float per 128 or 16384 elements).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8.h"

namespace strata::kernels::cuda {
namespace {

constexpr int kTile = 32;

// out (L, outer) = in (outer, L)^T through a 32 x 33 shared tile (coalesced both ways).
// block (32, 8); grid (ceil(L / 32), ceil(outer / 32)).
__global__ void transpose_kernel(float* out, const float* in, int64_t outer, int64_t L) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t kb0 = blockIdx.x * int64_t{kTile}, r0 = blockIdx.y * int64_t{kTile};
  for (int i = threadIdx.y; i < kTile; i += blockDim.y) {
    const int64_t r = r0 + i, kb = kb0 + threadIdx.x;
    if (r < outer && kb < L) tile[i][threadIdx.x] = in[r * L + kb];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTile; i += blockDim.y) {
    const int64_t kb = kb0 + i, r = r0 + threadIdx.x;
    if (r < outer && kb < L) out[kb * outer + r] = tile[threadIdx.x][i];
  }
}

// out (blocks, L4) from in (blocks, L); pad columns zero. Grid-stride over out.
__global__ void pad_rows_kernel(float* out, const float* in, int64_t blocks, int64_t L, int64_t L4) {
  const int64_t n = blocks * L4;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t rb = i / L4, kb = i % L4;
    out[i] = kb < L ? in[rb * L + kb] : 0.0f;
  }
}

}  // namespace

void fp8_tile_scales_k_major(float* out, const float* in, int64_t outer, int64_t L, cudaStream_t stream) {
  CHECK(outer >= 0 && L >= 0);
  if (outer == 0 || L == 0) return;
  CHECK_MSG(ceil_div(outer, kTile) < 65536, "fp8_tile_scales_k_major: too many rows");
  const dim3 grid(static_cast<unsigned>(ceil_div(L, kTile)), static_cast<unsigned>(ceil_div(outer, kTile)));
  transpose_kernel<<<grid, dim3(kTile, 8), 0, stream>>>(out, in, outer, L);
  CUDA_CHECK_LAUNCH();
}

void fp8_block_scales_padded(float* out, const float* in, int64_t outer_blocks, int64_t L, cudaStream_t stream) {
  CHECK(outer_blocks >= 0 && L >= 0);
  if (outer_blocks == 0 || L == 0) return;
  const int64_t L4 = (L + 3) / 4 * 4;
  constexpr int kThreads = 256;
  pad_rows_kernel<<<elementwise_blocks(outer_blocks * L4, kThreads), kThreads, 0, stream>>>(out, in, outer_blocks, L,
                                                                                            L4);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
