// E4M3 block quantisers (kernels/cuda/fp8.h). Bitwise the numerics of kernels/fp8.h:
//   - the block scale is the smallest 2^k with amax / 2^k <= 448, found from amax's exponent and
//     mantissa bits (no log2, no division), clamped to [2^-126, 2^127], 1 for a block with no
//     non-zero finite element;
//   - x / 2^k is computed as x * 2^-k: both are the one correctly rounded value of the same real
//     number, so the multiplication equals the reference's division bit for bit (.cu files are
//     built without fast math, so nothing is flushed to zero);
//   - the conversion is the hardware's cvt.rn.satfinite (__nv_cvt_float_to_fp8 with
//     __NV_SATFINITE), with NaN mapped to 0x7F / 0xFF by sign explicitly, as the spec asks.
// The amax of a block is a max, which is exact and order-independent, so the reduction order
// does not matter; it is fixed anyway (shuffles, then shared memory in warp order).
#include <cuda_fp8.h>

#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8.h"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBlock = static_cast<int>(kFp8Block);  // 128

// ---- numerics --------------------------------------------------------------------------------

// The exponent k of the block scale for a block whose largest finite |x| is amax (>= 0).
// 448 = 1.75 * 2^8: for a normal amax = m * 2^e (m in [1, 2)), amax <= 448 * 2^k holds for
// k >= e - 8 when m <= 1.75 and for k >= e - 7 when m > 1.75 (mantissa bits above 0x600000).
// A subnormal amax needs k < -126, so it is clamped like any other small one.
__device__ __forceinline__ int e4m3_scale_exponent(float amax) {
  const uint32_t bits = __float_as_uint(amax);
  const int biased = static_cast<int>(bits >> 23);
  if (biased == 0) return -126;  // zero and subnormals (the all-zero case is handled by the caller)
  const int e = biased - 127;
  const int k = e - 8 + ((bits & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  return k < -126 ? -126 : (k > 127 ? 127 : k);
}

// 2^k as a float for k in [-127, 127] (2^-127 is the subnormal 0x00400000), exactly.
__device__ __forceinline__ float pow2(int k) {
  return k >= -126 ? __uint_as_float(static_cast<uint32_t>(k + 127) << 23) : __uint_as_float(0x00400000u);
}

struct BlockScale {
  float scale;    // stored: x ~ q * scale
  float inverse;  // applied: q = fp8(x * inverse), exact
};

__device__ __forceinline__ BlockScale e4m3_block_scale(float amax) {
  if (!(amax > 0.0f)) return {1.0f, 1.0f};
  const int k = e4m3_scale_exponent(amax);
  return {pow2(k), pow2(-k)};
}

// |x| if finite, else 0 (non-finite elements do not take part in the amax).
__device__ __forceinline__ float finite_abs(float x) { return isfinite(x) ? fabsf(x) : 0.0f; }

__device__ __forceinline__ uint8_t to_e4m3(float x, float inverse) {
  if (isnan(x)) return signbit(x) ? 0xFF : 0x7F;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x * inverse, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const bf16* p) { return __bfloat162float(*p); }

// Four consecutive elements starting at p (16 bytes for fp32, 8 for bf16). REQUIRES p aligned to
// that size.
__device__ __forceinline__ void load4(const float* p, float v[4]) {
  const float4 q = *reinterpret_cast<const float4*>(p);
  v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
}
__device__ __forceinline__ void load4(const bf16* p, float v[4]) {
  const uint2 q = *reinterpret_cast<const uint2*>(p);
  const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&q.x);
  const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&q.y);
  v[0] = __low2float(lo), v[1] = __high2float(lo), v[2] = __low2float(hi), v[3] = __high2float(hi);
}

__device__ __forceinline__ uint32_t pack4(const uint8_t q[4]) {
  return uint32_t{q[0]} | (uint32_t{q[1]} << 8) | (uint32_t{q[2]} << 16) | (uint32_t{q[3]} << 24);
}

