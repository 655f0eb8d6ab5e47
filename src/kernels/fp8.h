// FP8 numerics of the fp8 recipe (DeepSeek-V3's): the OCP 8-bit floating-point formats, block
// quantisation with fp32 scales, and a GEMM over quantised operands that promotes its partial
// sums to fp32 every kFp8BlockK elements of K. The CPU functions here are the reference the
// CUDA kernels (kernels/cuda/fp8.h) are tested against.
//
// Formats (OCP 8-bit Floating Point Specification, OFP8, rev 1.0):
//   E4M3: bias 7, largest finite 448, no infinities, NaN = S.1111.111 (0x7F / 0xFF),
//         smallest subnormal 2^-9.
//   E5M2: bias 15, largest finite 57344, infinities S.11111.00, NaNs S.11111.{01,10,11},
//         smallest subnormal 2^-16.
// Conversion from fp32 rounds to nearest, ties to even, and saturates ("satfinite", as the CUDA
// intrinsics __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...) and PTX cvt.rn.satfinite do): a
// finite value beyond the largest finite, and an infinity, become the largest finite of the same
// sign; NaN becomes the canonical NaN of its sign: 0x7F / 0xFF in both formats (for E5M2 that
// is S.11111.11, what PyTorch's scalar float -> float8_e5m2 conversion gives). CUDA's software
// conversion (cuda_fp8.hpp) gives 0x7F for every NaN, dropping the sign, so GPU tests compare
// NaNs as NaNs, not by code. Values below half the smallest subnormal, and exactly half of it
// (the tie goes to the even zero), become a zero of the same sign; fp32 subnormals all do.
// Decoding is exact; a NaN code decodes to a quiet fp32 NaN of the code's sign, and E5M2's
// infinity codes (0x7C / 0xFC) to infinities.
//
// Block scales: a block's scale is the smallest power of two s with amax / s <= the format's
// largest finite (amax: the largest |x| over the block's finite elements), clamped to
// [2^-126, 2^127]; an all-zero (or all-non-finite) block has s = 1. q = fp8(x / s) and x ~ q * s.
// Powers of two make the division and the dequantisation exact (x / s rounds in fp32 only
// where it falls below 2^-126, which is a zero code either way), so the fp8 rounding is the
// only loss, and the CPU and GPU agree bit for bit (as DeepSeek-V3.1's UE8M0 scales and the MX
// formats do); x / s may be computed as x * (1 / s), the same correctly rounded number.
// Since amax / s <= max exactly and rounding never passes a representable max, no finite
// element saturates; the block's largest element lands in (max / 2, max] (unless the lower
// clamp applies: then below). For a finite amax the scale is at most 2^120 (E4M3) or 2^113
// (E5M2), so q * s never overflows. Within an E4M3 block, elements of magnitude up to
// 2^-10 * s become signed zeros and those below 2^-6 * s (the subnormal codes) keep fewer than
// 4 significant bits. Non-finite elements do not count towards amax: an infinity saturates to
// +-max * s, a NaN stays NaN (its code).
//
// Block shapes (DeepSeek-V3): activations in 1 x 128 tiles along the GEMM's K dimension (one
// scale per row and 128 columns), weights in 128 x 128 blocks. Edges that are not multiples of
// 128 make shorter tiles and blocks; nothing is padded in memory.
#pragma once

#include <cstdint>

namespace strata::kernels {

enum class Fp8Format : uint8_t { kE4M3, kE5M2 };

inline constexpr int64_t kFp8Block = 128;   // tile length and block edge
inline constexpr int64_t kFp8BlockK = 128;  // promotion interval of the GEMM's K

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;

uint8_t f32_to_e4m3(float x);
float e4m3_to_f32(uint8_t code);
uint8_t f32_to_e5m2(float x);
float e5m2_to_f32(uint8_t code);
uint8_t f32_to_fp8(float x, Fp8Format format);
float fp8_to_f32(uint8_t code, Fp8Format format);

// The block scale for a block whose largest finite |x| is amax (see above).
float fp8_block_scale(float amax, Fp8Format format = Fp8Format::kE4M3);

// Number of 128-blocks along a dimension of n elements.
inline int64_t fp8_blocks(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

// A quantised weight matrix (rows, cols) as it is stored in one compute-copy tensor of the fp8
// recipe: rows * cols E4M3 codes (row-major), zero padding to a multiple of 16 bytes, then
// fp8_blocks(rows) x fp8_blocks(cols) fp32 scales (row-major over blocks).
inline uint64_t fp8_matrix_scale_offset(int64_t rows, int64_t cols) {
  return (static_cast<uint64_t>(rows * cols) + 15) / 16 * 16;
}
inline uint64_t fp8_matrix_bytes(int64_t rows, int64_t cols) {
  return fp8_matrix_scale_offset(rows, cols) + static_cast<uint64_t>(fp8_blocks(rows) * fp8_blocks(cols)) * 4;
}

namespace cpu {

// w (rows, cols) fp32 -> the stored form above at `out` (fp8_matrix_bytes(rows, cols) bytes),
// 128 x 128 blocks, E4M3.
void quantize_weight_e4m3(uint8_t* out, const float* w, int64_t rows, int64_t cols);
// The stored form back to fp32 (q * s, exact).
void dequantize_weight_e4m3(float* w, const uint8_t* in, int64_t rows, int64_t cols);

// x (rows, cols) fp32 -> codes (rows, cols) and scales (rows, fp8_blocks(cols)): 1 x 128 tiles
// along each row (the activation operand whose K runs along its rows).
void quantize_rows_e4m3(uint8_t* codes, float* scales, const float* x, int64_t rows, int64_t cols);
// The same with 128 x 1 tiles down each column: scales (fp8_blocks(rows), cols). The operands of
// the weight-gradient GEMM, whose K is the token dimension.
void quantize_cols_e4m3(uint8_t* codes, float* scales, const float* x, int64_t rows, int64_t cols);
// Quantise and dequantise in one pass (what the emulated recipe computes from): out may alias x.
void fake_quantize_rows_e4m3(float* out, const float* x, int64_t rows, int64_t cols);
void fake_quantize_cols_e4m3(float* out, const float* x, int64_t rows, int64_t cols);

}  // namespace cpu

namespace ref {

// C (M, N) = A (M, K) @ B (N, K)^T over E4M3 operands with their scales, as the recipe's GEMMs
// compute it: for each K block kb of kFp8BlockK elements, the partial sum of code products
// (exact in fp32) is accumulated in fp32 in order of k from 0, then C += (partial * a_scale) *
// b_scale in fp32, C starting from 0 and taking the K blocks in order. With power-of-two scales
// the two multiplications are exact (short of fp32 overflow or underflow), so the roundings are
// the additions' alone: |C - exact| <= (127 + fp8_blocks(K)) * 2^-24 * sum_k |a_k b_k| (to first
// order), the bound tests/kernels/fp8_test.cpp checks. a_scales: (M, fp8_blocks(K)) — A in
// 1 x 128 tiles. b_scales: either (fp8_blocks(N), fp8_blocks(K)) when b_blocks (a weight in
// 128 x 128 blocks) or (N, fp8_blocks(K)) (1 x 128 tiles). C is overwritten.
void fp8_gemm_nt(float* C, const uint8_t* A, const float* a_scales, const uint8_t* B, const float* b_scales,
                 bool b_blocks, int64_t M, int64_t N, int64_t K);

}  // namespace ref
}  // namespace strata::kernels
