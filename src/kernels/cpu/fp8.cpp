// FP8 numerics on the CPU: conversions by integer manipulation of the fp32 bits (so that the
// result never depends on the FPU's rounding mode), power-of-two block scales, block
// quantisation of weights and activations, and the promoting GEMM reference.
#include "kernels/fp8.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

namespace strata::kernels {
namespace {

// The shape of one format: exponent bias, mantissa bits, largest finite code and canonical
// NaN code (both positive; the sign goes in bit 7), and whether the top exponent field holds
// infinities and NaNs as in IEEE 754 (E5M2) or finite values and one NaN (E4M3).
struct Format {
  int bias;
  int mantissa_bits;
  uint32_t max_code;
  uint32_t nan_code;
  float max;
  bool ieee_top_binade;
};

constexpr Format kE4M3{7, 3, 0x7Eu, 0x7Fu, kE4M3Max, false};
constexpr Format kE5M2{15, 2, 0x7Bu, 0x7Fu, kE5M2Max, true};

// Round-to-nearest-even, saturating conversion of fp32 to a format. Inline so that the
// quantisation loops below compile it into their bodies (kE4M3 folds to constants).
inline uint8_t encode(float x, const Format& f) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint8_t>(sign | f.nan_code);
  // Comparing the bits of non-negative floats compares their values. Everything at or beyond
  // the largest finite (infinity included) saturates to it; anything below rounds to at most
  // the largest finite, since the largest finite is representable.
  if (abs >= std::bit_cast<uint32_t>(f.max)) return static_cast<uint8_t>(sign | f.max_code);
  // An fp32 subnormal (or zero) is below 2^-126, far below half the smallest fp8 subnormal.
  if (abs < 0x00800000u) return static_cast<uint8_t>(sign);

  const int exponent = static_cast<int>(abs >> 23) - 127;   // unbiased
  const uint32_t significand = (abs & 0x7FFFFFu) | 0x800000u;  // 24 bits, value * 2^(23 - exponent)
  const int min_exponent = 1 - f.bias;                      // of the normal fp8 numbers
  // Bits of the significand that do not fit: the fp32 mantissa is 23 bits, fp8 keeps
  // mantissa_bits, and below the normal range one bit more per binade of shortfall.
  int shift = 23 - f.mantissa_bits;
  if (exponent < min_exponent) shift += min_exponent - exponent;
  // Beyond 25 dropped bits the value is below half the smallest subnormal: a signed zero
  // (capping keeps the shifts below the width of the integer; the result is the same).
  shift = std::min(shift, 25);
  uint32_t kept = significand >> shift;
  const uint32_t rest = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (kept & 1u))) ++kept;

  uint32_t code;
  if (exponent < min_exponent) {
    // Subnormal: the code is the kept count of smallest subnormals. Rounding up to 2^M lands
    // exactly on the smallest normal's code.
    code = kept;
  } else {
    // Normal: kept holds the implicit bit (2^M <= kept <= 2^(M+1)); adding it to the exponent
    // field one lower places the mantissa and lets a carry out of the mantissa (rounding up to
    // the next binade) increment the exponent.
    code = (static_cast<uint32_t>(exponent + f.bias - 1) << f.mantissa_bits) + kept;
  }
  return static_cast<uint8_t>(sign | code);
}

// Exact decoding from the fields; NaN codes give a quiet NaN of the code's sign.
float decode(uint8_t code, const Format& f) {
  const bool negative = (code & 0x80u) != 0;
  const uint32_t magnitude = code & 0x7Fu;
  const uint32_t mantissa = magnitude & ((1u << f.mantissa_bits) - 1u);
  const int field = static_cast<int>(magnitude >> f.mantissa_bits);
  const int max_field = (1 << (7 - f.mantissa_bits)) - 1;
  float value;
  if (f.ieee_top_binade && field == max_field) {
    value = mantissa == 0 ? INFINITY : NAN;
  } else if (magnitude == f.nan_code) {
    value = NAN;
  } else if (field == 0) {
    value = std::ldexp(static_cast<float>(mantissa), 1 - f.bias - f.mantissa_bits);
  } else {
    // The fp32 with the same exponent and the mantissa in its top bits.
    const uint32_t bits = static_cast<uint32_t>(field - f.bias + 127) << 23 | mantissa << (23 - f.mantissa_bits);
    value = std::bit_cast<float>(bits);
  }
  return negative ? -value : value;
}

std::array<float, 256> decode_table(const Format& f) {
  std::array<float, 256> table{};
  for (int c = 0; c < 256; ++c) table[c] = decode(static_cast<uint8_t>(c), f);
  return table;
}

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = decode_table(kE4M3);
  return table;
}