// Max over the block; every thread gets it. `shared` holds one value per warp.
__device__ float block_max(float v, float* shared) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : 0.0f;
  return warp_max(v);
}

// ---- kernels ------------------------------------------------------------------------------------

// 1 x 128 tiles along rows: one warp per tile, four consecutive elements per lane. `vec`: the
// row length is a multiple of 4 and the pointers are aligned, so whole groups of four load and
// store as one access. grid: ceil(rows * L / warps per block).
template <typename T>
__global__ void quantize_rows_kernel(uint8_t* codes, float* scales, const T* x, int64_t rows, int64_t cols, int64_t L,
                                     bool vec) {
  const int64_t tile = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / kWarpSize;
  if (tile >= rows * L) return;  // whole warps leave together: tiles are per warp
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = tile / L, kb = tile % L;
  const int64_t c0 = kb * kBlock + lane * 4;
  const T* src = x + row * cols + c0;
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const bool whole = c0 + 4 <= cols;
  if (vec && whole) {
    load4(src, v);
  } else {
    for (int i = 0; i < 4; ++i) {
      if (c0 + i < cols) v[i] = load(src + i);
    }
  }
  float amax = fmaxf(fmaxf(finite_abs(v[0]), finite_abs(v[1])), fmaxf(finite_abs(v[2]), finite_abs(v[3])));
  amax = warp_max(amax);
  const BlockScale s = e4m3_block_scale(amax);
  uint8_t q[4];
  for (int i = 0; i < 4; ++i) q[i] = to_e4m3(v[i], s.inverse);
  uint8_t* dst = codes + row * cols + c0;
  if (vec && whole) {
    *reinterpret_cast<uint32_t*>(dst) = pack4(q);
  } else {
    for (int i = 0; i < 4; ++i) {
      if (c0 + i < cols) dst[i] = q[i];
    }
  }
  if (lane == 0) scales[row * L + kb] = s.scale;
}

// 128 x 1 tiles down columns. Block (32, 8) threads covers a 128-row strip of 32 * V columns:
// thread (tx, ty) owns columns [c0, c0 + V) with c0 = (blockIdx.x * 32 + tx) * V and rows
// [ty * 16, ty * 16 + 16) of the strip; each column's amax is reduced over ty in shared memory.
// V = 4 when cols is a multiple of 4 (vector loads and stores), else 1.
// Transposed: codes (cols, ld) and scales (cols, fp8_blocks(rows)) row-major, column c's rows
// [0, ld) written as one contiguous run (rows [rows, ld) as zero codes), so that the tokens
// become the GEMM's contiguous K; ld is a multiple of 16, so each thread's 16 rows of a column
// are one aligned 16-byte store. Otherwise codes (rows, cols), scales (fp8_blocks(rows), cols).
// grid: (ceil(cols / (32 * V)), fp8_blocks(rows)).
template <typename T, int V, bool Transposed>
__global__ void quantize_cols_kernel(uint8_t* codes, float* scales, const T* x, int64_t rows, int64_t cols,
                                     int64_t ld) {
  constexpr int kRowsPerThread = kBlock / 8;
  __shared__ float partial[8][kWarpSize * V];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c0 = (blockIdx.x * int64_t{kWarpSize} + tx) * V;
  const int64_t r0 = blockIdx.y * int64_t{kBlock} + ty * kRowsPerThread;
  float v[kRowsPerThread][V];
  float amax[V];
  for (int j = 0; j < V; ++j) amax[j] = 0.0f;
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t r = r0 + i;
    for (int j = 0; j < V; ++j) v[i][j] = 0.0f;
    if (r >= rows || c0 >= cols) continue;
    const T* src = x + r * cols + c0;
    if constexpr (V == 4) {
      load4(src, v[i]);  // cols % 4 == 0, so all four columns exist
    } else {
      v[i][0] = load(src);
    }
    for (int j = 0; j < V; ++j) amax[j] = fmaxf(amax[j], finite_abs(v[i][j]));
  }
  for (int j = 0; j < V; ++j) partial[ty][tx * V + j] = amax[j];
  __syncthreads();
  BlockScale s[V];
  for (int j = 0; j < V; ++j) {
    float m = 0.0f;
    for (int y = 0; y < 8; ++y) m = fmaxf(m, partial[y][tx * V + j]);
    s[j] = e4m3_block_scale(m);
  }
  if (c0 >= cols) return;
  if constexpr (Transposed) {
    // Rows past `rows` hold zeros in v, so they become the zero codes of the padding.
    if (r0 >= ld) return;
    const int64_t L = gridDim.y;
    for (int j = 0; j < V; ++j) {
      uint8_t q[kRowsPerThread];
      for (int i = 0; i < kRowsPerThread; ++i) q[i] = to_e4m3(v[i][j], s[j].inverse);
      uint4 packed;
      packed.x = pack4(q), packed.y = pack4(q + 4), packed.z = pack4(q + 8), packed.w = pack4(q + 12);
      *reinterpret_cast<uint4*>(codes + (c0 + j) * ld + r0) = packed;
      if (ty == 0) scales[(c0 + j) * L + blockIdx.y] = s[j].scale;
    }
  } else {
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t r = r0 + i;
      if (r >= rows) break;
      uint8_t q[V];
      for (int j = 0; j < V; ++j) q[j] = to_e4m3(v[i][j], s[j].inverse);
      uint8_t* dst = codes + r * cols + c0;
      if constexpr (V == 4) {
        *reinterpret_cast<uint32_t*>(dst) = pack4(q);
      } else {
        dst[0] = q[0];
      }
    }
    if (ty == 0) {
      for (int j = 0; j < V; ++j) scales[blockIdx.y * cols + c0 + j] = s[j].scale;
    }
  }
}

