// Causal grouped-query attention: query head h reads key/value head h / (Hq / Hkv).
// scale = 1/sqrt(D). lse (B, Hq, T) is the log-sum-exp of each softmax row (scaled scores),
// saved for backward so that backward never needs the T x T probabilities stored.
//
// past: keys and values of `past` earlier positions precede the T new ones (a KV cache, in
// generation): k and v hold past + T rows per sequence, query t is at position past + t and
// sees keys 0 .. past + t. Each query row is computed as with past = 0 and the whole sequence
// (the same sums in the same order), so cached decoding gives bitwise the rows a full forward
// gives. Backward takes past = 0 only (training).
#pragma once
#include <cstdint>

namespace strata::kernels {
#define STRATA_ATTENTION_OPS                                                                      \
  void attention_forward(float* out /*(B,T,Hq,D)*/, float* lse /*(B,Hq,T)*/,                      \
                         const float* q /*(B,T,Hq,D)*/, const float* k /*(B,past+T,Hkv,D)*/,      \
                         const float* v /*(B,past+T,Hkv,D)*/, int64_t B, int64_t T, int64_t Hq,   \
                         int64_t Hkv, int64_t D, int64_t past = 0);                                \
  /* dq, dk, dv = (overwritten) */                                                                \
  void attention_backward(float* dq /*(B,T,Hq,D)*/, float* dk /*(B,T,Hkv,D)*/,                    \
                          float* dv /*(B,T,Hkv,D)*/, const float* dout /*(B,T,Hq,D)*/,            \
                          const float* q, const float* k, const float* v,                         \
                          const float* out /*(B,T,Hq,D)*/, const float* lse /*(B,Hq,T)*/,         \
                          int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D);
namespace ref { STRATA_ATTENTION_OPS }
namespace cpu { STRATA_ATTENTION_OPS }
#undef STRATA_ATTENTION_OPS
}  // namespace strata::kernels
