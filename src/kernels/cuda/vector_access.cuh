// 16-byte loads and stores for the memory-bound kernels: 8 bf16 or 4 fp32 values per access,
// which is what keeps HBM busy (one 2-byte access per thread leaves most of each memory
// transaction unused). The host side decides whether a launch may take the vector path
// (every pointer 16-byte aligned, and the element counts of the vector part whole packs);
// the kernels keep a scalar path for the tail and for misaligned pointers.
//
// bf16 <-> fp32 here is bit manipulation with the same results as the cuda_bf16.h conversions:
// widening a bf16 is exact (its bits are the high half of the float), narrowing rounds to
// nearest even through __float2bfloat16_rn.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {

constexpr int kBf16PerPack = 8;  // bf16 values in 16 bytes
constexpr int kF32PerPack = 4;   // fp32 values in 16 bytes

// Host: whether p may be read or written 16 bytes at a time.
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

__device__ __forceinline__ float bf16_low(uint32_t word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float bf16_high(uint32_t word) { return __uint_as_float(word & 0xffff0000u); }
__device__ __forceinline__ uint32_t bf16_pair(float low, float high) {
  const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(low));
  const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(high));
  return lo | (hi << 16);
}

// v[0..7] = p[0..7] as fp32. REQUIRES p 16-byte aligned.
__device__ __forceinline__ void load_bf16x8(const bf16* p, float (&v)[kBf16PerPack]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = bf16_low(words[k]);  // little endian: the lower address is the low half
    v[2 * k + 1] = bf16_high(words[k]);
  }
}

// p[0..7] = v[0..7] rounded to bf16 (nearest even). REQUIRES p 16-byte aligned.
__device__ __forceinline__ void store_bf16x8(bf16* p, const float (&v)[kBf16PerPack]) {
  uint4 raw;
  raw.x = bf16_pair(v[0], v[1]);
  raw.y = bf16_pair(v[2], v[3]);
  raw.z = bf16_pair(v[4], v[5]);
  raw.w = bf16_pair(v[6], v[7]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// v[0..3] = p[0..3]. REQUIRES p 16-byte aligned.
__device__ __forceinline__ void load_f32x4(const float* p, float (&v)[kF32PerPack]) {
  const float4 raw = *reinterpret_cast<const float4*>(p);
  v[0] = raw.x;
  v[1] = raw.y;
  v[2] = raw.z;
  v[3] = raw.w;
}

// p[0..3] = v[0..3]. REQUIRES p 16-byte aligned.
__device__ __forceinline__ void store_f32x4(float* p, const float (&v)[kF32PerPack]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

}  // namespace strata::kernels::cuda
