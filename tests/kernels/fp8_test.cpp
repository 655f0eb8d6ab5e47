// FP8 numerics: conversions against the OCP definition, block scales, block quantisation and
// the promoting GEMM reference.
#include "kernels/fp8.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace strata::kernels
