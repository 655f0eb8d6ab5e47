// The CUDA side of NF4 (kernels/nf4.h): a frozen base stored as NF4 is dequantised into bf16
// tiles that the bf16 GEMMs then read. The decoded values are bitwise the CPU reference's
// (kernels::nf4_dequantize) rounded to bf16: the same fp32 products and sums, unfused.
//
// Every pointer is DEVICE memory, the launcher takes its stream last. Usable from C++ (.cpp,
// C++20) and CUDA (.cu, C++17).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/ops.h"
#include "kernels/nf4.h"

namespace strata::kernels::cuda {

// The n elements of the NF4 tensor `q` (nf4_layout(n).bytes, 4-byte aligned) into out (n bf16).
void nf4_dequantize_bf16(bf16* out, const uint8_t* q, int64_t n, cudaStream_t stream);

}  // namespace strata::kernels::cuda
