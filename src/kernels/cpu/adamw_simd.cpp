// AdamW on host-resident optimizer chunks: AVX-512 and AVX2 kernels chosen at run time, each
// bitwise equal to kernels::ref::adamw_step (see adamw.cpp for the operation order).
//
// The vector code issues one intrinsic per operation of the reference, in the same order.
// GCC implements the arithmetic intrinsics as plain vector operators, so it could fuse a
// multiply and an add into an FMA (one rounding instead of two) like any other expression;
// contraction is therefore turned off for this file, before the intrinsic headers are read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "kernels/adamw_simd.h"

// GCC 12's AVX-512 headers make false -Wmaybe-uninitialized reports (GCC PR 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string_view>

#include "core/check.h"
#include "core/log.h"
#include "kernels/adamw_element.h"
#include "kernels/bf16.h"

#define STRATA_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define STRATA_TARGET_AVX2 __attribute__((target("avx2")))

namespace strata::kernels {
namespace {

// Elements per OpenMP work item: 64K fp32 = 256 KiB per array, large enough that scheduling
// is free and small enough that the tail block of a chunk does not leave cores idle for long.
constexpr int64_t kBlock = int64_t{1} << 16;

// The scalars every level multiplies by, shared with the reference (kernels/adamw.h).
using Scalars = AdamWScalars;
inline Scalars make_scalars(const AdamWParams& p) { return adamw_scalars(p); }

// ---- scalar -------------------------------------------------------------------------------

// One element, in the reference's order. Also the tail of the AVX2 kernel.
template <bool kSmall>
inline float update_one(float g, float& w, float& m, float& v, const Scalars& s) {
  const float wd = w * s.decay;
  const float mi = kSmall ? m + s.lerp_factor * (g - m) : g - (g - m) * s.lerp_factor;
  float vi = v * s.beta2;
  vi = vi + s.one_minus_b2 * g * g;
  const float denom = std::sqrt(vi) / s.bc2_sqrt + s.eps;
  w = wd + s.neg_step_size * mi / denom;
  m = mi;
  v = vi;
  return w;
}

// Each kernel returns whether every new w it wrote is finite.
// fp32 gradients, read as g * gs (the clip coefficient; 1 leaves them as they are); when out is
// set, the new w also rounded to bf16 into it.
template <bool kSmall>
bool f32_scalar(float* w, const float* g, float gs, float* m, float* v, uint16_t* out, int64_t n, const Scalars& s) {
  uint32_t nonfinite = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float wi = update_one<kSmall>(g[i] * gs, w[i], m[i], v[i], s);
    if (out != nullptr) out[i] = f32_to_bf16(wi);
    nonfinite |= nonfinite_bits(wi);
  }
  return nonfinite == 0;
}

template <bool kSmall>
bool mixed_scalar(float* w, const uint16_t* g, float* m, float* v, uint16_t* out, int64_t n, const Scalars& s) {
  uint32_t nonfinite = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float wi = update_one<kSmall>(bf16_to_f32(g[i]), w[i], m[i], v[i], s);
    out[i] = f32_to_bf16(wi);
    nonfinite |= nonfinite_bits(wi);
  }
  return nonfinite == 0;
}

// ---- AVX-512 ------------------------------------------------------------------------------

struct Vec512 {
  __m512 decay, lerp_factor, beta2, one_minus_b2, bc2_sqrt, eps, neg_step_size;
};

STRATA_TARGET_AVX512 inline Vec512 broadcast512(const Scalars& s) {
  return {_mm512_set1_ps(s.decay),        _mm512_set1_ps(s.lerp_factor), _mm512_set1_ps(s.beta2),
          _mm512_set1_ps(s.one_minus_b2), _mm512_set1_ps(s.bc2_sqrt),    _mm512_set1_ps(s.eps),
          _mm512_set1_ps(s.neg_step_size)};
}

// 16 elements: w, m, v are updated in place; returns the new w.
template <bool kSmall>
STRATA_TARGET_AVX512 inline __m512 update512(__m512 g, __m512& w, __m512& m, __m512& v,
                                             const Vec512& c) {
  const __m512 wd = _mm512_mul_ps(w, c.decay);
  const __m512 diff = _mm512_sub_ps(g, m);
  m = kSmall ? _mm512_add_ps(m, _mm512_mul_ps(c.lerp_factor, diff))
             : _mm512_sub_ps(g, _mm512_mul_ps(diff, c.lerp_factor));
  v = _mm512_add_ps(_mm512_mul_ps(v, c.beta2), _mm512_mul_ps(_mm512_mul_ps(c.one_minus_b2, g), g));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), c.bc2_sqrt), c.eps);
  w = _mm512_add_ps(wd, _mm512_div_ps(_mm512_mul_ps(c.neg_step_size, m), denom));
  return w;
}

