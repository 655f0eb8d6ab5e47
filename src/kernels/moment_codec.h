// The per-element encodings of compact Adam moments (kernels/moments.h), shared by the CPU
// loops (cpu/moments.cpp) and the CUDA kernels (cuda/moments.cu) so that both give the same
// bytes: the 8-bit tables, the rounding of one value and the counter-based random bits.
// Compiles as C++17 under nvcc; includes nothing that pulls in the logging stack.
//
// ## The 8-bit tables
// A code indexes a sorted table of 256 fp32 values; x ~ table[code] * block_scale. The
// magnitudes follow a decimal exponent and a linear fraction: decade d (d = 0..6) holds
//   10^-d * (N_d + 9 j) / (10 N_d),  j = 1..N_d,
// i.e. N_d evenly spaced values in (0.1, 1] * 10^-d, and the lowest decade also holds its
// bottom, 1e-7. So the table reaches from 1e-7 to 1 (seven decades) and a value inside decade
// d is rounded with an absolute error of at most 0.45 * 10^-d / N_d of the block scale, a
// relative error of at most 4.5 / N_d (at the bottom of the decade; 0.45 / N_d at its top).
// More values go to the upper decades, where the elements of a block mostly lie (the largest
// |x| of 256 roughly normal values is ~3 sigma; a value below 1e-2 of it is rare):
//   m, signed:   N = 47 32 20 12 8 5 3 (128 magnitudes), table = -M[127..1], 0, M[0..127];
//                the negative side lacks the smallest magnitude (1e-7) to make room for 0.
//                Worst relative error per decade: 9.6% 14% 23% 38% 56% 90% 150%.
//   v, unsigned: N = 95 64 40 24 16 10 5 (255 magnitudes), table = 0, U[0..254].
//                Worst relative error per decade: 4.7% 7.0% 11% 19% 28% 45% 90%.
// Both contain exact 0 and 1 (and -1): the block's largest element encodes to +-1 exactly and
// decodes to exactly the scale, which is what makes encode(decode(stored)) == stored.
//
// ## v is stored as sqrt(v)
// The second moment is the square of a gradient scale, so it spans twice the decades of m: a
// block whose gradients spread over 4 decades has v over 8. The table holds sqrt(v) / max
// sqrt(v) instead (the block scale of v is max sqrt(v)), so seven decades of the table cover
// seven decades of gradient size, and the relative error the update sees through
// sqrt(v) is the table's own, not half of a coarser one. Decoding squares: v = (t * s)^2.
// sqrt(fl(y * y)) == y for every fp32 y whose square is a normal number (a property of
// round-to-nearest binary arithmetic; checked exhaustively over [1, 4), which every such y is a
// power of 4 away from), so decoding and encoding again returns the same code while the
// decoded v are normal numbers (v >= 2^-126).
// A nonzero v never encodes to 0: it rounds up to the smallest magnitude instead. A v
// rounded to 0 under an m that is not would make the step m / eps; a v rounded up only makes
// the step smaller.
//
// ## Rounding
// Nearest: the nearer of the two table values around x (ties to the smaller magnitude).
// Stochastic: the upper one with probability (x - lo) / (hi - lo), from 24 random bits, so the
// expected value is x. NaN encodes to the code of 0 (the parameter itself carries the NaN).
// bf16 nearest is round-to-nearest-even (as kernels/bf16.h's f32_to_bf16); stochastic adds 16
// random bits to the fp32 pattern and truncates, which rounds the magnitude up with
// probability equal to the dropped fraction.
// Random bits of element i: splitmix64's output number i for a key derived from (seed, m|v).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/adamw_element.h"

