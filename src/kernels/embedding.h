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
}  // namespace strata::kernels
