// FP8 numerics: conversions against the OCP definition, block scales, block quantisation and
// the promoting GEMM reference.
#include "kernels/fp8.h"
#include "kernels/adamw_simd.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "../test_util.h"

namespace strata::kernels {
namespace {

using strata::testing::random_vector;

struct Spec {
  Fp8Format format;
  int exponent_bits, mantissa_bits, bias;
  bool ieee_top_binade;  // E5M2: the top exponent field holds Inf and NaNs
  uint8_t nan;           // canonical NaN code, positive
  float max;
};
constexpr Spec kE4M3Spec{Fp8Format::kE4M3, 4, 3, 7, false, 0x7F, 448.0f};
constexpr Spec kE5M2Spec{Fp8Format::kE5M2, 5, 2, 15, true, 0x7F, 57344.0f};

// The value of a code from its fields, straight from the OCP definition (in double).
double ocp_value(uint8_t code, const Spec& f) {
  const int sign = code >> 7;
  const int e = (code >> f.mantissa_bits) & ((1 << f.exponent_bits) - 1);
  const int m = code & ((1 << f.mantissa_bits) - 1);
  const int top = (1 << f.exponent_bits) - 1;
  double v;
  if (f.ieee_top_binade && e == top) {
    v = m == 0 ? INFINITY : NAN;
  } else if (!f.ieee_top_binade && e == top && m == (1 << f.mantissa_bits) - 1) {
    v = NAN;
  } else if (e == 0) {
    v = std::ldexp(double(m), 1 - f.bias - f.mantissa_bits);
  } else {
    v = std::ldexp(1.0 + double(m) / (1 << f.mantissa_bits), e - f.bias);
  }
  return sign ? -v : v;
}

uint8_t encode(float x, const Spec& f) { return f32_to_fp8(x, f.format); }
float decode(uint8_t c, const Spec& f) { return fp8_to_f32(c, f.format); }

// The non-negative finite codes in order of value (the codes of a sign are monotonic in value).
std::vector<uint8_t> positive_finite_codes(const Spec& f) {
  std::vector<uint8_t> codes;
  for (int c = 0; c < 128; ++c) {
    if (std::isfinite(ocp_value(static_cast<uint8_t>(c), f))) codes.push_back(static_cast<uint8_t>(c));
  }
  return codes;
}

// An independent encoder: the nearest value by search over the OCP values, ties to the even
// code, saturating beyond the largest finite.
uint8_t search_encode(float x, const Spec& f, const std::vector<uint8_t>& codes) {
  if (std::isnan(x)) return static_cast<uint8_t>((std::signbit(x) ? 0x80 : 0) | f.nan);
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(double(x));
  size_t hi = 0;  // first code with value >= a
  while (hi < codes.size() && ocp_value(codes[hi], f) < a) ++hi;
  if (hi == codes.size()) return static_cast<uint8_t>(sign | codes.back());
  if (hi == 0 || ocp_value(codes[hi], f) == a) return static_cast<uint8_t>(sign | codes[hi]);
  const double below = a - ocp_value(codes[hi - 1], f), above = ocp_value(codes[hi], f) - a;
  uint8_t pick = below < above ? codes[hi - 1] : above < below ? codes[hi] : (codes[hi] % 2 == 0 ? codes[hi] : codes[hi - 1]);
  return static_cast<uint8_t>(sign | pick);
}

class Fp8Codes : public ::testing::TestWithParam<Spec> {};

TEST_P(Fp8Codes, EveryCodeDecodesToItsOcpValueAndEncodesBack) {
  const Spec f = GetParam();
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const double want = ocp_value(code, f);
    const float got = decode(code, f);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;
      EXPECT_EQ(encode(got, f), (c & 0x80) | f.nan) << "code " << c;
      continue;
    }
    EXPECT_TRUE(double(got) == want) << "code " << c << ": " << got << " vs " << want;
    EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;  // -0 included
    if (std::isinf(want)) {
      // Infinities saturate to the largest finite of their sign.
      EXPECT_EQ(encode(got, f), (c & 0x80) | encode(f.max, f)) << "code " << c;
    } else {
      EXPECT_EQ(encode(got, f), c) << "code " << c;
    }
  }
  EXPECT_EQ(decode(encode(f.max, f), f), f.max);
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8Codes, ::testing::Values(kE4M3Spec, kE5M2Spec),
                         [](const auto& info) { return info.param.format == Fp8Format::kE4M3 ? "E4M3" : "E5M2"; });

