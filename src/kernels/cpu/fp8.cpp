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

#include <immintrin.h>

#include "kernels/adamw_simd.h"

namespace strata::kernels {
namespace {

#define STRATA_TARGET_AVX2 __attribute__((target("avx2")))

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

// Round-to-nearest-even, saturating conversion of fp32 to a format, on the integer bits.
// Written without branches (selects only) and inline, so that the quantisation loops compile
// it into their bodies with the format's numbers as constants.
inline uint8_t encode(float x, const Format& f) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs = bits & 0x7FFFFFFFu;
  const uint32_t exponent = abs >> 23;  // biased by 127; 0 for fp32 zeros and subnormals
  // The biased fp32 exponent of the smallest normal fp8 binade, 2^(1 - bias).
  const uint32_t min_normal = static_cast<uint32_t>(127 + 1 - f.bias);
  // Bits of the 24-bit significand that do not fit: fp8 keeps mantissa_bits of the 23, and
  // one bit fewer per binade below the normal range. Beyond 25 dropped bits the value is
  // below half the smallest subnormal and rounds to zero; the cap keeps shifts in range and
  // changes no result (so do the garbage significands of fp32 subnormals, all below that).
  const uint32_t shortfall = exponent < min_normal ? min_normal - exponent : 0u;
  const uint32_t shift = std::min(static_cast<uint32_t>(23 - f.mantissa_bits) + shortfall, 25u);
  const uint32_t significand = (abs & 0x7FFFFFu) | 0x800000u;
  uint32_t kept = significand >> shift;
  const uint32_t rest = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  kept += static_cast<uint32_t>(rest > half) | (static_cast<uint32_t>(rest == half) & kept);
  // Normal: kept holds the implicit bit (2^M <= kept <= 2^(M+1)), so adding it to the exponent
  // field one lower places the mantissa, and a carry out of the mantissa (rounding up into the
  // next binade) increments the exponent. Subnormal: the exponent term is 0 and kept counts
  // smallest subnormals; rounding up to 2^M lands exactly on the smallest normal's code.
  uint32_t code = ((std::max(exponent, min_normal) - min_normal) << f.mantissa_bits) + kept;
  // Comparing the bits of non-negative floats compares their values. Everything at or beyond
  // the largest finite (infinity included) saturates to it; anything below rounds to at most
  // the largest finite, since that is representable.
  code = abs >= std::bit_cast<uint32_t>(f.max) ? f.max_code : code;
  code = abs > 0x7F800000u ? f.nan_code : code;
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

// 1 / s for a power-of-two scale s = 2^k, k in [-126, 127]: 2^-k, exact (2^-127 is an fp32
// subnormal, still exact). x * (1 / s) is then the correctly rounded x / s: the same real
// number rounded once. It is inexact only where x / s falls below 2^-126, where every fp8
// code is a signed zero either way.
inline float reciprocal(float s) {
  const int k = static_cast<int>(std::bit_cast<uint32_t>(s) >> 23) - 127;
  return k == 127 ? std::bit_cast<float>(0x00400000u) : std::bit_cast<float>(static_cast<uint32_t>(127 - k) << 23);
}

// One band of kBlockRows rows [r0, r1) of a (rows, cols) matrix in blocks of kBlockRows x
// kBlockCols (1 x 128 tiles, 128 x 1 tiles or 128 x 128 blocks): codes or out set, scales (the
// band's col_blocks) optional. The band is read twice, row by row (sequential reads): once for
// the blocks' amax, once to quantise. Each element is read before it is written, so out may
// alias x. Every inner loop runs over a row segment with the same scale (a 128-wide block: one
// scalar; 128 x 1 tiles: a scale per column, loaded beside the element), so it compiles to
// vector code; the operations are integer ones and exact multiplications by powers of two, so
// every instruction set gives the same bits. `amax`, `s` and `inv` hold col_blocks entries.
template <int64_t kBlockRows, int64_t kBlockCols>
inline void quantize_band(uint8_t* codes, float* out, float* scales, const float* x, int64_t r0, int64_t r1,
                          int64_t cols, uint32_t* amax, float* s, float* inv) {
  const int64_t col_blocks = (cols + kBlockCols - 1) / kBlockCols;
  std::fill(amax, amax + col_blocks, 0u);
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * cols;
    if constexpr (kBlockCols == 1) {
      for (int64_t c = 0; c < cols; ++c) amax[c] = finite_amax_bits(amax[c], xr[c]);
    } else {
      for (int64_t b = 0; b < col_blocks; ++b) {
        const int64_t c0 = b * kBlockCols, c1 = std::min(cols, c0 + kBlockCols);
        uint32_t m = amax[b];
        for (int64_t c = c0; c < c1; ++c) m = finite_amax_bits(m, xr[c]);
        amax[b] = m;
      }
    }
  }
  for (int64_t b = 0; b < col_blocks; ++b) {
    s[b] = fp8_block_scale(std::bit_cast<float>(amax[b]), Fp8Format::kE4M3);
    inv[b] = reciprocal(s[b]);
  }
  if (scales != nullptr) std::copy(s, s + col_blocks, scales + (r0 / kBlockRows) * col_blocks);
  const float* table = e4m3_table().data();
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * cols;
    uint8_t* cr = codes != nullptr ? codes + r * cols : nullptr;
    float* orow = out != nullptr ? out + r * cols : nullptr;
    if constexpr (kBlockCols == 1) {
      if (orow != nullptr) {
        for (int64_t c = 0; c < cols; ++c) orow[c] = table[encode(xr[c] * inv[c], kE4M3)] * s[c];
      } else {
        for (int64_t c = 0; c < cols; ++c) cr[c] = encode(xr[c] * inv[c], kE4M3);
      }
    } else {
      for (int64_t b = 0; b < col_blocks; ++b) {
        const int64_t c0 = b * kBlockCols, c1 = std::min(cols, c0 + kBlockCols);
        const float sb = s[b], ib = inv[b];
        if (orow != nullptr) {
          for (int64_t c = c0; c < c1; ++c) orow[c] = table[encode(xr[c] * ib, kE4M3)] * sb;
        } else {
          for (int64_t c = c0; c < c1; ++c) cr[c] = encode(xr[c] * ib, kE4M3);
        }
      }
    }
  }
}