const std::array<float, 256>& e5m2_table() {
  static const std::array<float, 256> table = decode_table(kE5M2);
  return table;
}

// The largest |x| over finite x, as the bits of a non-negative float (whose order is the
// order of the values): no float comparisons, NaN and infinities skipped by their bits.
inline uint32_t finite_amax_bits(uint32_t acc, float x) {
  const uint32_t abs = std::bit_cast<uint32_t>(x) & 0x7FFFFFFFu;
  return abs < 0x7F800000u ? std::max(acc, abs) : acc;
}

// 1 / s for a power-of-two scale s in [2^-126, 2^127]: 2^-k, exact (2^-127 is an fp32
// subnormal, still exact). x * (1 / s) is then the correctly rounded x / s: the same real
// number rounded once. It is inexact only where x / s falls below 2^-126, where every fp8
// code is a signed zero either way.
inline float reciprocal(float s) {
  int e;
  std::frexp(s, &e);  // s = 0.5 * 2^e
  return std::ldexp(1.0f, 1 - e);
}

// Quantises n elements at stride `stride` with scale s into codes (or, when out is set,
// straight back to fp32 as q * s). The single loop body of every quantiser.
inline void quantize_run(uint8_t* codes, float* out, const float* x, int64_t n, int64_t stride, float s) {
  const float inv = reciprocal(s);
  if (out != nullptr) {
    const float* table = e4m3_table().data();
    for (int64_t i = 0; i < n; ++i) out[i * stride] = table[encode(x[i * stride] * inv, kE4M3)] * s;
  } else {
    for (int64_t i = 0; i < n; ++i) codes[i * stride] = encode(x[i * stride] * inv, kE4M3);
  }
}

// 1 x 128 tiles: codes or out (one of them set), scales (rows, fp8_blocks(cols)) optional.
void rows_e4m3(uint8_t* codes, float* out, float* scales, const float* x, int64_t rows, int64_t cols) {
  const int64_t tiles = fp8_blocks(cols);
#pragma omp parallel for schedule(static) if (rows * cols > (int64_t{1} << 16))
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t c0 = t * kFp8Block, n = std::min(kFp8Block, cols - c0);
      const float* xt = x + r * cols + c0;
      uint32_t amax = 0;
      for (int64_t i = 0; i < n; ++i) amax = finite_amax_bits(amax, xt[i]);
      const float s = fp8_block_scale(std::bit_cast<float>(amax), Fp8Format::kE4M3);
      if (scales != nullptr) scales[r * tiles + t] = s;
      quantize_run(codes ? codes + r * cols + c0 : nullptr, out ? out + r * cols + c0 : nullptr, xt, n, 1, s);
    }
  }
}

// Blocks of 128 x kBlockCols (128 x 1 tiles or 128 x 128 blocks): codes or out set, scales
// (fp8_blocks(rows), cols / kBlockCols rounded up) optional. Walks each block row by row so
// that the reads stay sequential. kBlockCols is a constant so that c / kBlockCols is a shift.
template <int64_t kBlockCols>
void blocks_e4m3(uint8_t* codes, float* out, float* scales, const float* x, int64_t rows, int64_t cols) {
  constexpr int64_t block_cols = kBlockCols;
  const int64_t row_blocks = fp8_blocks(rows);
  const int64_t col_blocks = (cols + block_cols - 1) / block_cols;
#pragma omp parallel for schedule(static) if (rows * cols > (int64_t{1} << 16))
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    const int64_t r0 = rb * kFp8Block, nr = std::min(kFp8Block, rows - r0);
    std::vector<uint32_t> amax(static_cast<size_t>(col_blocks), 0u);
    for (int64_t r = r0; r < r0 + nr; ++r) {
      const float* xr = x + r * cols;
      for (int64_t c = 0; c < cols; ++c) amax[c / block_cols] = finite_amax_bits(amax[c / block_cols], xr[c]);
    }
    std::vector<float> s(static_cast<size_t>(col_blocks));
    for (int64_t b = 0; b < col_blocks; ++b) {
      s[b] = fp8_block_scale(std::bit_cast<float>(amax[b]), Fp8Format::kE4M3);
      if (scales != nullptr) scales[rb * col_blocks + b] = s[b];
    }
    for (int64_t r = r0; r < r0 + nr; ++r) {
      for (int64_t b = 0; b < col_blocks; ++b) {
        const int64_t c0 = b * block_cols, n = std::min(block_cols, cols - c0);
        const int64_t at = r * cols + c0;
        quantize_run(codes ? codes + at : nullptr, out ? out + at : nullptr, x + at, n, 1, s[b]);
      }
    }
  }
}

}  // namespace