TEST_P(Fp8Codes, MidpointsRoundToEvenAndNeighboursRoundToNearest) {
  const Spec f = GetParam();
  const auto codes = positive_finite_codes(f);
  ASSERT_EQ(codes.front(), 0);
  for (size_t i = 0; i + 1 < codes.size(); ++i) {
    const uint8_t lo = codes[i], hi = codes[i + 1];
    ASSERT_EQ(hi, lo + 1);  // adjacent values have adjacent codes
    const float a = decode(lo, f), b = decode(hi, f);
    const float mid = (a + b) / 2;  // exact: a few significant bits, far from fp32's limits
    ASSERT_EQ(double(mid), (ocp_value(lo, f) + ocp_value(hi, f)) / 2);
    const uint8_t even = lo % 2 == 0 ? lo : hi;
    for (uint8_t sign : {uint8_t{0}, uint8_t{0x80}}) {
      const float m = sign ? -mid : mid;
      EXPECT_EQ(encode(m, f), sign | even) << "midpoint of codes " << int(lo) << ", " << int(hi);
      EXPECT_EQ(encode(std::nextafter(m, 0.0f), f), sign | lo) << "below the midpoint of " << int(lo);
      EXPECT_EQ(encode(std::nextafter(m, sign ? -INFINITY : INFINITY), f), sign | hi)
          << "above the midpoint of " << int(lo);
      // The neighbours themselves, and one fp32 ulp inside them, round to them.
      const float va = sign ? -a : a, vb = sign ? -b : b;
      EXPECT_EQ(encode(va, f), sign | lo);
      EXPECT_EQ(encode(vb, f), sign | hi);
      EXPECT_EQ(encode(std::nextafter(va, vb), f), sign | lo);
      EXPECT_EQ(encode(std::nextafter(vb, va), f), sign | hi);
    }
  }
}

TEST_P(Fp8Codes, SpecialValuesSaturateKeepSignsAndFlushBelowHalfTheSmallestSubnormal) {
  const Spec f = GetParam();
  const uint8_t max_code = encode(f.max, f);
  EXPECT_EQ(decode(max_code, f), f.max);
  EXPECT_EQ(max_code, f.format == Fp8Format::kE4M3 ? 0x7E : 0x7B);
  const float beyond[] = {std::nextafter(f.max, INFINITY), f.max * 1.0625f, f.max * 1.125f, f.max * 2,
                          std::numeric_limits<float>::max(), INFINITY};
  for (float x : beyond) {
    EXPECT_EQ(encode(x, f), max_code) << x;
    EXPECT_EQ(encode(-x, f), 0x80 | max_code) << -x;
  }
  const float nans[] = {NAN, std::bit_cast<float>(0x7F800001u), std::bit_cast<float>(0x7FBFFFFFu),
                        std::bit_cast<float>(0x7FC00000u), std::bit_cast<float>(0x7FFFFFFFu)};
  for (float x : nans) {
    EXPECT_EQ(encode(x, f), f.nan) << std::bit_cast<uint32_t>(x);
    EXPECT_EQ(encode(-x, f), 0x80 | f.nan) << std::bit_cast<uint32_t>(x);
  }
  EXPECT_EQ(encode(0.0f, f), 0x00);
  EXPECT_EQ(encode(-0.0f, f), 0x80);
  const float tiny = float(std::ldexp(1.0, 1 - f.bias - f.mantissa_bits));  // smallest subnormal
  EXPECT_EQ(decode(1, f), tiny);
  const float half = tiny / 2;
  const float flushed[] = {half, std::nextafter(half, 0.0f), half / 4, std::numeric_limits<float>::min(),
                           std::numeric_limits<float>::denorm_min(), std::bit_cast<float>(0x007FFFFFu)};
  for (float x : flushed) {
    EXPECT_EQ(encode(x, f), 0x00) << x;
    EXPECT_EQ(encode(-x, f), 0x80) << -x;
  }
  EXPECT_EQ(encode(std::nextafter(half, 1.0f), f), 0x01);
  EXPECT_EQ(encode(-std::nextafter(half, 1.0f), f), 0x81);
  EXPECT_EQ(encode(tiny * 1.5f, f), 0x02);  // a tie between codes 1 and 2 goes to the even one
}