// A stored weight (rows, cols) -> the stored form of its transpose (cols, rows): codes through
// a 32 x 32 tile in shared memory, then the block scales (one thread each). The codes do not
// change: a 128 x 128 block of W is a 128 x 128 block of W^T with the same scale.
// grid: (ceil(cols / 32), ceil(rows / 32)), block (32, 8).
__global__ void transpose_weight_kernel(uint8_t* out, const uint8_t* in, int64_t rows, int64_t cols,
                                        int64_t row_blocks, int64_t col_blocks, int64_t in_scale_offset,
                                        int64_t out_scale_offset) {
  __shared__ uint8_t tile[32][33];
  const int64_t c = blockIdx.x * int64_t{32} + threadIdx.x;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t r = blockIdx.y * int64_t{32} + i;
    if (r < rows && c < cols) tile[i][threadIdx.x] = in[r * cols + c];
  }
  __syncthreads();
  const int64_t r = blockIdx.y * int64_t{32} + threadIdx.x;  // a column of out
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t oc = blockIdx.x * int64_t{32} + i;  // a row of out
    if (oc < cols && r < rows) out[oc * rows + r] = tile[threadIdx.x][i];
  }
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    const auto* in_scales = reinterpret_cast<const float*>(in + in_scale_offset);
    auto* out_scales = reinterpret_cast<float*>(out + out_scale_offset);
    const int t = threadIdx.y * 32 + threadIdx.x;
    for (int64_t b = t; b < row_blocks * col_blocks; b += 256) {
      const int64_t rb = b / col_blocks, cb = b % col_blocks;
      out_scales[cb * row_blocks + rb] = in_scales[b];
    }
    const int64_t end = rows * cols;
    if (t < out_scale_offset - end) out[end + t] = 0;  // the zero padding before the scales
  }
}

