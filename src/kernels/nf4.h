// NF4: QLoRA's 4-bit NormalFloat with double-quantised block scales (Dettmers et al. 2023, as
// bitsandbytes implements it), the format of a frozen base that `lora.base: nf4` streams. The
// CPU functions here are the reference a CUDA dequantising kernel is tested against.
//
// Elements are quantised in blocks of kNf4Block = 64 consecutive elements (row-major, flattened;
// the last block may be shorter). A block's absmax a = max |x| scales it: each element becomes
// the index of the NF4 value nearest x * (1 / a) (the 16 values below, the quantiles of a
// standard normal scaled to [-1, 1], with an exact zero), two indices per byte, the first element
// in the high nibble. Between two values the threshold is bitsandbytes' (its decision tree's
// published midpoints, read as fp32), and x at a threshold goes to the lower value (the tree
// compares x > threshold). An all-zero block stores index 7 (zero) everywhere.
//
// Double quantisation: the absmax values (fp32, one per block) are stored as 8-bit codes. Their
// mean m is subtracted, and the differences are quantised in blocks of kNf4ScaleBlock = 256
// blocks with bitsandbytes' signed dynamic map (create_dynamic_map(signed=True): 0, 1 and the
// means of consecutive points of linspace(0.1, 1, 2^i + 1) scaled by 10^(i-6), i = 0..6, with
// both signs; 256 values in [-0.99297, 1]) around their own fp32 absmax s: code = the map entry
// nearest (a - m) * (1 / s), ties to the lower. Decoding: a' = map[code] * s + m, then
// x' = nf4[index] * a'. The map is computed here in double and rounded to fp32 (torch builds
// it in fp32, so an entry may differ from bitsandbytes' by an ulp; strata's NF4 tensors are its
// own, loaded from bf16 or fp8 weights, so only the format's definition matters).
//
// Bytes per element: 1/2 for the indices, 1/64 for the absmax codes, 4/(64 * 256) for their
// scales, plus 4 for the mean per tensor: 4.127 bits, against 16 for bf16.
//
// Error: |x - x'| <= a * (1 - 0.69619) / 2 (half the widest gap between NF4 values) plus
// |nf4[index]| * |a - a'|, and |a - a'| <= s * 0.0140625 / 2 (half the widest gap of the map),
// each up to fp32 rounding. Inputs must be finite (the loader checks weights before quantising).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

#include "kernels/micro_batch_shape.h"

namespace strata::kernels {

inline constexpr int64_t kNf4Block = 64;        // elements per absmax
inline constexpr int64_t kNf4ScaleBlock = 256;  // absmax values per fp32 scale

// The NF4 values, ascending (index 7 is zero, 15 is one).
const std::array<float, 16>& nf4_values();
// The index of the NF4 value nearest `normalized` (ties to the lower value).
uint8_t nf4_index(float normalized);

// bitsandbytes' signed 8-bit dynamic map, ascending (entry 127 is zero, 255 is one).
const std::array<float, 256>& nf4_scale_map();
// The index of the map entry nearest `normalized` (ties to the lower entry).
uint8_t nf4_scale_index(float normalized);

// Where the parts of an n-element NF4 tensor lie in its one byte buffer: the packed indices,
// the absmax codes, the scales (fp32, 4-byte aligned) and the mean (fp32).
struct Nf4Layout {
  int64_t elements = 0;
  int64_t blocks = 0;        // ceil(n / 64)
  int64_t scale_blocks = 0;  // ceil(blocks / 256)
  uint64_t indices_offset = 0, codes_offset = 0, scales_offset = 0, mean_offset = 0;
  uint64_t bytes = 0;  // the whole buffer
};
Nf4Layout nf4_layout(int64_t n);

// The bf16 buffer an op set that dequantises each weight before its GEMM (CUDA's) needs: the
// largest linear weight of a micro-batch of `shape`'s model, C x max(F, 2C) (an MTP module's
// projection is C x 2C).
inline uint64_t nf4_dequantized_weight_bytes(const MicroBatchShape& shape) {
  return static_cast<uint64_t>(shape.C) * static_cast<uint64_t>(std::max(shape.F, 2 * shape.C)) * 2;
}

// Quantises n finite elements into `out` (nf4_layout(n).bytes bytes).
void nf4_quantize(const float* x, int64_t n, uint8_t* out);
// Decodes the n elements of `q` (what nf4_quantize wrote).
void nf4_dequantize(const uint8_t* q, int64_t n, float* x);
// The decoded absmax of block b of `q` (a' above).
float nf4_block_absmax(const uint8_t* q, int64_t n, int64_t b);

}  // namespace strata::kernels