// A sweep over the fp32 bit patterns of every exponent (and random mantissas) against the
// search encoder.
TEST_P(Fp8Codes, ConversionMatchesANearestValueSearchAcrossAllExponents) {
  const Spec f = GetParam();
  const auto codes = positive_finite_codes(f);
  std::mt19937_64 rng(7);
  int64_t mismatches = 0;
  for (uint32_t top = 0; top < (1u << 14); ++top) {  // sign, exponent and 5 mantissa bits
    const uint32_t bits = top << 18 | static_cast<uint32_t>(rng() & 0x3FFFFu);
    const float x = std::bit_cast<float>(bits);
    const uint8_t want = search_encode(x, f, codes), got = encode(x, f);
    if (got != want && ++mismatches <= 10) ADD_FAILURE() << "bits " << std::hex << bits << ": " << int(got) << " vs " << int(want);
  }
  EXPECT_EQ(mismatches, 0);
}

// The smallest power of two p >= 2^-126 with amax <= max * p, by doubling (in double: exact).
double doubling_scale(double amax, double max) {
  double p = std::ldexp(1.0, -126);
  while (amax > max * p) p *= 2;
  return p;
}

TEST_P(Fp8Codes, BlockScaleIsTheSmallestPowerOfTwoThatFitsTheLargestFinite) {
  const Spec f = GetParam();
  int checked = 0;
  for (int k = -140; k <= 130; ++k) {
    const float amax = float(std::ldexp(double(f.max), k));
    if (!std::isfinite(amax) || amax == 0) continue;
    const float exact = float(std::ldexp(1.0, std::max(k, -126)));
    EXPECT_EQ(fp8_block_scale(amax, f.format), exact) << "amax = max * 2^" << k;
    EXPECT_EQ(double(fp8_block_scale(amax, f.format)), doubling_scale(amax, f.max)) << k;
    const float above = std::nextafter(amax, INFINITY);
    if (std::isfinite(above)) {
      EXPECT_EQ(double(fp8_block_scale(above, f.format)), doubling_scale(above, f.max)) << k;
      if (k >= -126) {
        EXPECT_EQ(fp8_block_scale(above, f.format), 2 * exact) << "just above max * 2^" << k;
      }
    }
    ++checked;
  }
  EXPECT_GT(checked, 250);
  // Random magnitudes over the whole fp32 range; the largest element lands in [max / 2, max].
  std::mt19937_64 rng(11);
  for (int i = 0; i < 20000; ++i) {
    const float amax = std::bit_cast<float>(static_cast<uint32_t>(rng() % 0x7F800000u));
    if (amax == 0) continue;
    const float s = fp8_block_scale(amax, f.format);
    ASSERT_EQ(double(s), doubling_scale(amax, f.max)) << amax;
    if (s > std::ldexp(1.0f, -126)) {
      const double y = double(amax) / s;
      EXPECT_TRUE(y <= f.max && y > f.max / 2) << amax;
    }
  }
  EXPECT_EQ(fp8_block_scale(0.0f, f.format), 1.0f);
  EXPECT_EQ(fp8_block_scale(INFINITY, f.format), 1.0f);
  EXPECT_EQ(fp8_block_scale(NAN, f.format), 1.0f);
  EXPECT_EQ(fp8_block_scale(std::numeric_limits<float>::denorm_min(), f.format), std::ldexp(1.0f, -126));
  EXPECT_EQ(fp8_block_scale(std::numeric_limits<float>::max(), f.format),
            std::ldexp(1.0f, f.format == Fp8Format::kE4M3 ? 120 : 113));
}

