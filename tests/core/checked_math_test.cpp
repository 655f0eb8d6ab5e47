#include "core/checked_math.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

namespace strata {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();

TEST(CheckedMath, ExactResultsPassThrough) {
  EXPECT_EQ(checked_add(int64_t{40}, int64_t{2}), 42);
  EXPECT_EQ(checked_mul(int64_t{-6}, int64_t{7}), -42);
  EXPECT_EQ(checked_add(kMax - 1, int64_t{1}), kMax);
  EXPECT_EQ(checked_product(int64_t{2}, int64_t{3}, int64_t{7}), 42);
  EXPECT_EQ(checked_mul(uint64_t{1} << 32, uint64_t{1} << 31), uint64_t{1} << 63);
}

TEST(CheckedMath, OverflowIsReportedNotWrapped) {
  EXPECT_FALSE(checked_add(kMax, int64_t{1}).has_value());  // the step after 2^63-1
  EXPECT_FALSE(checked_add(kMin, int64_t{-1}).has_value());
  EXPECT_FALSE(checked_mul(int64_t{1} << 32, int64_t{1} << 31).has_value());
  EXPECT_FALSE(checked_mul(kMin, int64_t{-1}).has_value());
  EXPECT_FALSE(checked_mul(uint64_t{1} << 32, uint64_t{1} << 32).has_value());
  // Overflow in a middle factor is not hidden by a later zero.
  EXPECT_FALSE(checked_product(int64_t{1} << 40, int64_t{1} << 40, int64_t{0}).has_value());
}

}  // namespace
}  // namespace strata