// The finiteness check of the vector kernels (nonfinite_bits in adamw_element.h, a vector at a
// time): `check` starts at 0 and ORs in the bits of x - x for every vector x written, which are
// 0 for a finite x and a NaN's for NaN or Inf, so it stays 0 exactly when everything written
// was finite. One test at the end of the loop.
STRATA_TARGET_AVX512 inline __m512i fold_finite512(__m512i check, __m512 x) {
  return _mm512_or_si512(check, _mm512_castps_si512(_mm512_sub_ps(x, x)));
}
STRATA_TARGET_AVX512 inline bool all_finite512(__m512i check) { return _mm512_test_epi32_mask(check, check) == 0; }

STRATA_TARGET_AVX512 inline __m512 widen_bf16_512(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Round to nearest even with integer arithmetic, as f32_to_bf16 does. (VCVTNEPS2BF16 would
// flush subnormals to zero, so it is not used.)
STRATA_TARGET_AVX512 inline __m256i narrow_bf16_512(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i rounding =
      _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(high, _mm512_set1_epi32(1)));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, rounding), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(high, _mm512_set1_epi32(0x0040)));
  return _mm512_cvtepi32_epi16(r);
}

template <bool kSmall>
STRATA_TARGET_AVX512 bool f32_avx512(float* w, const float* g, float gs, float* m, float* v, uint16_t* out, int64_t n,
                                     const Scalars& s) {
  const Vec512 c = broadcast512(s);
  const __m512 scale = _mm512_set1_ps(gs);
  __m512i check = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 wi = _mm512_loadu_ps(w + i), mi = _mm512_loadu_ps(m + i), vi = _mm512_loadu_ps(v + i);
    update512<kSmall>(_mm512_mul_ps(_mm512_loadu_ps(g + i), scale), wi, mi, vi, c);
    _mm512_storeu_ps(w + i, wi);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    if (out != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), narrow_bf16_512(wi));
    check = fold_finite512(check, wi);
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 wi = _mm512_maskz_loadu_ps(k, w + i), mi = _mm512_maskz_loadu_ps(k, m + i);
    __m512 vi = _mm512_maskz_loadu_ps(k, v + i);
    update512<kSmall>(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, g + i), scale), wi, mi, vi, c);
    _mm512_mask_storeu_ps(w + i, k, wi);
    _mm512_mask_storeu_ps(m + i, k, mi);
    _mm512_mask_storeu_ps(v + i, k, vi);
    if (out != nullptr) _mm256_mask_storeu_epi16(out + i, k, narrow_bf16_512(wi));
    // The lanes past n hold what zeros update to (0/0 when eps is 0): they are left out.
    check = fold_finite512(check, _mm512_maskz_mov_ps(k, wi));
  }
  return all_finite512(check);
}

template <bool kSmall>
STRATA_TARGET_AVX512 bool mixed_avx512(float* w, const uint16_t* g, float* m, float* v, uint16_t* out, int64_t n,
                                       const Scalars& s) {
  const Vec512 c = broadcast512(s);
  __m512i check = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gi = widen_bf16_512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i)));
    __m512 wi = _mm512_loadu_ps(w + i), mi = _mm512_loadu_ps(m + i), vi = _mm512_loadu_ps(v + i);
    update512<kSmall>(gi, wi, mi, vi, c);
    _mm512_storeu_ps(w + i, wi);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), narrow_bf16_512(wi));
    check = fold_finite512(check, wi);
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 gi = widen_bf16_512(_mm256_maskz_loadu_epi16(k, g + i));
    __m512 wi = _mm512_maskz_loadu_ps(k, w + i), mi = _mm512_maskz_loadu_ps(k, m + i);
    __m512 vi = _mm512_maskz_loadu_ps(k, v + i);
    update512<kSmall>(gi, wi, mi, vi, c);
    _mm512_mask_storeu_ps(w + i, k, wi);
    _mm512_mask_storeu_ps(m + i, k, mi);
    _mm512_mask_storeu_ps(v + i, k, vi);
    _mm256_mask_storeu_epi16(out + i, k, narrow_bf16_512(wi));
    check = fold_finite512(check, _mm512_maskz_mov_ps(k, wi));
  }
  return all_finite512(check);
}