// ---- Block quantisation ------------------------------------------------------------------

// How a quantiser tiles a (rows, cols) matrix: blocks of block_rows x block_cols, scales
// row-major over blocks.
struct Tiling {
  const char* name;
  int64_t block_rows, block_cols;
};
constexpr Tiling kRows{"rows", 1, 128}, kCols{"cols", 128, 1}, kWeight{"weight", 128, 128};

// The quantiser's outputs: codes (rows, cols), scales over blocks, and its fake-quantised form.
struct Quantised {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<float> fake;
};

Quantised quantise(const Tiling& t, const std::vector<float>& x, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  Quantised q;
  q.codes.assign(n, 0xAB);
  q.fake.assign(n, -7.0f);
  if (t.block_rows == 128 && t.block_cols == 128) {
    std::vector<uint8_t> stored(fp8_matrix_bytes(rows, cols), 0xAB);
    cpu::quantize_weight_e4m3(stored.data(), x.data(), rows, cols);
    std::memcpy(q.codes.data(), stored.data(), n);
    for (uint64_t i = n; i < fp8_matrix_scale_offset(rows, cols); ++i) EXPECT_EQ(stored[i], 0) << "padding byte " << i;
    q.scales.resize(fp8_blocks(rows) * fp8_blocks(cols));
    std::memcpy(q.scales.data(), stored.data() + fp8_matrix_scale_offset(rows, cols), q.scales.size() * 4);
    cpu::dequantize_weight_e4m3(q.fake.data(), stored.data(), rows, cols);
    return q;
  }
  const bool by_rows = t.block_rows == 1;
  q.scales.assign(by_rows ? rows * fp8_blocks(cols) : fp8_blocks(rows) * cols, -7.0f);
  (by_rows ? cpu::quantize_rows_e4m3 : cpu::quantize_cols_e4m3)(q.codes.data(), q.scales.data(), x.data(), rows, cols);
  (by_rows ? cpu::fake_quantize_rows_e4m3 : cpu::fake_quantize_cols_e4m3)(q.fake.data(), x.data(), rows, cols);
  return q;
}

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

// Checks a quantisation against the definition: each block's scale from its finite amax, each
// code fp8(x / s), the fake form (or the dequantised weight) equal to code * s bit for bit, and
// within half an fp8 spacing (times s) of x.
void check_quantised(const Tiling& t, const std::vector<float>& x, int64_t rows, int64_t cols, const Quantised& q) {
  const int64_t brs = (rows + t.block_rows - 1) / t.block_rows, bcs = (cols + t.block_cols - 1) / t.block_cols;
  ASSERT_EQ(int64_t(q.scales.size()), brs * bcs);
  std::vector<double> amax(brs * bcs, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const double v = std::fabs(double(x[r * cols + c]));
      double& a = amax[(r / t.block_rows) * bcs + c / t.block_cols];
      if (std::isfinite(v)) a = std::max(a, v);
    }
  int64_t failures = 0;
  for (int64_t b = 0; b < brs * bcs; ++b) {
    const double want = amax[b] == 0 ? 1.0 : doubling_scale(amax[b], 448.0);
    if (!(double(q.scales[b]) == want) && ++failures <= 5) ADD_FAILURE() << t.name << " scale " << b << ": " << q.scales[b] << " vs " << want;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      const float s = q.scales[(r / t.block_rows) * bcs + c / t.block_cols];
      const uint8_t want = f32_to_e4m3(x[i] / s);
      const float dq = e4m3_to_f32(q.codes[i]) * s;
      bool ok = q.codes[i] == want && same_float(q.fake[i], dq);
      if (std::isnan(x[i])) {
        ok = ok && std::isnan(dq);
      } else if (std::isinf(x[i])) {
        ok = ok && dq == std::copysign(448.0f * s, x[i]);
      } else {
        const double y = std::fabs(double(x[i])) / s;
        int e;
        std::frexp(y, &e);  // y in [2^(e-1), 2^e): fp8 spacing 2^(e-4) there, 2^-9 below 2^-6
        const double half_spacing = y < std::ldexp(1.0, -6) ? std::ldexp(1.0, -10) : std::ldexp(1.0, e - 5);
        ok = ok && std::fabs(double(dq) - double(x[i])) <= half_spacing * s && std::signbit(dq) == std::signbit(x[i]);
      }
      if (!ok && ++failures <= 5) {
        ADD_FAILURE() << t.name << " (" << r << ", " << c << ") of " << rows << "x" << cols << ": x " << x[i]
                      << " code " << int(q.codes[i]) << " vs " << int(want) << ", fake " << q.fake[i] << " dq " << dq;
      }
    }
  EXPECT_EQ(failures, 0);
}

