// The column ops of kernels/columns.h: copies of a column range between row-major matrices of
// other widths, with DeepSeek's RoPE-dim de-interleave and its inverse, and the fp32 sum over
// heads rounded once.
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/columns.h"

namespace strata::kernels {
namespace {

TEST(ColumnsTest, CopiesAColumnRangeBetweenWidths) {
  // 3 rows of 10; columns 4..7 into rows of 6 at column 1.
  std::vector<float> src(30);
  std::iota(src.begin(), src.end(), 0.0f);
  std::vector<float> dst(18, -1.0f);
  cpu::copy_columns(dst.data() + 1, 6, src.data() + 4, 10, 3, 4, ColumnOrder::kSame);
  EXPECT_EQ(dst, (std::vector<float>{-1, 4, 5, 6, 7, -1, -1, 14, 15, 16, 17, -1, -1, 24, 25, 26, 27, -1}));
}

TEST(ColumnsTest, DeinterleaveTakesEvenDimsThenOddAndInterleaveUndoesIt) {
  const std::vector<float> src = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<float> de(8), back(8);
  cpu::copy_columns(de.data(), 8, src.data(), 8, 1, 8, ColumnOrder::kDeinterleave);
  EXPECT_EQ(de, (std::vector<float>{0, 2, 4, 6, 1, 3, 5, 7}));  // DeepSeek's view(d/2, 2).transpose
  cpu::copy_columns(back.data(), 8, de.data(), 8, 1, 8, ColumnOrder::kInterleave);
  EXPECT_EQ(back, src);
}

TEST(ColumnsTest, HeadSumsAreFp32RoundedOnce) {
  // 2 rows, 3 heads of 4 columns each (the sum over column 1..2 of every head).
  std::vector<float> src(24);
  std::iota(src.begin(), src.end(), 0.0f);
  std::vector<float> sum(4);
  cpu::sum_head_columns(sum.data(), src.data() + 1, 12, 4, 2, 3, 2);
  EXPECT_EQ(sum, (std::vector<float>{1 + 5 + 9, 2 + 6 + 10, 13 + 17 + 21, 14 + 18 + 22}));
  // In bf16: 256 + 1 + 1 is 258 in fp32, one rounding; adding in bf16 would give 256 twice over.
  const std::vector<Bf16> b = {to_bf16(256.0f), to_bf16(1.0f), to_bf16(1.0f)};
  Bf16 out;
  cpu::sum_head_columns(&out, b.data(), 3, 1, 1, 3, 1);
  EXPECT_EQ(to_f32(out), 258.0f);
}

}  // namespace
}  // namespace strata::kernels
