// NF4 with double-quantised scales (kernels/nf4.h): the tables as QLoRA and bitsandbytes define
// them, nearest-value indices, the packing, and the error bound the header derives.
#include "kernels/nf4.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace strata::kernels {
namespace {

TEST(Nf4, ValuesAreTheQuantilesQloraPublishes) {
  const std::array<float, 16>& v = nf4_values();
  EXPECT_EQ(v[0], -1.0f);
  EXPECT_EQ(v[7], 0.0f);
  EXPECT_EQ(v[15], 1.0f);
  EXPECT_EQ(v[8], 0.07958029955625534f);
  EXPECT_EQ(v[1], -0.6961928009986877f);
  for (size_t i = 0; i + 1 < v.size(); ++i) EXPECT_LT(v[i], v[i + 1]);
}

TEST(Nf4, ScaleMapIsBitsandbytesSignedDynamicMap) {
  const std::array<float, 256>& m = nf4_scale_map();
  for (size_t i = 0; i + 1 < m.size(); ++i) EXPECT_LT(m[i], m[i + 1]) << i;
  // Values torch gives for create_dynamic_map(signed=True), which builds it in fp32: within an
  // ulp or two of these (rounded once from double).
  EXPECT_EQ(m[127], 0.0f);
  EXPECT_EQ(m[255], 1.0f);
  EXPECT_NEAR(m[0], -0.992968738079071, 2e-7);
  EXPECT_NEAR(m[1], -0.9789062142372131, 2e-7);
  EXPECT_NEAR(m[128], 5.500000384017767e-07, 2e-13);
  EXPECT_NEAR(m[135], 0.00015625001105945557, 4e-11);
  double widest = 0;
  for (size_t i = 0; i + 1 < m.size(); ++i) widest = std::max(widest, double{m[i + 1]} - m[i]);
  EXPECT_NEAR(widest, 0.0140625, 1e-7);
}

// Every index is the nearest value's; at a midpoint, the lower one's.
TEST(Nf4, IndicesAreTheNearestValueTiesDown) {
  const std::array<float, 16>& v = nf4_values();
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int k = 0; k < 20000; ++k) {
    const float x = u(rng);
    const uint8_t q = nf4_index(x);
    for (size_t j = 0; j < v.size(); ++j) ASSERT_LE(std::fabs(x - v[q]), std::fabs(x - v[j])) << x;
  }
  // bitsandbytes' decision tree's thresholds (x > threshold goes up), each within an ulp of the
  // midpoint of its two values.
  const std::vector<std::pair<float, int>> thresholds = {
      {-0.8480964004993439f, 0}, {-0.33967943489551544f, 3}, {-0.045525018125772476f, 6},
      {0.03979014977812767f, 7}, {0.3893125355243683f, 11},  {0.8614784181118011f, 14}};
  for (auto [threshold, below] : thresholds) {
    const size_t i = static_cast<size_t>(below);
    EXPECT_NEAR(threshold, (double{v[i]} + v[i + 1]) / 2, 6e-8) << threshold;
    EXPECT_EQ(nf4_index(threshold), below) << threshold;
    EXPECT_EQ(nf4_index(std::nextafter(threshold, 2.0f)), below + 1) << threshold;
  }
  EXPECT_EQ(nf4_index(0.0f), 7);
  EXPECT_EQ(nf4_index(-1.0f), 0);
  EXPECT_EQ(nf4_index(1.0f), 15);
}

TEST(Nf4, LayoutPacksTwoIndicesPerByteThenCodesScalesAndMean) {
  const Nf4Layout l = nf4_layout(64 * 300 + 3);
  EXPECT_EQ(l.blocks, 301);
  EXPECT_EQ(l.scale_blocks, 2);
  EXPECT_EQ(l.codes_offset, (64u * 300 + 3 + 1) / 2);
  EXPECT_EQ(l.scales_offset % 4, 0u);
  EXPECT_GE(l.scales_offset, l.codes_offset + 301);
  EXPECT_EQ(l.mean_offset, l.scales_offset + 8);
  EXPECT_EQ(l.bytes, l.mean_offset + 4);
  // 4.127 bits per element for a large tensor.
  const Nf4Layout big = nf4_layout(int64_t{1} << 24);
  const double bits = 8.0 * static_cast<double>(big.bytes) / static_cast<double>(big.elements);
  EXPECT_NEAR(bits, 4.0 + 8.0 / 64 + 32.0 / (64 * 256), 1e-4);
}