// Values over many binades (and some zeros), so that blocks differ in scale and small elements
// fall into the subnormal codes of their block.
std::vector<float> spread_values(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-24, 24);
  std::vector<float> v(n);
  for (auto& x : v) x = rng() % 16 == 0 ? 0.0f : std::ldexp(mantissa(rng), exponent(rng));
  return v;
}

TEST(Fp8Quantize, EveryTilingMatchesTheDefinitionOnShapesThatAreNotMultiplesOf128) {
  const int64_t shapes[][2] = {{1, 1}, {127, 129}, {130, 257}, {128, 128}, {3, 384}, {256, 2}};
  uint64_t seed = 1;
  for (const auto& shape : shapes) {
    const int64_t rows = shape[0], cols = shape[1];
    const auto x = spread_values(rows * cols, seed++);
    for (const Tiling& t : {kRows, kCols, kWeight}) {
      SCOPED_TRACE(::testing::Message() << t.name << " " << rows << "x" << cols);
      check_quantised(t, x, rows, cols, quantise(t, x, rows, cols));
    }
  }
}

TEST(Fp8Quantize, FakeQuantisationInPlaceEqualsOutOfPlace) {
  const int64_t rows = 130, cols = 257;
  const auto x = spread_values(rows * cols, 99);
  for (auto fake : {&cpu::fake_quantize_rows_e4m3, &cpu::fake_quantize_cols_e4m3}) {
    std::vector<float> out(x.size()), inplace = x;
    fake(out.data(), x.data(), rows, cols);
    fake(inplace.data(), inplace.data(), rows, cols);
    EXPECT_EQ(std::memcmp(out.data(), inplace.data(), out.size() * 4), 0);
    EXPECT_NE(std::memcmp(out.data(), x.data(), out.size() * 4), 0);  // it did quantise
  }
}

// One block's worth of values v (n <= 128) quantised each way: as a 1 x n row, as an n x 1
// column, and as the first row of a 128 x 128 weight whose other rows are zero. Returns the
// single block's scale and v's codes and fake values for each, after checking the definition.
std::vector<Quantised> quantise_block_each_way(const std::vector<float>& v) {
  const int64_t n = static_cast<int64_t>(v.size());
  std::vector<Quantised> out;
  for (const Tiling& t : {kRows, kCols, kWeight}) {
    std::vector<float> x = v;
    int64_t rows = t.block_rows == 1 ? 1 : n, cols = t.block_rows == 1 ? n : 1;
    if (t.block_cols == 128 && t.block_rows == 128) {
      rows = 128, cols = 128;
      x.assign(128 * 128, 0.0f);
      std::copy(v.begin(), v.end(), x.begin());
    }
    Quantised q = quantise(t, x, rows, cols);
    check_quantised(t, x, rows, cols, q);
    q.codes.resize(n);
    q.fake.resize(n);
    out.push_back(q);
  }
  return out;
}

TEST(Fp8Quantize, AnAllZeroBlockHasScaleOneAndZeroCodes) {
  std::vector<float> v(128, 0.0f);
  v[5] = -0.0f;
  for (const auto& q : quantise_block_each_way(v)) {
    EXPECT_EQ(q.scales[0], 1.0f);
    for (int i = 0; i < 128; ++i) EXPECT_EQ(q.codes[i], i == 5 ? 0x80 : 0x00) << i;
    EXPECT_TRUE(std::signbit(q.fake[5]) && q.fake[5] == 0.0f);
  }
}

