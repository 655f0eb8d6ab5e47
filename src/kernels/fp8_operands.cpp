#include "kernels/fp8_operands.h"

#include <algorithm>

#include "core/round_up.h"
#include "kernels/fp8.h"

namespace strata::kernels {
namespace {

uint64_t aligned_bytes(int64_t bytes) { return static_cast<uint64_t>(round_up(bytes, 256)); }
// codes (rows, cols) and 1 x 128 tile scales (rows, fp8_blocks(cols)).
uint64_t tiles_bytes(int64_t rows, int64_t cols) {
  return aligned_bytes(rows * cols) + aligned_bytes(rows * fp8_blocks(cols) * 4);
}

}  // namespace

uint64_t fp8_linear_operand_bytes(int64_t N, int64_t IC, int64_t OC) {
  const int64_t Mp = round_up(N, 16);
  const uint64_t forward = tiles_bytes(Mp, IC) + aligned_bytes(Mp * OC * 4);
  const uint64_t data_grad =
      tiles_bytes(Mp, OC) + aligned_bytes(static_cast<int64_t>(fp8_matrix_bytes(IC, OC))) + aligned_bytes(Mp * IC * 4);
  const uint64_t weight_grad = tiles_bytes(OC, Mp) + tiles_bytes(IC, Mp);
  return std::max(forward, std::max(data_grad, weight_grad));
}

uint64_t fp8_operand_bytes(const MicroBatchShape& s) {
  const int64_t rows = s.N * std::max<int64_t>(s.K, 1) * std::max<int64_t>(s.P, 1);
  const int64_t F = std::max(s.F, s.C);
  return std::max(fp8_linear_operand_bytes(rows, s.C, F), fp8_linear_operand_bytes(rows, F, s.C));
}

}  // namespace strata::kernels
