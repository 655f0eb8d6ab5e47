// LM head fused with cross-entropy, computed chunk_tokens tokens at a time so that the full
// logits (N x V fp32) are never materialised: for each chunk, logits = x @ weight^T, softmax,
// loss, and the gradient (softmax - onehot) * grad_scale flows straight into dx and dweight.
#pragma once
#include <cstdint>

namespace strata::kernels {
#define STRATA_CROSS_ENTROPY_OPS                                                                  \
  /* Returns the SUM over tokens with target >= 0 of -log softmax(logits)[target] (targets < 0   \
     are ignored: masked positions). Gradients are of grad_scale * that sum, so a caller that    \
     passes grad_scale = 1 / (valid tokens in the whole step) gets the mean loss's gradient.     \
     dx (N,C) = (skipped when null); dweight (V,C) += (skipped when null). */                     \
  double lm_head_cross_entropy(float* dx /*(N,C)*/, float* dweight /*(V,C)*/,                     \
                               const float* x /*(N,C)*/, const float* weight /*(V,C)*/,           \
                               const int32_t* targets /*(N)*/, int64_t N, int64_t C, int64_t V,   \
                               float grad_scale, int64_t chunk_tokens);
namespace ref { STRATA_CROSS_ENTROPY_OPS }
namespace cpu { STRATA_CROSS_ENTROPY_OPS }
#undef STRATA_CROSS_ENTROPY_OPS
namespace cpu {
// The same with weight (and dweight) in row blocks of block_rows rows (the last may be shorter),
// each contiguous but not next to the others (ParamLayout's vocabulary blocks, paged apart):
// weight_blocks[b] holds rows [b * block_rows, ...). dx sums over the blocks in block order.
double lm_head_cross_entropy_blocked(float* dx /*(N,C)*/, float* const* dweight_blocks,
                                     const float* x /*(N,C)*/, const float* const* weight_blocks,
                                     int64_t block_rows, const int32_t* targets /*(N)*/, int64_t N,
                                     int64_t C, int64_t V, float grad_scale, int64_t chunk_tokens);
}  // namespace cpu
}  // namespace strata::kernels