namespace strata::kernels {

// ---- tables -------------------------------------------------------------------------------

inline constexpr int kMomentCodes = 256;
inline constexpr int kMomentDecades = 7;
inline constexpr int kSignedSteps[kMomentDecades] = {47, 32, 20, 12, 8, 5, 3};
inline constexpr int kUnsignedSteps[kMomentDecades] = {95, 64, 40, 24, 16, 10, 5};
inline constexpr int kSignedZeroCode = 127;  // table value 0 in the signed table
inline constexpr int kUnsignedZeroCode = 0;

struct MomentTable {
  float value[kMomentCodes];  // strictly increasing
};

// Ascending magnitudes 1e-7, then decades 6..0 as described above; returns how many.
constexpr int moment_magnitudes(const int* steps, double* out) {
  constexpr double kPow10[kMomentDecades] = {1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6};
  int k = 0;
  out[k++] = 1e-7;
  for (int d = kMomentDecades - 1; d >= 0; --d) {
    const double n = steps[d];
    for (int j = 1; j <= steps[d]; ++j) out[k++] = kPow10[d] * ((n + 9.0 * j) / (10.0 * n));
  }
  return k;
}

constexpr MomentTable make_moment_table(bool is_v) {
  double mag[kMomentCodes] = {};
  MomentTable t{};
  if (is_v) {
    moment_magnitudes(kUnsignedSteps, mag);  // 255 values
    t.value[0] = 0.0f;
    for (int i = 1; i < kMomentCodes; ++i) t.value[i] = static_cast<float>(mag[i - 1]);
  } else {
    moment_magnitudes(kSignedSteps, mag);  // 128 values
    for (int i = 0; i < kSignedZeroCode; ++i) t.value[i] = -static_cast<float>(mag[127 - i]);
    t.value[kSignedZeroCode] = 0.0f;
    for (int i = 0; i < 128; ++i) t.value[kSignedZeroCode + 1 + i] = static_cast<float>(mag[i]);
  }
  return t;
}

inline constexpr MomentTable kMomentTableM = make_moment_table(false);
inline constexpr MomentTable kMomentTableV = make_moment_table(true);
static_assert(kMomentTableM.value[0] == -1.0f && kMomentTableM.value[255] == 1.0f);
static_assert(kMomentTableM.value[kSignedZeroCode] == 0.0f);
static_assert(kMomentTableV.value[0] == 0.0f && kMomentTableV.value[255] == 1.0f);

// ---- random bits --------------------------------------------------------------------------

STRATA_HOST_DEVICE uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// The key of one tensor's m (or v) stream for one seed.
STRATA_HOST_DEVICE uint64_t moment_stream_key(uint64_t seed, bool is_v) {
  return splitmix64_mix(seed ^ (is_v ? 0xD1B54A32D192ED03ull : 0x8CB92BA72F3D8DD7ull));
}
// 64 random bits for element `index` of a stream: splitmix64's (index + 1)-th output from the key.
STRATA_HOST_DEVICE uint64_t moment_random_bits(uint64_t key, uint64_t index) {
  return splitmix64_mix(key + (index + 1) * 0x9E3779B97F4A7C15ull);
}

// ---- bf16 ---------------------------------------------------------------------------------

STRATA_HOST_DEVICE uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}
STRATA_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

STRATA_HOST_DEVICE float moment_bf16_decode(uint16_t b) { return bits_float(uint32_t{b} << 16); }

// Nearest-even (stochastic false) or stochastic with the low 16 of `random`.
STRATA_HOST_DEVICE uint16_t moment_bf16_encode(float x, bool stochastic, uint64_t random) {
  const uint32_t bits = float_bits(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  // Nearest even: adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when
  // the dropped half is above one half, or equal to it with an odd kept half.
  const uint32_t add = stochastic ? static_cast<uint32_t>(random & 0xFFFFu) : 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + add) >> 16);
}

// ---- int8 ---------------------------------------------------------------------------------

// The largest index whose table value is <= x, or 0 when x is below the whole table.
// Eight steps without a data-dependent branch (a select), which mispredicts on random data.
// (cpu/moment_search.h finds the same index faster on the CPU.)
STRATA_HOST_DEVICE int moment_table_floor(const float* table, float x) {
  int lo = 0;
  for (int step = kMomentCodes / 2; step > 0; step >>= 1) {
    lo += (table[lo + step] <= x) ? step : 0;
  }
  return lo;
}

// Code of x (a value already divided by the block scale, so in [-1, 1]) in `table`, given
// lo = moment_table_floor(table, x).
STRATA_HOST_DEVICE int moment_int8_round(const float* table, float x, int lo, bool is_v, bool stochastic,
                                         uint64_t random) {
  const int zero = is_v ? kUnsignedZeroCode : kSignedZeroCode;
  if (!(x == x)) return zero;
  int code;
  if (table[lo] >= x || lo == kMomentCodes - 1) {
    code = lo;  // exact, or below the table's first value
  } else {
    const int hi = lo + 1;
    const float below = sub_rn(x, table[lo]);
    const float above = sub_rn(table[hi], x);
    if (stochastic) {
      // 24 random bits as a number in [0, 1), exact in fp32.
      const float u = static_cast<float>(static_cast<uint32_t>(random >> 40)) * 0x1p-24f;
      code = u < div_rn(below, sub_rn(table[hi], table[lo])) ? hi : lo;
    } else if (below < above) {
      code = lo;
    } else if (above < below) {
      code = hi;
    } else {
      code = table[hi] <= 0.0f ? hi : lo;  // tie: the smaller magnitude
    }
  }
  if (is_v && code == zero && x > 0.0f) code = zero + 1;
  return code;
}

STRATA_HOST_DEVICE int moment_int8_encode(const float* table, float x, bool is_v, bool stochastic, uint64_t random) {
  return moment_int8_round(table, x, moment_table_floor(table, x), is_v, stochastic, random);
}

}  // namespace strata::kernels