// ---- AVX2 ---------------------------------------------------------------------------------

struct Vec256 {
  __m256 decay, lerp_factor, beta2, one_minus_b2, bc2_sqrt, eps, neg_step_size;
};

STRATA_TARGET_AVX2 inline Vec256 broadcast256(const Scalars& s) {
  return {_mm256_set1_ps(s.decay),        _mm256_set1_ps(s.lerp_factor), _mm256_set1_ps(s.beta2),
          _mm256_set1_ps(s.one_minus_b2), _mm256_set1_ps(s.bc2_sqrt),    _mm256_set1_ps(s.eps),
          _mm256_set1_ps(s.neg_step_size)};
}

template <bool kSmall>
STRATA_TARGET_AVX2 inline __m256 update256(__m256 g, __m256& w, __m256& m, __m256& v,
                                           const Vec256& c) {
  const __m256 wd = _mm256_mul_ps(w, c.decay);
  const __m256 diff = _mm256_sub_ps(g, m);
  m = kSmall ? _mm256_add_ps(m, _mm256_mul_ps(c.lerp_factor, diff))
             : _mm256_sub_ps(g, _mm256_mul_ps(diff, c.lerp_factor));
  v = _mm256_add_ps(_mm256_mul_ps(v, c.beta2), _mm256_mul_ps(_mm256_mul_ps(c.one_minus_b2, g), g));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), c.bc2_sqrt), c.eps);
  w = _mm256_add_ps(wd, _mm256_div_ps(_mm256_mul_ps(c.neg_step_size, m), denom));
  return w;
}

// As fold_finite512 and all_finite512.
STRATA_TARGET_AVX2 inline __m256 fold_finite256(__m256 check, __m256 x) {
  return _mm256_or_ps(check, _mm256_sub_ps(x, x));
}
STRATA_TARGET_AVX2 inline bool all_finite256(__m256 check) {
  const __m256i bits = _mm256_castps_si256(check);
  return _mm256_testz_si256(bits, bits) != 0;
}

STRATA_TARGET_AVX2 inline __m256 widen_bf16_256(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

STRATA_TARGET_AVX2 inline __m128i narrow_bf16_256(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i rounding =
      _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(high, _mm256_set1_epi32(1)));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, rounding), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(high, _mm256_set1_epi32(0x0040)), nan);
  // Every lane is below 0x10000, so the unsigned saturating pack only drops the zero halves.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <bool kSmall>
STRATA_TARGET_AVX2 bool f32_avx2(float* w, const float* g, float gs, float* m, float* v, uint16_t* out, int64_t n,
                                 const Scalars& s) {
  const Vec256 c = broadcast256(s);
  const __m256 scale = _mm256_set1_ps(gs);
  __m256 check = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 wi = _mm256_loadu_ps(w + i), mi = _mm256_loadu_ps(m + i), vi = _mm256_loadu_ps(v + i);
    update256<kSmall>(_mm256_mul_ps(_mm256_loadu_ps(g + i), scale), wi, mi, vi, c);
    _mm256_storeu_ps(w + i, wi);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    if (out != nullptr) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), narrow_bf16_256(wi));
    check = fold_finite256(check, wi);
  }
  const bool tail_finite =
      f32_scalar<kSmall>(w + i, g + i, gs, m + i, v + i, out != nullptr ? out + i : nullptr, n - i, s);
  return all_finite256(check) && tail_finite;
}

template <bool kSmall>
STRATA_TARGET_AVX2 bool mixed_avx2(float* w, const uint16_t* g, float* m, float* v, uint16_t* out, int64_t n,
                                   const Scalars& s) {
  const Vec256 c = broadcast256(s);
  __m256 check = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gi = widen_bf16_256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i)));
    __m256 wi = _mm256_loadu_ps(w + i), mi = _mm256_loadu_ps(m + i), vi = _mm256_loadu_ps(v + i);
    update256<kSmall>(gi, wi, mi, vi, c);
    _mm256_storeu_ps(w + i, wi);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), narrow_bf16_256(wi));
    check = fold_finite256(check, wi);
  }
  const bool tail_finite = mixed_scalar<kSmall>(w + i, g + i, m + i, v + i, out + i, n - i, s);
  return all_finite256(check) && tail_finite;
}