uint8_t f32_to_e4m3(float x) { return encode(x, kE4M3); }
float e4m3_to_f32(uint8_t code) { return e4m3_table()[code]; }
uint8_t f32_to_e5m2(float x) { return encode(x, kE5M2); }
float e5m2_to_f32(uint8_t code) { return e5m2_table()[code]; }

uint8_t f32_to_fp8(float x, Fp8Format format) {
  return format == Fp8Format::kE4M3 ? f32_to_e4m3(x) : f32_to_e5m2(x);
}

float fp8_to_f32(uint8_t code, Fp8Format format) {
  return format == Fp8Format::kE4M3 ? e4m3_to_f32(code) : e5m2_to_f32(code);
}

float fp8_block_scale(float amax, Fp8Format format) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  const float max = format == Fp8Format::kE4M3 ? kE4M3Max : kE5M2Max;
  // amax = fa * 2^ea and max = fm * 2^em with fa, fm in [0.5, 1) (frexp is exact, subnormals
  // included). amax <= max * 2^k holds for k >= ea - em when fa <= fm, else for k >= ea - em + 1.
  int ea, em;
  const float fa = std::frexp(amax, &ea);
  const float fm = std::frexp(max, &em);
  int k = ea - em + (fa > fm ? 1 : 0);
  k = std::clamp(k, -126, 127);
  return std::ldexp(1.0f, k);
}

namespace cpu {

void quantize_weight_e4m3(uint8_t* out, const float* w, int64_t rows, int64_t cols) {
  const uint64_t offset = fp8_matrix_scale_offset(rows, cols);
  const int64_t nblocks = fp8_blocks(rows) * fp8_blocks(cols);
  // The scales are written into an aligned buffer first: `out + offset` is 16-byte aligned
  // relative to out only, and out itself may be a byte pointer anywhere.
  std::vector<float> scales(static_cast<size_t>(nblocks));
  blocks_e4m3<kFp8Block>(out, nullptr, scales.data(), w, rows, cols);
  std::memset(out + rows * cols, 0, offset - static_cast<uint64_t>(rows * cols));
  std::memcpy(out + offset, scales.data(), scales.size() * sizeof(float));
}

void dequantize_weight_e4m3(float* w, const uint8_t* in, int64_t rows, int64_t cols) {
  const int64_t rbs = fp8_blocks(rows), cbs = fp8_blocks(cols);
  std::vector<float> scales(static_cast<size_t>(rbs * cbs));
  std::memcpy(scales.data(), in + fp8_matrix_scale_offset(rows, cols), scales.size() * sizeof(float));
  const float* table = e4m3_table().data();
#pragma omp parallel for schedule(static) if (rows * cols > (int64_t{1} << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = scales.data() + (r / kFp8Block) * cbs;
    for (int64_t c = 0; c < cols; ++c) w[r * cols + c] = table[in[r * cols + c]] * s[c / kFp8Block];
  }
}

void quantize_rows_e4m3(uint8_t* codes, float* scales, const float* x, int64_t rows, int64_t cols) {
  rows_e4m3(codes, nullptr, scales, x, rows, cols);
}

void quantize_cols_e4m3(uint8_t* codes, float* scales, const float* x, int64_t rows, int64_t cols) {
  blocks_e4m3<1>(codes, nullptr, scales, x, rows, cols);
}

void fake_quantize_rows_e4m3(float* out, const float* x, int64_t rows, int64_t cols) {
  rows_e4m3(nullptr, out, nullptr, x, rows, cols);
}

void fake_quantize_cols_e4m3(float* out, const float* x, int64_t rows, int64_t cols) {
  blocks_e4m3<1>(nullptr, out, nullptr, x, rows, cols);
}

}  // namespace cpu

namespace ref {

void fp8_gemm_nt(float* C, const uint8_t* A, const float* a_scales, const uint8_t* B, const float* b_scales,
                 bool b_blocks, int64_t M, int64_t N, int64_t K) {
  const int64_t kbs = fp8_blocks(K);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      const float* sb = b_scales + (b_blocks ? (n / kFp8Block) : n) * kbs;
      float c = 0.0f;
      for (int64_t kb = 0; kb < kbs; ++kb) {
        const int64_t k0 = kb * kFp8BlockK, k1 = std::min(K, k0 + kFp8BlockK);
        // Each product of two E4M3 values is exact in fp32 (4 x 4 significant bits, exponents
        // within [-18, 17]), so only the additions round.
        float partial = 0.0f;
        for (int64_t k = k0; k < k1; ++k) partial += e4m3_to_f32(A[m * K + k]) * e4m3_to_f32(B[n * K + k]);
        c += partial * a_scales[m * kbs + kb] * sb[kb];
      }
      C[m * N + n] = c;
    }
  }
}

}  // namespace ref
}  // namespace strata::kernels