TEST(Fp8Quantize, TinyElementsBesideAHugeOneFlushOrBecomeSubnormalCodes) {
  std::vector<float> v(128, 0.0f);
  v[0] = 448.0f * 1024;                      // scale 2^10
  v[1] = 1.0f;                               // 2^-10: half the smallest subnormal, tie to 0
  v[2] = std::nextafter(1.0f, 2.0f);         // just above: the smallest subnormal
  v[3] = -1.5f;                              // -1.5 * 2^-10 rounds to -2^-9
  v[4] = 6.0f;                               // 3 * 2^-9: subnormal code 3
  v[5] = 0.25f;                              // far below: +0
  v[6] = -0.25f;                             // -0
  v[7] = 64.0f;                              // 2^-4: a normal code
  const uint8_t want[] = {0x7E, 0x00, 0x01, 0x81, 0x03, 0x00, 0x80, 0x18};
  for (const auto& q : quantise_block_each_way(v)) {
    EXPECT_EQ(q.scales[0], 1024.0f);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(q.codes[i], want[i]) << i;
    EXPECT_EQ(q.fake[4], 6.0f);
    EXPECT_EQ(q.fake[3], -2.0f);
  }
}

TEST(Fp8Quantize, AmaxAtMaxTimesAPowerOfTwoKeepsThatScaleAndJustAboveDoublesIt) {
  for (int k : {-20, -5, 0, 7, 30}) {
    const float at = std::ldexp(448.0f, k);
    std::vector<float> v = random_vector(100, k + 50, -1.0f, 1.0f);  // below 2^k: at stays amax
    for (float& x : v) x = std::ldexp(x, k);
    v[17] = -at;
    for (const auto& q : quantise_block_each_way(v)) {
      EXPECT_EQ(q.scales[0], std::ldexp(1.0f, k)) << k;
      EXPECT_EQ(q.codes[17], 0xFE) << k;
      EXPECT_EQ(q.fake[17], -at) << k;
    }
    v[17] = std::nextafter(at, INFINITY);
    for (const auto& q : quantise_block_each_way(v)) {
      EXPECT_EQ(q.scales[0], std::ldexp(1.0f, k + 1)) << k;
      EXPECT_EQ(q.codes[17], 0x76) << k;  // 224 = 1.75 * 2^7
    }
  }
}

TEST(Fp8Quantize, ASubnormalAmaxClampsTheScaleTo2ToTheMinus126) {
  const std::vector<float> v = {1e-40f, -3e-41f, 0.0f, 1e-45f};
  for (const auto& q : quantise_block_each_way(v)) {
    EXPECT_EQ(q.scales[0], std::ldexp(1.0f, -126));
    for (int i = 0; i < 4; ++i) EXPECT_EQ(q.codes[i], f32_to_e4m3(std::ldexp(v[i], 126))) << i;
    EXPECT_NE(q.codes[0], 0);
    EXPECT_NE(q.codes[1] & 0x7F, 0);
  }
}

TEST(Fp8Quantize, InfinitiesSaturateNaNsStayAndTheScaleComesFromTheFiniteElements) {
  const std::vector<float> v = {3.0f, -1.0f, INFINITY, -INFINITY, NAN, -NAN, 0.5f};
  const uint8_t want[] = {0x7C, 0xF0, 0x7E, 0xFE, 0x7F, 0xFF, 0x68};  // 384, -128, sat, sat, NaN, -NaN, 64
  for (const auto& q : quantise_block_each_way(v)) {
    EXPECT_EQ(q.scales[0], 1.0f / 128);
    for (int i = 0; i < 7; ++i) EXPECT_EQ(q.codes[i], want[i]) << i;
    EXPECT_EQ(q.fake[2], 3.5f);
    EXPECT_EQ(q.fake[3], -3.5f);
    EXPECT_TRUE(std::isnan(q.fake[4]) && std::isnan(q.fake[5]));
    EXPECT_EQ(q.fake[0], 3.0f);
  }
}

