#include "kernels/nf4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace strata::kernels {
namespace {

// The published NF4 values (QLoRA, Appendix E; bitsandbytes' NF4 table), exact in fp32.
constexpr std::array<float, 16> kNf4 = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
    -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,
    0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
    0.7229568362236023f, 1.0f};

// The decision thresholds between consecutive NF4 values, as bitsandbytes compares them (its
// quantisation tree): the midpoints, printed in decimal and read as fp32. The exact midpoint of
// 0.72296 and 1 is a tie between two fp32 values, which rounding to even sends up while the
// published decimal reads as the lower, so the thresholds are taken as published.
constexpr std::array<float, 15> kNf4Thresholds = {
    -0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f, 0.2035212516784668f, 0.2920137718319893f, 0.3893125355243683f,
    0.5016634166240692f, 0.6427869200706482f, 0.8614784181118011f};

// Midpoints of consecutive values of an ascending table, computed in double and rounded once.
template <size_t N>
std::array<float, N - 1> midpoints(const std::array<float, N>& values) {
  std::array<float, N - 1> m{};
  for (size_t i = 0; i + 1 < N; ++i)
    m[i] = static_cast<float>((static_cast<double>(values[i]) + static_cast<double>(values[i + 1])) / 2);
  return m;
}

// The entries above `x`'s nearest: the number of midpoints strictly below x (ties go down).
template <size_t M>
uint8_t nearest(const std::array<float, M>& mids, float x) {
  return static_cast<uint8_t>(std::lower_bound(mids.begin(), mids.end(), x) - mids.begin());
}

std::array<float, 256> make_scale_map() {
  std::vector<double> v = {0.0, 1.0};
  for (int i = 0; i < 7; ++i) {
    const int points = (1 << i) + 1;  // linspace(0.1, 1, 2^i + 1)
    const double scale = std::pow(10.0, i - 6);
    for (int k = 0; k + 1 < points; ++k) {
      const double lo = 0.1 + 0.9 * k / (points - 1), hi = 0.1 + 0.9 * (k + 1) / (points - 1);
      v.push_back(scale * (lo + hi) / 2);
      v.push_back(-scale * (lo + hi) / 2);
    }
  }
  std::sort(v.begin(), v.end());
  std::array<float, 256> map{};
  for (size_t i = 0; i < map.size(); ++i) map[i] = static_cast<float>(v[i]);
  return map;
}

const std::array<float, 255>& scale_midpoints() {
  static const std::array<float, 255> m = midpoints(nf4_scale_map());
  return m;
}

float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

void store_f32(uint8_t* p, float v) { std::memcpy(p, &v, sizeof v); }

}  // namespace

const std::array<float, 16>& nf4_values() { return kNf4; }

uint8_t nf4_index(float normalized) { return nearest(kNf4Thresholds, normalized); }

const std::array<float, 256>& nf4_scale_map() {
  static const std::array<float, 256> map = make_scale_map();
  return map;
}

uint8_t nf4_scale_index(float normalized) { return nearest(scale_midpoints(), normalized); }

Nf4Layout nf4_layout(int64_t n) {
  Nf4Layout l;
  l.elements = n;
  l.blocks = (n + kNf4Block - 1) / kNf4Block;
  l.scale_blocks = (l.blocks + kNf4ScaleBlock - 1) / kNf4ScaleBlock;
  l.indices_offset = 0;
  l.codes_offset = static_cast<uint64_t>((n + 1) / 2);
  l.scales_offset = (l.codes_offset + static_cast<uint64_t>(l.blocks) + 3) / 4 * 4;
  l.mean_offset = l.scales_offset + 4 * static_cast<uint64_t>(l.scale_blocks);
  l.bytes = l.mean_offset + 4;
  return l;
}

void nf4_quantize(const float* x, int64_t n, uint8_t* out) {
  const Nf4Layout l = nf4_layout(n);
  std::memset(out, 0, l.bytes);
  std::vector<float> absmax(static_cast<size_t>(l.blocks));
  uint8_t* indices = out + l.indices_offset;
  for (int64_t b = 0; b < l.blocks; ++b) {
    const int64_t first = b * kNf4Block, end = std::min(n, first + kNf4Block);
    float a = 0.0f;
    for (int64_t i = first; i < end; ++i) a = std::max(a, std::fabs(x[i]));
    absmax[static_cast<size_t>(b)] = a;
    const float inv = a > 0.0f ? 1.0f / a : 0.0f;  // an all-zero block: every index is zero's
    const bool subnormal = !std::isfinite(inv);      // 1 / a overflows: divide instead
    for (int64_t i = first; i < end; ++i) {
      const uint8_t q = nf4_index(subnormal ? x[i] / a : x[i] * inv);
      indices[i / 2] |= static_cast<uint8_t>(i % 2 == 0 ? q << 4 : q);
    }
  }
  // Double quantisation of the absmax values around their mean (summed in double, in order).
  double sum = 0.0;
  for (float a : absmax) sum += a;
  const float mean = l.blocks > 0 ? static_cast<float>(sum / static_cast<double>(l.blocks)) : 0.0f;
  store_f32(out + l.mean_offset, mean);
  for (int64_t s = 0; s < l.scale_blocks; ++s) {
    const int64_t first = s * kNf4ScaleBlock, end = std::min(l.blocks, first + kNf4ScaleBlock);
    float scale = 0.0f;
    for (int64_t b = first; b < end; ++b) scale = std::max(scale, std::fabs(absmax[static_cast<size_t>(b)] - mean));
    store_f32(out + l.scales_offset + 4 * static_cast<uint64_t>(s), scale);
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    const bool subnormal = !std::isfinite(inv);
    for (int64_t b = first; b < end; ++b) {
      const float d = absmax[static_cast<size_t>(b)] - mean;
      out[l.codes_offset + static_cast<uint64_t>(b)] = nf4_scale_index(subnormal ? d / scale : d * inv);
    }
  }
}

float nf4_block_absmax(const uint8_t* q, int64_t n, int64_t b) {
  const Nf4Layout l = nf4_layout(n);
  const float scale = load_f32(q + l.scales_offset + 4 * static_cast<uint64_t>(b / kNf4ScaleBlock));
  return nf4_scale_map()[q[l.codes_offset + static_cast<uint64_t>(b)]] * scale + load_f32(q + l.mean_offset);
}

void nf4_dequantize(const uint8_t* q, int64_t n, float* x) {
  const Nf4Layout l = nf4_layout(n);
  const uint8_t* indices = q + l.indices_offset;
  for (int64_t b = 0; b < l.blocks; ++b) {
    const float a = nf4_block_absmax(q, n, b);
    const int64_t first = b * kNf4Block, end = std::min(n, first + kNf4Block);
    for (int64_t i = first; i < end; ++i) {
      const uint8_t byte = indices[i / 2];
      x[i] = kNf4[i % 2 == 0 ? byte >> 4 : byte & 0x0F] * a;
    }
  }
}

}  // namespace strata::kernels