// 128 x 128 weight blocks: one thread block of 256 per block. Thread t owns columns
// [4 * (t % 32), +4) and rows t / 32 + 8 i (i < 16) of the block, held in registers between the
// amax and the conversion. `vec`: cols % 4 == 0 (aligned vector loads and 4-byte code stores).
// scale_offset: fp8_matrix_scale_offset(rows, cols). grid: (fp8_blocks(cols), fp8_blocks(rows)).
__global__ void quantize_weight_kernel(uint8_t* out, const float* w, int64_t rows, int64_t cols, int64_t scale_offset,
                                       bool vec) {
  constexpr int kRowsPerThread = kBlock / (kThreads / kWarpSize);  // 16
  __shared__ float shared[kThreads / kWarpSize];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t c0 = blockIdx.x * int64_t{kBlock} + lane * 4;
  const int64_t rb = blockIdx.y * int64_t{kBlock};
  float v[kRowsPerThread][4];
  float amax = 0.0f;
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t r = rb + warp + i * (kThreads / kWarpSize);
    for (int j = 0; j < 4; ++j) v[i][j] = 0.0f;
    if (r >= rows) continue;
    const float* src = w + r * cols + c0;
    if (vec && c0 + 4 <= cols) {
      load4(src, v[i]);
    } else {
      for (int j = 0; j < 4; ++j) {
        if (c0 + j < cols) v[i][j] = src[j];
      }
    }
    for (int j = 0; j < 4; ++j) amax = fmaxf(amax, finite_abs(v[i][j]));
  }
  amax = block_max(amax, shared);
  const BlockScale s = e4m3_block_scale(amax);
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t r = rb + warp + i * (kThreads / kWarpSize);
    if (r >= rows) break;
    uint8_t q[4];
    for (int j = 0; j < 4; ++j) q[j] = to_e4m3(v[i][j], s.inverse);
    uint8_t* dst = out + r * cols + c0;
    if (vec && c0 + 4 <= cols) {
      *reinterpret_cast<uint32_t*>(dst) = pack4(q);
    } else {
      for (int j = 0; j < 4; ++j) {
        if (c0 + j < cols) dst[j] = q[j];
      }
    }
  }
  const int64_t col_blocks = gridDim.x;
  auto* block_scales = reinterpret_cast<float*>(out + scale_offset);
  if (threadIdx.x == 0) block_scales[blockIdx.y * col_blocks + blockIdx.x] = s.scale;
  // The zero padding between the codes and the scales (under 16 bytes), written once.
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    const int64_t end = rows * cols;
    const int64_t pad = scale_offset - end;
    if (threadIdx.x < pad) out[end + threadIdx.x] = 0;
  }
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename T>
void launch_rows(uint8_t* codes, float* scales, const T* x, int64_t rows, int64_t cols, cudaStream_t stream) {
  CHECK(rows >= 0 && cols >= 0);
  if (rows == 0 || cols == 0) return;
  const int64_t L = fp8_blocks(cols);
  const bool vec = cols % 4 == 0 && aligned(x, 4 * sizeof(T)) && aligned(codes, 4);
  const int64_t warps = rows * L;
  const int64_t blocks = ceil_div(warps, kThreads / kWarpSize);
  CHECK_MSG(blocks < (int64_t{1} << 31), "quantize_rows_e4m3: too many tiles");
  quantize_rows_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(codes, scales, x, rows, cols, L, vec);
  CUDA_CHECK_LAUNCH();
}