// ---- dispatch -----------------------------------------------------------------------------

using F32Kernel = bool (*)(float*, const float*, float, float*, float*, uint16_t*, int64_t, const Scalars&);
using MixedKernel = bool (*)(float*, const uint16_t*, float*, float*, uint16_t*, int64_t, const Scalars&);

template <bool kSmall>
F32Kernel pick_f32(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512:
      return &f32_avx512<kSmall>;
    case SimdLevel::kAvx2:
      return &f32_avx2<kSmall>;
    case SimdLevel::kScalar:
      break;
  }
  return &f32_scalar<kSmall>;
}

template <bool kSmall>
MixedKernel pick_mixed(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512:
      return &mixed_avx512<kSmall>;
    case SimdLevel::kAvx2:
      return &mixed_avx2<kSmall>;
    case SimdLevel::kScalar:
      break;
  }
  return &mixed_scalar<kSmall>;
}

SimdLevel hardware_simd_level() {
  static const SimdLevel level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
      return SimdLevel::kAvx512;
    }
    if (__builtin_cpu_supports("avx2")) return SimdLevel::kAvx2;
    return SimdLevel::kScalar;
  }();
  return level;
}

}  // namespace

const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512:
      return "avx512";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kScalar:
      break;
  }
  return "scalar";
}

bool simd_level_supported(SimdLevel level) {
  return static_cast<int>(level) <= static_cast<int>(hardware_simd_level());
}

SimdLevel detect_simd_level() {
  const SimdLevel hardware = hardware_simd_level();
  const char* env = std::getenv("STRATA_SIMD");
  if (env == nullptr || *env == '\0') return hardware;
  SimdLevel cap;
  const std::string_view name(env);
  if (name == "scalar") {
    cap = SimdLevel::kScalar;
  } else if (name == "avx2") {
    cap = SimdLevel::kAvx2;
  } else if (name == "avx512") {
    cap = SimdLevel::kAvx512;
  } else {
    // Once: the fp8 quantiser asks on every call.
    static std::once_flag warned;
    std::call_once(warned, [&] {
      LOG_WARN("STRATA_SIMD='{}' is not one of scalar, avx2, avx512; using {}", name, simd_level_name(hardware));
    });
    return hardware;
  }
  return static_cast<int>(cap) < static_cast<int>(hardware) ? cap : hardware;
}

bool adamw_step_f32(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p,
                    SimdLevel level) {
  return adamw_step_f32_clipped(param, grad, 1.0f, m, v, nullptr, n, p, level);
}

bool adamw_step_f32_clipped(float* param, const float* grad, float grad_scale, float* m, float* v,
                            uint16_t* param_bf16_out, int64_t n, const AdamWParams& p, SimdLevel level) {
  CHECK_MSG(simd_level_supported(level),
            std::string("this CPU cannot run SIMD level ") + simd_level_name(level));
  CHECK(n >= 0);
  const Scalars s = make_scalars(p);
  const F32Kernel kernel = s.lerp_small ? pick_f32<true>(level) : pick_f32<false>(level);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  int nonfinite = 0;
#pragma omp parallel for schedule(static) reduction(| : nonfinite) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i = b * kBlock;
    uint16_t* out = param_bf16_out != nullptr ? param_bf16_out + i : nullptr;
    nonfinite |= kernel(param + i, grad + i, grad_scale, m + i, v + i, out, std::min(kBlock, n - i), s) ? 0 : 1;
  }
  return nonfinite == 0;
}

bool adamw_step_mixed(float* master, const uint16_t* grad_bf16, float* m, float* v, uint16_t* param_bf16_out, int64_t n,
                      const AdamWParams& p, SimdLevel level) {
  CHECK_MSG(simd_level_supported(level),
            std::string("this CPU cannot run SIMD level ") + simd_level_name(level));
  CHECK(n >= 0);
  const Scalars s = make_scalars(p);
  const MixedKernel kernel = s.lerp_small ? pick_mixed<true>(level) : pick_mixed<false>(level);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  int nonfinite = 0;
#pragma omp parallel for schedule(static) reduction(| : nonfinite) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i = b * kBlock;
    nonfinite |=
        kernel(master + i, grad_bf16 + i, m + i, v + i, param_bf16_out + i, std::min(kBlock, n - i), s) ? 0 : 1;
  }
  return nonfinite == 0;
}

}  // namespace strata::kernels