// ---- The promoting GEMM reference --------------------------------------------------------

// Bound on |C - exact| for C from the recipe's accumulation: a K block's partial sum adds at
// most 128 exact products in fp32 (at most 127 roundings, each within u = 2^-24 of a running
// sum bounded by the sum of |products|), the power-of-two scales are exact, and C adds
// fp8_blocks(K) scaled partials (at most that many more roundings). So
// |C - exact| <= (127 + blocks) * u * (1 + 1%) * sum_k |a_k * b_k| (the 1% covers the
// second-order terms of gamma_n = n u / (1 - n u)).
// The weight quantiser's vector form (AVX2, where the CPU has it) against its scalar form, bit
// for bit, on a ragged matrix of random fp32 bit patterns (NaNs, infinities, subnormals, every
// exponent) beside blocks of ordinary weights, whose scales are finite and so exercise rounding
// at every shift.
TEST(Fp8Quantize, TheWeightQuantiserGivesTheSameBitsOnEveryInstructionSet) {
  if (!simd_level_supported(SimdLevel::kAvx2)) GTEST_SKIP() << "this CPU has no AVX2";
  const int64_t rows = 300, cols = 277;
  std::vector<float> x(static_cast<size_t>(rows * cols));
  std::mt19937 rng(17);
  for (int64_t i = 0; i < rows * cols; ++i) {
    const bool wild = (i / cols) < 128 && (i % cols) < 128;  // one block of arbitrary bits
    x[i] = wild ? std::bit_cast<float>(static_cast<uint32_t>(rng()))
                : std::ldexp(static_cast<float>(static_cast<int32_t>(rng() % 2001) - 1000), -12 - int(rng() % 20));
  }
  std::vector<uint8_t> vector_form(fp8_matrix_bytes(rows, cols), 0xAB), scalar_form(vector_form.size(), 0xCD);
  cpu::quantize_weight_e4m3(vector_form.data(), x.data(), rows, cols);
  ASSERT_EQ(setenv("STRATA_SIMD", "scalar", 1), 0);
  cpu::quantize_weight_e4m3(scalar_form.data(), x.data(), rows, cols);
  unsetenv("STRATA_SIMD");
  EXPECT_EQ(vector_form, scalar_form);
}

TEST(Fp8Gemm, MatchesTheDoubleProductOfTheDequantisedOperandsWithinTheFp32AccumulationBound) {
  const int64_t M = 5, N = 130, K = 300, kbs = fp8_blocks(K);
  auto a = spread_values(M * K, 3), b = spread_values(N * K, 4);
  for (auto& x : a) x = std::ldexp(x, 8);  // different magnitudes for A and B
  std::vector<uint8_t> qa(M * K);
  std::vector<float> sa(M * kbs);
  cpu::quantize_rows_e4m3(qa.data(), sa.data(), a.data(), M, K);
  for (bool b_blocks : {false, true}) {
    SCOPED_TRACE(b_blocks ? "B in 128 x 128 blocks" : "B in 1 x 128 tiles");
    std::vector<uint8_t> qb(N * K);
    std::vector<float> sb;
    if (b_blocks) {
      std::vector<uint8_t> stored(fp8_matrix_bytes(N, K));
      cpu::quantize_weight_e4m3(stored.data(), b.data(), N, K);
      std::memcpy(qb.data(), stored.data(), N * K);
      sb.resize(fp8_blocks(N) * kbs);
      std::memcpy(sb.data(), stored.data() + fp8_matrix_scale_offset(N, K), sb.size() * 4);
    } else {
      sb.resize(N * kbs);
      cpu::quantize_rows_e4m3(qb.data(), sb.data(), b.data(), N, K);
    }
    std::vector<float> C(M * N, NAN);
    ref::fp8_gemm_nt(C.data(), qa.data(), sa.data(), qb.data(), sb.data(), b_blocks, M, N, K);
    double worst = 0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double exact = 0, magnitude = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double av = double(e4m3_to_f32(qa[m * K + k])) * sa[m * kbs + k / 128];
          const double bv = double(e4m3_to_f32(qb[n * K + k])) * sb[(b_blocks ? n / 128 : n) * kbs + k / 128];
          exact += av * bv;
          magnitude += std::fabs(av * bv);
        }
        ASSERT_GT(magnitude, 0);
        const double bound = (127 + kbs) * std::ldexp(1.0, -24) * 1.01 * magnitude;
        const double err = std::fabs(double(C[m * N + n]) - exact);
        ASSERT_TRUE(err <= bound) << "C(" << m << ", " << n << ") = " << C[m * N + n] << " vs " << exact;
        worst = std::max(worst, err / bound);
      }
    EXPECT_GT(worst, 0);  // some rounding happened: the bound is not vacuous
  }
}

