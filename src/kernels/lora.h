// Low-rank adapters' ops (model/lora.h): for a frozen linear layer y = x W^T, the adapter adds
//   y += scale * (drop(x) A^T) B^T,   A (R, IC), B (OC, R),
// and its backward, with t = drop(x) A^T (N, R) recomputed rather than saved:
//   dB += scale * dy^T t,  dt = scale * dy B,  dA += dt^T drop(x),  dx += drop'(dt A).
// drop is inverted dropout on the adapter's input: element (row, col) of x is kept, times
// 1 / (1 - p), unless lora_dropped(seed, row * IC + col, p); the mask is a hash of the seed and
// the element's index, so backward and every backend draw the same one without storing it.
#pragma once

#include <cstdint>

#include "kernels/adamw_element.h"  // STRATA_HOST_DEVICE

namespace strata::kernels {

struct LoraDropout {
  float p = 0;          // 0: no dropout
  uint64_t seed = 0;    // one per adapted layer and micro-batch
  int64_t row0 = 0;     // the first row's index in the micro-batch (token tiles)
};

// Whether element `index` is dropped: a splitmix64 hash of (seed, index) below p * 2^64. The
// same function on the host and in the CUDA kernels (kernels/cuda/lora.cu).
STRATA_HOST_DEVICE bool lora_dropped(uint64_t seed, uint64_t index, float p) {
  uint64_t z = seed + (index + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  // p * 2^53 on the top 53 bits: exact in double, the same on every backend.
  return static_cast<double>(z >> 11) < static_cast<double>(p) * 0x1.0p53;
}

namespace cpu {
// fp32 forms of the ops (the CPU backends widen and round around them, kernels/cpu/backend.h).
// dA and dB may be null (not accumulated: an adapter that is not trained).
// `round` (n values in place) is what the recipe rounds its activations with, applied where the
// backend's outputs are stored: to drop(x), t, y, dt and dx.
using RoundFn = void (*)(float* values, int64_t n);
void lora_forward(float* y /*(N,OC) in/out*/, float* t /*(N,R) out*/, const float* x /*(N,IC)*/,
                  const float* A /*(R,IC)*/, const float* B /*(OC,R)*/, float scale, const LoraDropout& drop,
                  int64_t N, int64_t IC, int64_t OC, int64_t R, RoundFn round);
void lora_backward(float* dx /*(N,IC) in/out or null*/, float* dA /*(R,IC)*/, float* dB /*(OC,R)*/,
                   const float* dy /*(N,OC)*/, const float* x /*(N,IC)*/, const float* A, const float* B,
                   float scale, const LoraDropout& drop, int64_t N, int64_t IC, int64_t OC, int64_t R,
                   RoundFn round);
}  // namespace cpu

}  // namespace strata::kernels