// ld: the transposed output's row stride (0: not transposed).
template <typename T, bool Transposed>
void launch_cols(uint8_t* codes, float* scales, const T* x, int64_t rows, int64_t cols, int64_t ld,
                 cudaStream_t stream) {
  CHECK(rows >= 0 && cols >= 0);
  if (rows == 0 || cols == 0) return;
  const dim3 block(kWarpSize, 8);
  const unsigned row_blocks = static_cast<unsigned>(fp8_blocks(rows));
  CHECK_MSG(fp8_blocks(rows) < 65536, "quantize_cols_e4m3: more than 65535 row blocks");
  if (cols % 4 == 0 && aligned(x, 4 * sizeof(T)) && (Transposed || aligned(codes, 4))) {
    const dim3 grid(static_cast<unsigned>(ceil_div(cols, kWarpSize * 4)), row_blocks);
    quantize_cols_kernel<T, 4, Transposed><<<grid, block, 0, stream>>>(codes, scales, x, rows, cols, ld);
  } else {
    const dim3 grid(static_cast<unsigned>(ceil_div(cols, kWarpSize)), row_blocks);
    quantize_cols_kernel<T, 1, Transposed><<<grid, block, 0, stream>>>(codes, scales, x, rows, cols, ld);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void quantize_weight_e4m3(uint8_t* out, const float* w, int64_t rows, int64_t cols, cudaStream_t stream) {
  CHECK(rows >= 0 && cols >= 0);
  if (rows == 0 || cols == 0) return;
  CHECK_MSG(aligned(out, 16), "quantize_weight_e4m3: the output must be 16-byte aligned");
  CHECK_MSG(fp8_blocks(rows) < 65536, "quantize_weight_e4m3: more than 65535 row blocks");
  const bool vec = cols % 4 == 0 && aligned(w, 16);
  const dim3 grid(static_cast<unsigned>(fp8_blocks(cols)), static_cast<unsigned>(fp8_blocks(rows)));
  const auto scale_offset = static_cast<int64_t>(fp8_matrix_scale_offset(rows, cols));
  quantize_weight_kernel<<<grid, kThreads, 0, stream>>>(out, w, rows, cols, scale_offset, vec);
  CUDA_CHECK_LAUNCH();
}

void quantize_rows_e4m3(uint8_t* codes, float* scales, const bf16* x, int64_t rows, int64_t cols, cudaStream_t stream) {
  launch_rows(codes, scales, x, rows, cols, stream);
}
void quantize_rows_e4m3(uint8_t* codes, float* scales, const float* x, int64_t rows, int64_t cols,
                        cudaStream_t stream) {
  launch_rows(codes, scales, x, rows, cols, stream);
}
void quantize_cols_e4m3(uint8_t* codes, float* scales, const bf16* x, int64_t rows, int64_t cols, cudaStream_t stream) {
  launch_cols<bf16, false>(codes, scales, x, rows, cols, 0, stream);
}
void quantize_cols_e4m3(uint8_t* codes, float* scales, const float* x, int64_t rows, int64_t cols,
                        cudaStream_t stream) {
  launch_cols<float, false>(codes, scales, x, rows, cols, 0, stream);
}

void quantize_cols_transposed_e4m3(uint8_t* codes, float* scales, const bf16* x, int64_t rows, int64_t cols,
                                   int64_t ld, cudaStream_t stream) {
  CHECK_MSG(ld % 16 == 0 && ld >= rows && fp8_blocks(ld) == fp8_blocks(rows),
            "quantize_cols_transposed_e4m3: ld must be rows rounded up to a multiple of 16; rows " +
                std::to_string(rows) + ", ld " + std::to_string(ld));
  CHECK_MSG(aligned(codes, 16), "quantize_cols_transposed_e4m3: codes must be 16-byte aligned");
  launch_cols<bf16, true>(codes, scales, x, rows, cols, ld, stream);
}

void transpose_weight_e4m3(uint8_t* out, const uint8_t* in, int64_t rows, int64_t cols, cudaStream_t stream) {
  CHECK(rows >= 0 && cols >= 0);
  if (rows == 0 || cols == 0) return;
  CHECK_MSG(aligned(out, 16) && aligned(in, 16), "transpose_weight_e4m3: both matrices must be 16-byte aligned");
  CHECK_MSG(ceil_div(rows, 32) < 65536, "transpose_weight_e4m3: more than 65535 row tiles");
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, 32)), static_cast<unsigned>(ceil_div(rows, 32)));
  transpose_weight_kernel<<<grid, dim3(32, 8), 0, stream>>>(
      out, in, rows, cols, fp8_blocks(rows), fp8_blocks(cols), static_cast<int64_t>(fp8_matrix_scale_offset(rows, cols)),
      static_cast<int64_t>(fp8_matrix_scale_offset(cols, rows)));
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