TEST(Fp8Gemm, EachKBlockIsScaledByItsOwnScales) {
  const int64_t M = 1, N = 130, K = 256;
  const std::vector<uint8_t> A(K, f32_to_e4m3(1.0f));
  std::vector<uint8_t> B(N * K, f32_to_e4m3(1.0f));
  for (int64_t i = 128 * K; i < N * K; ++i) B[i] = f32_to_e4m3(2.0f);  // rows 128, 129
  const std::vector<float> sa = {1.0f, 0.125f};
  // Weight blocks: rows 0-127 {4, 8} over the two K blocks, rows 128-129 {0.25, 0.5}.
  const std::vector<float> sb_blocks = {4.0f, 8.0f, 0.25f, 0.5f};
  std::vector<float> C(N, NAN);
  ref::fp8_gemm_nt(C.data(), A.data(), sa.data(), B.data(), sb_blocks.data(), true, M, N, K);
  for (int64_t n = 0; n < N; ++n) {
    const float want = n < 128 ? 128 * 4.0f + 128 * 0.125f * 8 : 128 * 2 * 0.25f + 128 * 2 * 0.125f * 0.5f;  // 640, 80
    EXPECT_EQ(C[n], want) << n;
  }
  // The same B in 1 x 128 tiles: one scale pair per row.
  std::vector<float> sb_rows(N * 2);
  for (int64_t n = 0; n < N; ++n) sb_rows[n * 2] = 1.0f, sb_rows[n * 2 + 1] = float(n % 3 + 1);
  ref::fp8_gemm_nt(C.data(), A.data(), sa.data(), B.data(), sb_rows.data(), false, M, N, K);
  for (int64_t n = 0; n < N; ++n) {
    const float v = n < 128 ? 1.0f : 2.0f;
    EXPECT_EQ(C[n], 128 * v + 128 * v * 0.125f * float(n % 3 + 1)) << n;
  }
}

// Where the fp32 partial sums round: 256^2 = 2^16 first, then products of 2^-12, each below
// half an ulp of 2^16 (2^-8). Summed into 2^16 in order of k they vanish; summed by
// themselves in the next K block (the promotion) they add up to 127 * 2^-12, which survives
// (rounded to 4 ulps) when added to C. A single fp32 accumulator over all of K would give 2^16,
// a double one 2^16 + 254 * 2^-12 (rounded: 2^16 + 8 ulps).
TEST(Fp8Gemm, PartialSumsRoundInFp32InOrderOfKAndArePromotedPerBlock) {
  const int64_t K = 256;
  std::vector<uint8_t> A(K, f32_to_e4m3(std::ldexp(1.0f, -6))), B = A;
  A[0] = B[0] = f32_to_e4m3(256.0f);
  A[255] = f32_to_e4m3(0.0f);
  const std::vector<float> scales = {1.0f, 1.0f};
  float C = NAN;
  ref::fp8_gemm_nt(&C, A.data(), scales.data(), B.data(), scales.data(), false, 1, 1, K);
  const float ulp = std::ldexp(1.0f, -7);
  EXPECT_EQ(C, 65536.0f + 4 * ulp);
  EXPECT_EQ(65536.0f + float(127 * std::ldexp(1.0, -12)), 65536.0f + 4 * ulp);  // the arithmetic above
}

}  // namespace
}  // namespace strata::kernels
