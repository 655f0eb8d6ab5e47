// Compact Adam moments: the optimizer's exp_avg (m) and exp_avg_sq (v) kept in fewer bytes than
// fp32, as DeepSeek-V3 (bf16 moments) and bitsandbytes / COAT (8-bit blockwise moments) do.
// The update rule stays AdamW's exactly (kernels/adamw.h): each element's moments are decoded
// to fp32, the fp32 update runs as adamw_step does it, and the new moments are encoded again.
//
// Formats of one tensor's moments of n elements (each of m and v is stored this way):
//   kF32   n floats.
//   kBf16  n bf16 values; encoding rounds to nearest even, or stochastically (below).
//   kInt8  8-bit blockwise dynamic quantisation: n one-byte codes, zero padding to a multiple of
//          16 bytes, then ceil(n / kMomentBlock) fp32 block scales (the block's largest |m|, or
//          for v the largest sqrt(v)). A code indexes a table of 256 values in [-1, 1] (m,
//          signed) or [0, 1] (sqrt(v), unsigned) whose spacing is dense near 0 and coarse near
//          1 (a "dynamic" map: a decimal exponent and a linear fraction over seven decades, see
//          moment_codec.h), so values spanning several orders of magnitude inside a block keep
//          a relative precision; m ~ table[code] * scale, v ~ (table[code] * scale)^2.
//          Encoding picks the nearest table value (or one of the two around x, stochastically).
//
// Stochastic rounding is deterministic: the random bits of element i come from a counter-based
// hash of (seed, i), so a result never depends on threads, tiers or timing; callers derive the
// seed from the step and the tensor. m and v draw from two different streams of one seed.
// The CUDA backend's adamw_step_compact (kernels/cuda/ops.h) is built from the same
// per-element code to write the same bytes; tests/gpu/moments_parity_test.cpp checks it.
// All functions are safe for concurrent use on disjoint buffers.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "kernels/adamw.h"

namespace strata::kernels {

enum class MomentFormat : uint8_t { kF32, kBf16, kInt8 };
const char* moment_format_name(MomentFormat format);  // "fp32", "bf16", "int8"
std::optional<MomentFormat> parse_moment_format(std::string_view name);

inline constexpr int64_t kMomentBlock = 256;

// Bytes of one tensor's m (or v) of n elements in `format`.
uint64_t moment_bytes(MomentFormat format, int64_t n);

struct MomentRounding {
  bool stochastic = false;
  uint64_t seed = 0;
};

namespace cpu {

// Decodes elements [first, first + count) of a stored moment tensor of n elements into out.
// is_v: the tensor is a second moment (unsigned table for kInt8).
void decode_moments(float* out, const void* stored, MomentFormat format, bool is_v, int64_t n, int64_t first,
                    int64_t count);
// Encodes a whole tensor of n elements (nearest rounding). REQUIRES for v: every value >= 0. Decoding what this encodes
// and encoding it again gives the same bytes (checkpoints store decoded moments and rely on it).
void encode_moments(void* stored, const float* in, MomentFormat format, bool is_v, int64_t n);
// The same with a rounding mode: stochastic rounding draws element i's bits from (seed, is_v, i).
void encode_moments(void* stored, const float* in, MomentFormat format, bool is_v, int64_t n,
                    const MomentRounding& rounding);

// AdamW (adamw_step's rule) on a tensor of n elements whose moments are stored in `format`:
// param and grad fp32, m and v in the stored form above, updated in place. For kF32 this is
// adamw_step itself. For kInt8 each block's new moments are encoded with the block's new scale.
// Returns whether every parameter value it wrote is finite, found in the loop that writes them.
bool adamw_step_compact(float* param, const float* grad, void* m, void* v, MomentFormat format, int64_t n,
                        const AdamWParams& p, const MomentRounding& rounding);

}  // namespace cpu
}  // namespace strata::kernels
