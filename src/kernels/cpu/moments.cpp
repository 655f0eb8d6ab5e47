// Compact Adam moments on the CPU (kernels/moments.h). The per-element encodings and the update
// are the shared ones (kernels/moment_codec.h, kernels/adamw_element.h); this file holds the
// loops, the 8-bit block layout and the parallelism.
//
// Contraction is turned off as in adamw.cpp: the update must round like the reference.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "kernels/moments.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "kernels/adamw_element.h"
#include "kernels/cpu/moment_search.h"
#include "kernels/moment_codec.h"

namespace strata::kernels {

const char* moment_format_name(MomentFormat format) {
  switch (format) {
    case MomentFormat::kF32:
      return "fp32";
    case MomentFormat::kBf16:
      return "bf16";
    case MomentFormat::kInt8:
      return "int8";
  }
  return "?";
}

std::optional<MomentFormat> parse_moment_format(std::string_view name) {
  for (MomentFormat f : {MomentFormat::kF32, MomentFormat::kBf16, MomentFormat::kInt8}) {
    if (name == moment_format_name(f)) return f;
  }
  return std::nullopt;
}

namespace {

int64_t int8_codes_bytes(int64_t n) { return (n + 15) / 16 * 16; }
int64_t int8_blocks(int64_t n) { return (n + kMomentBlock - 1) / kMomentBlock; }

}  // namespace

uint64_t moment_bytes(MomentFormat format, int64_t n) {
  CHECK(n >= 0);
  switch (format) {
    case MomentFormat::kF32:
      return static_cast<uint64_t>(n) * 4;
    case MomentFormat::kBf16:
      return static_cast<uint64_t>(n) * 2;
    case MomentFormat::kInt8:
      return static_cast<uint64_t>(int8_codes_bytes(n) + 4 * int8_blocks(n));
  }
  CHECK_MSG(false, "unknown moment format");
  return 0;
}

namespace cpu {
namespace {

// The 8-bit layout of one tensor: n codes, zero padding to 16 bytes, then the block scales.
// The scales are read and written with memcpy, so the caller's buffer needs no alignment.
struct Int8View {
  uint8_t* codes;
  uint8_t* scales;  // float per block

  Int8View(void* stored, int64_t n) : codes(static_cast<uint8_t*>(stored)), scales(codes + int8_codes_bytes(n)) {}
  float scale(int64_t block) const {
    float s;
    std::memcpy(&s, scales + 4 * block, 4);
    return s;
  }
  void set_scale(int64_t block, float s) { std::memcpy(scales + 4 * block, &s, 4); }
};

const float* table_of(bool is_v) { return is_v ? kMomentTableV.value : kMomentTableM.value; }

const MomentTableSearch& search_of(bool is_v) {
  static const MomentTableSearch m(kMomentTableM), v(kMomentTableV);
  return is_v ? v : m;
}

float int8_decode(const float* table, uint8_t code, float scale, bool is_v) {
  const float x = mul_rn(table[code], scale);
  return is_v ? mul_rn(x, x) : x;
}

// Encodes `count` (<= kMomentBlock) values of block `block`, whose first element is element
// `first` of the tensor (the index the random bits are drawn for). For v, `in` holds v itself.
void int8_encode_block(Int8View view, int64_t block, const float* in, int64_t first, int64_t count, bool is_v,
                       bool stochastic, uint64_t key) {
  const float* table = table_of(is_v);
  float x[kMomentBlock];
  float scale = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    x[j] = is_v ? sqrt_rn(in[j]) : in[j];
    // fmax's rule (a NaN is skipped) without its library call; max is order-free.
    const float a = std::fabs(x[j]);
    scale = a > scale ? a : scale;
  }
  view.set_scale(block, scale);
  uint8_t* codes = view.codes + first;
  const int zero = is_v ? kUnsignedZeroCode : kSignedZeroCode;
  if (scale == 0.0f) {
    for (int64_t j = 0; j < count; ++j) codes[j] = static_cast<uint8_t>(zero);
    return;
  }
  const MomentTableSearch& search = search_of(is_v);
  for (int64_t j = 0; j < count; ++j) {
    const uint64_t random = stochastic ? moment_random_bits(key, static_cast<uint64_t>(first + j)) : 0;
    const float xs = div_rn(x[j], scale);
    // |x| <= scale keeps xs in [-1, 1]; NaN (and anything else) takes the plain search.
    const int lo = (xs >= -1.0f && xs <= 1.0f) ? search.floor(xs) : moment_table_floor(table, xs);
    codes[j] = static_cast<uint8_t>(moment_int8_round(table, xs, lo, is_v, stochastic, random));
  }
}

// Above this many elements the loops run across all cores (OpenMP); below, one thread is faster.
constexpr int64_t kParallelElements = int64_t{1} << 16;

}  // namespace

void decode_moments(float* out, const void* stored, MomentFormat format, bool is_v, int64_t n, int64_t first,
                    int64_t count) {
  CHECK(n >= 0 && first >= 0 && count >= 0 && first + count <= n);
  if (count == 0) return;  // out may be null then (an empty vector's data())
  switch (format) {
    case MomentFormat::kF32:
      std::memcpy(out, static_cast<const float*>(stored) + first, static_cast<size_t>(count) * 4);
      return;
    case MomentFormat::kBf16: {
      const uint16_t* in = static_cast<const uint16_t*>(stored) + first;
      for (int64_t i = 0; i < count; ++i) out[i] = moment_bf16_decode(in[i]);
      return;
    }
    case MomentFormat::kInt8: {
      const Int8View view(const_cast<void*>(stored), n);
      const float* table = table_of(is_v);
      for (int64_t i = first; i < first + count; ++i) {
        out[i - first] = int8_decode(table, view.codes[i], view.scale(i / kMomentBlock), is_v);
      }
      return;
    }
  }
}

void encode_moments(void* stored, const float* in, MomentFormat format, bool is_v, int64_t n,
                    const MomentRounding& rounding) {
  CHECK(n >= 0);
  if (n == 0) return;  // the pointers may be null then
  const uint64_t key = moment_stream_key(rounding.seed, is_v);
  switch (format) {
    case MomentFormat::kF32:
      std::memcpy(stored, in, static_cast<size_t>(n) * 4);
      return;
    case MomentFormat::kBf16: {
      uint16_t* out = static_cast<uint16_t*>(stored);
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t random = rounding.stochastic ? moment_random_bits(key, static_cast<uint64_t>(i)) : 0;
        out[i] = moment_bf16_encode(in[i], rounding.stochastic, random);
      }
      return;
    }
    case MomentFormat::kInt8: {
      Int8View view(stored, n);
      std::memset(view.codes + n, 0, static_cast<size_t>(int8_codes_bytes(n) - n));
      for (int64_t b = 0; b < int8_blocks(n); ++b) {
        const int64_t first = b * kMomentBlock;
        int8_encode_block(view, b, in + first, first, std::min(kMomentBlock, n - first), is_v, rounding.stochastic,
                          key);
      }
      return;
    }
  }
}

