// bfloat16 <-> fp32 on the CPU. bf16 is the top half of an fp32: widening is exact, narrowing
// rounds to nearest, ties to even. Subnormals are kept (no flush to zero), overflow rounds to
// infinity, and a NaN stays a NaN (quiet bit set) with its sign. Pure functions.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace strata::kernels {

inline float bf16_to_f32(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

inline uint16_t f32_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  // Adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when the dropped
  // half is above one half, or equal to it with an odd kept half.
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

}  // namespace strata::kernels

namespace strata::kernels {

// out (n) = f32_to_bf16(in (n)): the compute copy rounded from fp32 master weights, across all
// cores (elements are independent: the result does not depend on the thread count).
void round_to_bf16(uint16_t* out, const float* in, int64_t n);

// A bf16 value in host memory (the CPU backend's emulation of the GPU recipe): the top half of
// an fp32. A type of its own so that templates over the storage type tell it from an integer.
struct Bf16 {
  uint16_t bits = 0;
};
static_assert(sizeof(Bf16) == 2);

inline float to_f32(Bf16 v) { return bf16_to_f32(v.bits); }
inline Bf16 to_bf16(float v) { return Bf16{f32_to_bf16(v)}; }

// The emulated recipes' operands: n bf16 values widened into fp32 (exact), and fp32 results
// narrowed into bf16 (nearest even).
inline std::vector<float> widen(const Bf16* p, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = to_f32(p[i]);
  return out;
}
inline void narrow(Bf16* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
}

}  // namespace strata::kernels
