// The device memory the fp8 recipe's CUDA linear layers (kernels/cuda/fp8_linear.cu) take for
// their quantised operands and fp32 products. Plain C++, so that the planner counts it on any
// build, with the numbers the CUDA backend allocates. Usable from C++17 (nvcc) and C++20.
#pragma once

#include <cstdint>

#include "kernels/micro_batch_shape.h"

namespace strata::kernels {

// One linear layer of N tokens, IC in and OC out: the largest of what its forward, data
// gradient and weight gradient hold at once (fp8_linear.cu's sections, each 256-byte aligned).
uint64_t fp8_linear_operand_bytes(int64_t N, int64_t IC, int64_t OC);
// Every linear layer of a micro-batch of that shape: the projections and dense MLPs at N rows,
// the experts at up to N * K rows, all between C and F wide.
uint64_t fp8_operand_bytes(const MicroBatchShape& shape);

}  // namespace strata::kernels