void encode_moments(void* stored, const float* in, MomentFormat format, bool is_v, int64_t n) {
  encode_moments(stored, in, format, is_v, n, MomentRounding{});
}

namespace {

// Whether x[0, n) are all finite: the exact second look behind a running sum that was not
// (below). Reached only when a parameter is NaN or Inf, or finite ones sum past FLT_MAX.
bool all_finite(const float* x, int64_t n) {
  uint32_t nonfinite = 0;
  for (int64_t i = 0; i < n; ++i) nonfinite |= nonfinite_bits(x[i]);
  return nonfinite == 0;
}

}  // namespace

bool adamw_step_compact(float* param, const float* grad, void* m, void* v, MomentFormat format, int64_t n,
                        const AdamWParams& p, const MomentRounding& rounding) {
  CHECK(n >= 0);
  if (format == MomentFormat::kF32)
    return adamw_step(param, grad, static_cast<float*>(m), static_cast<float*>(v), n, p);
  const AdamWScalars s = adamw_scalars(p);
  const bool stochastic = rounding.stochastic;
  const uint64_t key_m = moment_stream_key(rounding.seed, false);
  const uint64_t key_v = moment_stream_key(rounding.seed, true);
  // The finiteness check of these scalar loops is one add per element: the sum of the new
  // parameters is NaN or Inf when one of them is (and, rarely, when finite ones overflow it, so
  // a sum that is not finite is confirmed by all_finite). ORing each element's nonfinite_bits
  // costs three operations, 13% of the bf16 loop's time on data in cache; the add costs 3%.
  float sum = 0.0f;
  if (format == MomentFormat::kBf16) {
    uint16_t* mb = static_cast<uint16_t*>(m);
    uint16_t* vb = static_cast<uint16_t*>(v);
#pragma omp parallel for schedule(static) reduction(+ : sum) if (n >= kParallelElements)
    for (int64_t i = 0; i < n; ++i) {
      float mi = moment_bf16_decode(mb[i]), vi = moment_bf16_decode(vb[i]);
      adamw_update_element(grad[i], param[i], mi, vi, s);
      sum += param[i];
      const uint64_t index = static_cast<uint64_t>(i);
      mb[i] = moment_bf16_encode(mi, stochastic, stochastic ? moment_random_bits(key_m, index) : 0);
      vb[i] = moment_bf16_encode(vi, stochastic, stochastic ? moment_random_bits(key_v, index) : 0);
    }
    return std::isfinite(sum) || all_finite(param, n);
  }
  CHECK_MSG(format == MomentFormat::kInt8, "unknown moment format");
  Int8View mv(m, n), vv(v, n);
  const int64_t blocks = int8_blocks(n);
#pragma omp parallel for schedule(static) reduction(+ : sum) if (n >= kParallelElements)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * kMomentBlock;
    const int64_t count = std::min(kMomentBlock, n - first);
    float mx[kMomentBlock], vx[kMomentBlock];
    const float m_scale = mv.scale(b), v_scale = vv.scale(b);
    for (int64_t j = 0; j < count; ++j) {
      mx[j] = int8_decode(kMomentTableM.value, mv.codes[first + j], m_scale, false);
      vx[j] = int8_decode(kMomentTableV.value, vv.codes[first + j], v_scale, true);
      adamw_update_element(grad[first + j], param[first + j], mx[j], vx[j], s);
      sum += param[first + j];
    }
    int8_encode_block(mv, b, mx, first, count, false, stochastic, key_m);
    int8_encode_block(vv, b, vx, first, count, true, stochastic, key_v);
  }
  return std::isfinite(sum) || all_finite(param, n);
}

}  // namespace cpu
}  // namespace strata::kernels
