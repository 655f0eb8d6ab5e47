// The CPU's search of an 8-bit moment table (kernels/moment_codec.h): the index
// moment_table_floor gives (the largest index whose value is <= x), found in a step or two
// instead of eight dependent loads. An index over the fp32 bit patterns of [-1, 1], 32
// buckets per power of two, holds for each bucket the floor of its smallest value, which is
// at or below the floor of any value in the bucket; a scan up the table finishes. Few table
// values share a bucket (at most 2, checked by the tests), so the scan is a step or two.
// Immutable after construction; safe for concurrent use.
#pragma once

#include <array>
#include <bit>
#include <cstdint>

#include "kernels/moment_codec.h"

namespace strata::kernels::cpu {

// fp32 bit patterns mapped to integers in the order of their values.
constexpr uint32_t moment_search_key(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  return (u >> 31) != 0 ? ~u : (u | 0x80000000u);
}
constexpr float moment_search_value(uint32_t key) {
  return std::bit_cast<float>((key >> 31) != 0 ? (key & 0x7FFFFFFFu) : ~key);
}

class MomentTableSearch {
 public:
  explicit MomentTableSearch(const MomentTable& table) : table_(table.value) {
    for (uint32_t b = 0; b < kBuckets; ++b) {
      start_[b] = static_cast<uint8_t>(moment_table_floor(table_, moment_search_value(kKeyMin + (b << kShift))));
    }
  }
  MomentTableSearch(const MomentTableSearch&) = delete;
  MomentTableSearch& operator=(const MomentTableSearch&) = delete;

  // REQUIRES: -1 <= x <= 1 (not NaN).
  int floor(float x) const {
    int lo = start_[(moment_search_key(x) - kKeyMin) >> kShift];
    while (lo < kMomentCodes - 1 && table_[lo + 1] <= x) ++lo;
    return lo;
  }

 private:
  static constexpr int kShift = 18;  // 23 mantissa bits - 5: 32 buckets per power of two
  static constexpr uint32_t kKeyMin = moment_search_key(-1.0f);
  static constexpr uint32_t kBuckets = ((moment_search_key(1.0f) - kKeyMin) >> kShift) + 1;

  const float* table_;
  std::array<uint8_t, kBuckets> start_{};
};

}  // namespace strata::kernels::cpu