// ---- AVX2: the weight quantiser (128 x 128 blocks, codes), the optimizer's fp8 copy ----------

// |x| of finite lanes, 0 for NaN and infinities (finite_amax_bits, 8 lanes).
STRATA_TARGET_AVX2 inline __m256i finite_abs8(__m256 x) {
  const __m256i abs = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF));
  return _mm256_and_si256(abs, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), abs));
}

// encode(x, kE4M3) of 8 lanes, step for step, into the low 8 bytes.
STRATA_TARGET_AVX2 inline __m128i encode_e4m3_8(__m256 x) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256i abs = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i exponent = _mm256_srli_epi32(abs, 23);
  const __m256i min_normal = _mm256_set1_epi32(127 + 1 - kE4M3.bias);
  const __m256i shortfall = _mm256_max_epi32(_mm256_sub_epi32(min_normal, exponent), _mm256_setzero_si256());
  const __m256i shift =
      _mm256_min_epu32(_mm256_add_epi32(_mm256_set1_epi32(23 - kE4M3.mantissa_bits), shortfall), _mm256_set1_epi32(25));
  const __m256i significand =
      _mm256_or_si256(_mm256_and_si256(abs, _mm256_set1_epi32(0x7FFFFF)), _mm256_set1_epi32(0x800000));
  __m256i kept = _mm256_srlv_epi32(significand, shift);
  const __m256i rest = _mm256_and_si256(significand, _mm256_sub_epi32(_mm256_sllv_epi32(one, shift), one));
  const __m256i half = _mm256_sllv_epi32(one, _mm256_sub_epi32(shift, one));
  const __m256i up = _mm256_or_si256(_mm256_and_si256(_mm256_cmpgt_epi32(rest, half), one),
                                     _mm256_and_si256(_mm256_cmpeq_epi32(rest, half), _mm256_and_si256(kept, one)));
  kept = _mm256_add_epi32(kept, up);
  __m256i code = _mm256_add_epi32(
      _mm256_slli_epi32(_mm256_sub_epi32(_mm256_max_epu32(exponent, min_normal), min_normal), kE4M3.mantissa_bits),
      kept);
  const __m256i saturate = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(static_cast<int>(std::bit_cast<uint32_t>(kE4M3.max) - 1)));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(static_cast<int>(kE4M3.max_code)), saturate);
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F800000));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(static_cast<int>(kE4M3.nan_code)), nan);
  const __m256i r = _mm256_or_si256(sign, code);  // every lane < 256
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  return _mm_packus_epi16(words, words);
}

