// Token embedding lookup.
#pragma once
#include <cstdint>

namespace strata::kernels {
#define STRATA_EMBEDDING_OPS                                                                      \
  /* out (N, C) = table[tokens] */                                                                \
  void embedding_forward(float* out /*(N,C)*/, const int32_t* tokens /*(N)*/,                     \
                         const float* table /*(V,C)*/, int64_t N, int64_t C);                    \
  /* dtable (V, C) += scatter of dout rows by token */                                            \
  void embedding_backward(float* dtable /*(V,C)*/, const float* dout /*(N,C)*/,                  \
                          const int32_t* tokens /*(N)*/, int64_t N, int64_t C);
namespace ref { STRATA_EMBEDDING_OPS }
namespace cpu { STRATA_EMBEDDING_OPS }
#undef STRATA_EMBEDDING_OPS
namespace cpu {
// The same with the table in row blocks of block_rows rows, each contiguous but not next to the
// others (ParamLayout's vocabulary blocks, paged apart): blocks[b] holds rows [b * block_rows, ...).
void embedding_forward_blocked(float* out /*(N,C)*/, const int32_t* tokens /*(N)*/,
                               const float* const* table_blocks, int64_t block_rows, int64_t N, int64_t C);
void embedding_backward_blocked(float* const* dtable_blocks, int64_t block_rows, const float* dout /*(N,C)*/,
                                const int32_t* tokens /*(N)*/, int64_t N, int64_t C);
}  // namespace cpu
}  // namespace strata::kernels
