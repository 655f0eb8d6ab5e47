// Element-wise CUDA kernels CudaLlama needs beyond kernels/cuda/ops.h: the fp32 -> bf16
// conversion of the compute copy and the bf16 residual / gradient sums. Device pointers; the
// stream goes last. Usable from C++ (.cpp, C++20) and CUDA (.cu, C++17).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/ops.h"

namespace strata::model::cuda {

using kernels::cuda::bf16;

// out (n) = round_to_nearest_even_bf16(in)
void f32_to_bf16(bf16* out /*(n)*/, const float* in /*(n)*/, int64_t n, cudaStream_t stream);
// a (n) += b (n): summed in fp32, rounded to bf16 once.
void add_inplace(bf16* a /*(n)*/, const bf16* b /*(n)*/, int64_t n, cudaStream_t stream);

}  // namespace strata::model::cuda
