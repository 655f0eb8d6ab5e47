// Element-wise CUDA kernels the decoder's CUDA backend (kernels/cuda/backend.h) needs beyond
// the ops of kernels/cuda/ops.h: fp32 -> bf16 rounding, the bf16 residual / gradient sums and the
// shared expert's sigmoid gate. Device pointers; the stream goes last. The CPU references are
// CpuBf16Ops's (kernels/cpu/backend.h). Usable from C++ (.cpp, C++20) and CUDA (.cu, C++17).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {

// out (n) = round_to_nearest_even_bf16(in)
void f32_to_bf16(bf16* out /*(n)*/, const float* in /*(n)*/, int64_t n, cudaStream_t stream);
// a (n) += b (n): summed in fp32, rounded to bf16 once.
void add_inplace(bf16* a /*(n)*/, const bf16* b /*(n)*/, int64_t n, cudaStream_t stream);
// out (N,C) = round(out + sigmoid(logit[n]) * shared_out), in fp32.
void shared_expert_combine(bf16* out /*(N,C)*/, const bf16* shared_out /*(N,C)*/, const float* logit /*(N)*/,
                           int64_t N, int64_t C, cudaStream_t stream);
// dshared (N,C) = round(s * dout); dlogit (N) = dot(dout, shared_out) * s * (1 - s), s =
// sigmoid(logit[n]); one warp per token, a fixed-order warp reduction.
void shared_expert_backward(bf16* dshared /*(N,C)*/, float* dlogit /*(N)*/, const bf16* dout /*(N,C)*/,
                            const bf16* shared_out /*(N,C)*/, const float* logit /*(N)*/, int64_t N, int64_t C,
                            cudaStream_t stream);

// kernels/columns.h's column ops (order: 0 same, 1 de-interleave, 2 interleave, ColumnOrder's
// values): dst[r*ld_dst + c] = src[r*ld_src + source column of c]; and dst (rows, cols) = the
// fp32 sum over h < heads, in order of h, of src[r*ld_src + h*head_stride + c], rounded once.
void copy_columns(bf16* dst, int64_t ld_dst, const bf16* src, int64_t ld_src, int64_t rows, int64_t cols, int order,
                  cudaStream_t stream);
void sum_head_columns(bf16* dst, const bf16* src, int64_t ld_src, int64_t head_stride, int64_t rows, int64_t heads,
                      int64_t cols, cudaStream_t stream);

}  // namespace strata::kernels::cuda