TEST(Nf4, FirstElementInTheHighNibble) {
  std::vector<float> x(64, 0.0f);
  x[0] = 1.0f;    // index 15
  x[1] = -1.0f;   // index 0
  x[2] = 0.08f;   // index 8
  std::vector<uint8_t> q(nf4_layout(64).bytes);
  nf4_quantize(x.data(), 64, q.data());
  EXPECT_EQ(q[0], 0xF0);
  EXPECT_EQ(q[1], 0x87);
  EXPECT_EQ(q[2], 0x77);  // zeros
  std::vector<float> back(64);
  nf4_dequantize(q.data(), 64, back.data());
  // One block: its absmax is the mean, stored exactly.
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], -1.0f);
  EXPECT_EQ(back[2], 0.07958029955625534f);
  EXPECT_EQ(back[3], 0.0f);
}

// Weights of a linear layer's scale, with blocks whose absmax differ by orders of magnitude.
TEST(Nf4, RoundTripWithinTheDerivedBound) {
  for (int64_t n : {int64_t{1}, int64_t{63}, int64_t{64}, int64_t{65}, int64_t{64 * 256}, int64_t{64 * 700 + 17}}) {
    std::mt19937 rng(static_cast<uint32_t>(n));
    std::normal_distribution<float> normal(0.0f, 0.02f);
    std::vector<float> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = normal(rng) * ((i / 64) % 5 == 0 ? 30.0f : 1.0f);
    const Nf4Layout l = nf4_layout(n);
    std::vector<uint8_t> q(l.bytes, 0xAB);
    nf4_quantize(x.data(), n, q.data());
    std::vector<float> back(static_cast<size_t>(n));
    nf4_dequantize(q.data(), n, back.data());
    float mean = 0;
    std::memcpy(&mean, q.data() + l.mean_offset, 4);
    for (int64_t b = 0; b < l.blocks; ++b) {
      float a = 0;
      for (int64_t i = b * 64; i < std::min(n, b * 64 + 64); ++i) a = std::max(a, std::fabs(x[static_cast<size_t>(i)]));
      float s = 0;
      std::memcpy(&s, q.data() + l.scales_offset + 4 * static_cast<uint64_t>(b / 256), 4);
      const double a_err = std::fabs(double{nf4_block_absmax(q.data(), n, b)} - a);
      const double a_bound = s * 0.0140625 / 2 * (1 + 1e-5) + 1e-6 * (std::fabs(mean) + a);
      ASSERT_TRUE(a_err <= a_bound) << "n " << n << " block " << b << ": " << a_err << " > " << a_bound;
      for (int64_t i = b * 64; i < std::min(n, b * 64 + 64); ++i) {
        const double err = std::fabs(double{back[static_cast<size_t>(i)]} - x[static_cast<size_t>(i)]);
        const double bound = a * (1.0 - 0.6961928009986877) / 2 * (1 + 1e-5) + a_bound + 1e-6 * a;
        ASSERT_TRUE(err <= bound) << "n " << n << " element " << i << ": " << err << " > " << bound;
      }
    }
  }
}

// A block whose absmax is subnormal (1 / absmax overflows) still quantises to the nearest values.
TEST(Nf4, SubnormalBlocksKeepTheirZerosAndSigns) {
  std::vector<float> x(64, 0.0f);
  x[0] = 1e-39f;
  x[1] = -1e-39f;
  std::vector<uint8_t> q(nf4_layout(64).bytes);
  nf4_quantize(x.data(), 64, q.data());
  EXPECT_EQ(q[0], 0xF0);
  EXPECT_EQ(q[1], 0x77);
  std::vector<float> back(64, 1.0f);
  nf4_dequantize(q.data(), 64, back.data());
  EXPECT_EQ(back[0], 1e-39f);
  EXPECT_EQ(back[1], -1e-39f);
  EXPECT_EQ(back[2], 0.0f);
}

TEST(Nf4, AllZeroBlocksDecodeToZeros) {
  std::vector<float> x(64 * 3, 0.0f);
  for (int i = 64; i < 128; ++i) x[static_cast<size_t>(i)] = 0.5f * ((i % 3) - 1);
  std::vector<uint8_t> q(nf4_layout(192).bytes);
  nf4_quantize(x.data(), 192, q.data());
  std::vector<float> back(192, 1.0f);
  nf4_dequantize(q.data(), 192, back.data());
  for (int i = 0; i < 64; ++i) EXPECT_EQ(back[static_cast<size_t>(i)], 0.0f);
  for (int i = 128; i < 192; ++i) EXPECT_EQ(back[static_cast<size_t>(i)], 0.0f);
  for (int i = 64; i < 128; ++i) EXPECT_NEAR(back[static_cast<size_t>(i)], x[static_cast<size_t>(i)], 0.5 * 0.01);
}

}  // namespace
}  // namespace strata::kernels