// quantize_band<kFp8Block, kFp8Block> writing codes, 8 elements at a time; the same bits.
STRATA_TARGET_AVX2 void weight_band_avx2(uint8_t* codes, float* scales, const float* x, int64_t r0, int64_t r1,
                                         int64_t cols, uint32_t* amax, float* s, float* inv) {
  const int64_t col_blocks = (cols + kFp8Block - 1) / kFp8Block;
  std::fill(amax, amax + col_blocks, 0u);
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * cols;
    for (int64_t b = 0; b < col_blocks; ++b) {
      const int64_t c0 = b * kFp8Block, c1 = std::min(cols, c0 + kFp8Block);
      __m256i m = _mm256_setzero_si256();
      int64_t c = c0;
      for (; c + 8 <= c1; c += 8) m = _mm256_max_epu32(m, finite_abs8(_mm256_loadu_ps(xr + c)));
      alignas(32) uint32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
      uint32_t best = amax[b];
      for (uint32_t lane : lanes) best = std::max(best, lane);
      for (; c < c1; ++c) best = finite_amax_bits(best, xr[c]);
      amax[b] = best;
    }
  }
  for (int64_t b = 0; b < col_blocks; ++b) {
    s[b] = fp8_block_scale(std::bit_cast<float>(amax[b]), Fp8Format::kE4M3);
    inv[b] = reciprocal(s[b]);
  }
  if (scales != nullptr) std::copy(s, s + col_blocks, scales + (r0 / kFp8Block) * col_blocks);
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * cols;
    uint8_t* cr = codes + r * cols;
    for (int64_t b = 0; b < col_blocks; ++b) {
      const int64_t c0 = b * kFp8Block, c1 = std::min(cols, c0 + kFp8Block);
      const __m256 ib = _mm256_set1_ps(inv[b]);
      int64_t c = c0;
      for (; c + 8 <= c1; c += 8)
        _mm_storel_epi64(reinterpret_cast<__m128i*>(cr + c), encode_e4m3_8(_mm256_mul_ps(_mm256_loadu_ps(xr + c), ib)));
      for (; c < c1; ++c) cr[c] = encode(xr[c] * inv[b], kE4M3);
    }
  }
}

// The matrix band by band across the cores, on the best instruction set the CPU has (capped by
// STRATA_SIMD, as AdamW's is).
template <int64_t kBlockRows, int64_t kBlockCols>
void quantize_blocks(uint8_t* codes, float* out, float* scales, const float* x, int64_t rows, int64_t cols) {
  const int64_t bands = (rows + kBlockRows - 1) / kBlockRows;
  const int64_t col_blocks = (cols + kBlockCols - 1) / kBlockCols;
  const bool avx2 = kBlockRows == kFp8Block && kBlockCols == kFp8Block && codes != nullptr &&
                    detect_simd_level() != SimdLevel::kScalar;
#pragma omp parallel if (rows * cols > (int64_t{1} << 16))
  {
    std::vector<uint32_t> amax(static_cast<size_t>(col_blocks));
    std::vector<float> s(static_cast<size_t>(col_blocks)), inv(static_cast<size_t>(col_blocks));
#pragma omp for schedule(static)
    for (int64_t band = 0; band < bands; ++band) {
      const int64_t r0 = band * kBlockRows, r1 = std::min(rows, r0 + kBlockRows);
      if (avx2) {
        weight_band_avx2(codes, scales, x, r0, r1, cols, amax.data(), s.data(), inv.data());
      } else {
        quantize_band<kBlockRows, kBlockCols>(codes, out, scales, x, r0, r1, cols, amax.data(), s.data(), inv.data());
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
  quantize_blocks<kFp8Block, kFp8Block>(out, nullptr, scales.data(), w, rows, cols);
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
  quantize_blocks<1, kFp8Block>(codes, nullptr, scales, x, rows, cols);
}

void quantize_cols_e4m3(uint8_t* codes, float* scales, const float* x, int64_t rows, int64_t cols) {
  quantize_blocks<kFp8Block, 1>(codes, nullptr, scales, x, rows, cols);
}

void fake_quantize_rows_e4m3(float* out, const float* x, int64_t rows, int64_t cols) {
  quantize_blocks<1, kFp8Block>(nullptr, out, nullptr, x, rows, cols);
}

void fake_quantize_cols_e4m3(float* out, const float* x, int64_t rows, int64_t cols) {
  quantize_blocks<kFp8Block, 1>(nullptr, out, nullptr, x, rows, cols);
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
