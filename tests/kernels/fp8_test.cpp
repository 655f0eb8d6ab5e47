// FP8 numerics: conversions against the OCP definition, block scales, block quantisation and
// the promoting GEMM reference.
#include "kernels/fp8.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
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

}  // namespace
}  // namespace strata::kernels
