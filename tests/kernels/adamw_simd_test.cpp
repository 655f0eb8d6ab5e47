// Host AdamW with explicit SIMD: every level this CPU runs is bitwise equal to ref::adamw_step,
// tails and special values included; the mixed-precision form equals widen -> ref -> narrow.
#include "kernels/adamw_simd.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "../test_util.h"
#include "kernels/adamw.h"
#include "kernels/bf16.h"

namespace strata::kernels {
namespace {

using strata::testing::random_vector;

// Compares bit patterns, so NaN == NaN only when the payloads agree and -0 != +0. Reports the
// first differing element.
template <typename T>
::testing::AssertionResult same_bits(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "sizes " << got.size() << " vs " << want.size();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    uint32_t a, b;
    if constexpr (sizeof(T) == 4) {
      a = std::bit_cast<uint32_t>(got[i]);
      b = std::bit_cast<uint32_t>(want[i]);
    } else {
      a = got[i];
      b = want[i];
    }
    if (a != b) {
      char bits[64];
      std::snprintf(bits, sizeof(bits), "bits 0x%08x vs 0x%08x", a, b);
      return ::testing::AssertionFailure()
             << "element " << i << " of " << got.size() << ": " << bits;
    }
  }
  return ::testing::AssertionSuccess();
}

// Every element is finite: a reference that went NaN must not be matched by a kernel that did too.
::testing::AssertionResult all_finite(const std::vector<float>& x, size_t begin) {
  for (size_t i = begin; i < x.size(); ++i) {
    if (!std::isfinite(x[i]))
      return ::testing::AssertionFailure() << "element " << i << " = " << x[i];
  }
  return ::testing::AssertionSuccess();
}

std::vector<AdamWParams> configs() {
  return {
      {},                                    // defaults, no weight decay
      {3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1},  // a typical LLM setting with weight decay
      {1e-2f, 0.3f, 0.5f, 1e-6f, 0.01f, 1},  // 1 - beta1 >= 0.5: lerp's other formula
  };
}

// Special values are placed at the start of a vector; the rest are ordinary.
constexpr float kDenormal = 1e-40f;
// Special elements may overflow (1e30 squared is inf), so only the others must stay finite.
constexpr size_t kSpecialCount = 16;
constexpr float kSpecialGrads[kSpecialCount] = {
    0.0f,     -0.0f,    1e30f,   -3e38f, 1e-30f, -1e-25f, kDenormal, -1.4e-45f /* -denorm_min */,
    1.2e-38f, 65504.0f, -1e-20f, 1e19f,  2e-38f, 1.0f,    -1.0f,     0.5f};

std::vector<float> grads_for_step(int64_t n, int64_t step) {
  std::vector<float> g = random_vector(n, 100 + step, -1.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i) g[i] *= std::pow(10.0f, -float(i % 9));  // 1 .. 1e-8
  for (size_t i = 0; i < kSpecialCount && i < size_t(n); ++i) g[i] = kSpecialGrads[i];
  return g;
}

// Starting state: random params and moments, with denormals and zeros among them.
struct State {
  std::vector<float> w, m, v;
};
State initial_state(int64_t n, bool fresh_moments) {
  State s{random_vector(n, 1), std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f)};
  if (!fresh_moments) {
    s.m = random_vector(n, 2, -1e-3f, 1e-3f);
    s.v = random_vector(n, 3, 0.0f, 1e-6f);
  }
  for (int64_t i = 0; i < n; i += 7) s.w[i] = (i % 14 == 0) ? kDenormal : 0.0f;
  if (!fresh_moments) {
    for (int64_t i = 3; i < n; i += 11) {
      s.m[i] = -kDenormal;
      s.v[i] = kDenormal;
    }
  }
  return s;
}

class AdamWSimdTest : public ::testing::TestWithParam<SimdLevel> {
 protected:
  void SetUp() override {
    if (!simd_level_supported(GetParam())) {
      GTEST_SKIP() << "this CPU does not support SIMD level " << simd_level_name(GetParam());
    }
  }
};

const int64_t kSizes[] = {0, 1, 15, 16, 17, 1000, 100003};

TEST_P(AdamWSimdTest, F32IsBitwiseEqualToReference) {
  const SimdLevel level = GetParam();
  for (int64_t n : kSizes) {
    for (const AdamWParams& base : configs()) {
      for (bool fresh : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " beta1=" << base.beta1
                                          << " wd=" << base.weight_decay << " fresh=" << fresh);
        State want = initial_state(n, fresh);
        State got = want;
        for (int64_t step = 1; step <= 4; ++step) {
          const std::vector<float> g = grads_for_step(n, step);
          AdamWParams p = base;
          p.step = step;
          const bool want_finite = ref::adamw_step(want.w.data(), g.data(), want.m.data(), want.v.data(), n, p);
          const bool got_finite = adamw_step_f32(got.w.data(), g.data(), got.m.data(), got.v.data(), n, p, level);
          ASSERT_EQ(got_finite, want_finite) << "finiteness after step " << step;
          ASSERT_TRUE(same_bits(got.w, want.w)) << "param after step " << step;
          ASSERT_TRUE(same_bits(got.m, want.m)) << "m after step " << step;
          ASSERT_TRUE(same_bits(got.v, want.v)) << "v after step " << step;
        }
        EXPECT_TRUE(all_finite(want.w, kSpecialCount));
        EXPECT_TRUE(all_finite(want.v, kSpecialCount));
      }
    }
  }
}

// The clipped form with a bf16 copy is what the host tier ran before in three passes: scale
// the gradients in place, ref::adamw_step, narrow the master; the gradients stay as they were.
TEST_P(AdamWSimdTest, ClippedIsBitwiseScaleThenReferenceThenNarrow) {
  const SimdLevel level = GetParam();
  for (int64_t n : kSizes) {
    for (const AdamWParams& base : configs()) {
      for (float scale : {1.0f, 0.37f, 3e-7f}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " beta1=" << base.beta1 << " scale=" << scale);
        State want = initial_state(n, false);
        State got = want;
        std::vector<uint16_t> out_want(n, 0xDEAD), out_got(n, 0xBEEF);
        for (int64_t step = 1; step <= 3; ++step) {
          const std::vector<float> g = grads_for_step(n, step);
          AdamWParams p = base;
          p.step = step;
          std::vector<float> scaled = g;
          for (float& x : scaled) x *= scale;
          const bool want_finite = ref::adamw_step(want.w.data(), scaled.data(), want.m.data(), want.v.data(), n, p);
          for (int64_t i = 0; i < n; ++i) out_want[i] = f32_to_bf16(want.w[i]);
          const std::vector<float> g_before = g;
          const bool got_finite = adamw_step_f32_clipped(got.w.data(), g.data(), scale, got.m.data(), got.v.data(),
                                                         out_got.data(), n, p, level);
          ASSERT_EQ(got_finite, want_finite) << "finiteness after step " << step;
          ASSERT_TRUE(same_bits(got.w, want.w)) << "master after step " << step;
          ASSERT_TRUE(same_bits(got.m, want.m)) << "m after step " << step;
          ASSERT_TRUE(same_bits(got.v, want.v)) << "v after step " << step;
          ASSERT_TRUE(same_bits(out_got, out_want)) << "bf16 copy after step " << step;
          ASSERT_TRUE(same_bits(g, g_before)) << "the gradients changed";
        }
        // Without a copy nothing else is written.
        State bare = initial_state(n, false), again = bare;
        const std::vector<float> g = grads_for_step(n, 1);
        AdamWParams p = base;
        adamw_step_f32_clipped(bare.w.data(), g.data(), scale, bare.m.data(), bare.v.data(), nullptr, n, p, level);
        std::vector<float> scaled = g;
        for (float& x : scaled) x *= scale;
        ref::adamw_step(again.w.data(), scaled.data(), again.m.data(), again.v.data(), n, p);
        ASSERT_TRUE(same_bits(bare.w, again.w));
      }
    }
  }
}

TEST_P(AdamWSimdTest, F32HandlesUnalignedBuffers) {
  const int64_t n = 1000 + 13;
  State want = initial_state(n + 1, false);
  State got = want;
  const std::vector<float> g = grads_for_step(n + 1, 1);
  AdamWParams p{3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 7};
  ref::adamw_step(want.w.data() + 1, g.data() + 1, want.m.data() + 1, want.v.data() + 1, n, p);
  adamw_step_f32(got.w.data() + 1, g.data() + 1, got.m.data() + 1, got.v.data() + 1, n, p,
                 GetParam());
  EXPECT_TRUE(same_bits(got.w, want.w));
  EXPECT_TRUE(same_bits(got.m, want.m));
  EXPECT_TRUE(same_bits(got.v, want.v));
}

TEST_P(AdamWSimdTest, F32PropagatesInfAndNaNGradientsLikeReference) {
  const int64_t n = 37;
  State want = initial_state(n, false);
  State got = want;
  std::vector<float> g = grads_for_step(n, 1);
  g[20] = std::numeric_limits<float>::infinity();
  g[21] = -std::numeric_limits<float>::infinity();
  g[22] = std::numeric_limits<float>::quiet_NaN();
  g[35] = std::numeric_limits<float>::quiet_NaN();  // in the vector tail
  AdamWParams p{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1};
  ref::adamw_step(want.w.data(), g.data(), want.m.data(), want.v.data(), n, p);
  adamw_step_f32(got.w.data(), g.data(), got.m.data(), got.v.data(), n, p, GetParam());
  EXPECT_TRUE(std::isnan(want.w[22]));
  EXPECT_TRUE(same_bits(got.w, want.w));
  EXPECT_TRUE(same_bits(got.m, want.m));
  EXPECT_TRUE(same_bits(got.v, want.v));
}

// bf16 gradients with bf16-specific specials: subnormals, the largest finite value, zeros.
std::vector<uint16_t> bf16_grads_for_step(int64_t n, int64_t step) {
  const std::vector<float> g = grads_for_step(n, step);
  std::vector<uint16_t> h(g.size());
  for (size_t i = 0; i < g.size(); ++i) h[i] = f32_to_bf16(g[i]);
  const uint16_t specials[] = {0x0001, 0x8001, 0x007F, 0x7F7F, 0xFF7F, 0x8000, 0x0000, 0x0080};
  for (size_t i = 0; i < std::size(specials) && i < h.size(); ++i)
    h[h.size() - 1 - i] = specials[i];
  return h;
}

TEST_P(AdamWSimdTest, MixedIsBitwiseEqualToWidenReferenceNarrow) {
  const SimdLevel level = GetParam();
  for (int64_t n : kSizes) {
    for (const AdamWParams& base : configs()) {
      SCOPED_TRACE(::testing::Message()
                   << "n=" << n << " beta1=" << base.beta1 << " wd=" << base.weight_decay);
      State want = initial_state(n, false);
      State got = want;
      std::vector<uint16_t> out_want(n, 0xDEAD), out_got(n, 0xBEEF);
      for (int64_t step = 1; step <= 3; ++step) {
        const std::vector<uint16_t> g = bf16_grads_for_step(n, step);
        AdamWParams p = base;
        p.step = step;
        // The scalar reference: widen the gradients, run ref::adamw_step, narrow the master.
        std::vector<float> g32(n);
        for (int64_t i = 0; i < n; ++i) g32[i] = bf16_to_f32(g[i]);
        const bool want_finite = ref::adamw_step(want.w.data(), g32.data(), want.m.data(), want.v.data(), n, p);
        for (int64_t i = 0; i < n; ++i) out_want[i] = f32_to_bf16(want.w[i]);

        const bool got_finite =
            adamw_step_mixed(got.w.data(), g.data(), got.m.data(), got.v.data(), out_got.data(), n, p, level);
        ASSERT_EQ(got_finite, want_finite) << "finiteness after step " << step;
        ASSERT_TRUE(same_bits(got.w, want.w)) << "master after step " << step;
        ASSERT_TRUE(same_bits(got.m, want.m)) << "m after step " << step;
        ASSERT_TRUE(same_bits(got.v, want.v)) << "v after step " << step;
        ASSERT_TRUE(same_bits(out_got, out_want)) << "bf16 params after step " << step;
      }
    }
  }
}

TEST_P(AdamWSimdTest, MixedNarrowsNaNAndInfMastersLikeScalar) {
  const int64_t n = 40;
  State st = initial_state(n, false);
  std::vector<uint16_t> g = bf16_grads_for_step(n, 1);
  g[3] = 0x7F80;   // +inf gradient: master becomes NaN
  g[33] = 0x7FC1;  // NaN gradient with a payload, in the AVX-512 tail
  std::vector<uint16_t> out(n, 0);
  EXPECT_FALSE(
      adamw_step_mixed(st.w.data(), g.data(), st.m.data(), st.v.data(), out.data(), n, AdamWParams{}, GetParam()));
  EXPECT_TRUE(std::isnan(st.w[3]));
  EXPECT_TRUE(std::isnan(st.w[33]));
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(out[i], f32_to_bf16(st.w[i])) << "element " << i;
    if (std::isnan(st.w[i])) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(out[i]))) << "element " << i;
    }
  }
}

// The finiteness a step reports, with eps = 0: all finite (every gradient nonzero; the lanes past
// n of a masked tail, which update zeros to 0 / 0, do not count), a NaN from 0 / 0 where one
// gradient and its moments are 0, or an Inf from a step past the largest float. The bad element
// sits at the start, in the vector body, in the tail, or in another thread's block; what is
// written is the reference's, bit for bit, either way.
enum class StepOutcome { kFinite, kZeroOverZero, kOverflow };

struct SimdFiniteCase {
  State s;
  std::vector<float> g;
  AdamWParams p;
};

SimdFiniteCase simd_finite_case(int64_t n, int64_t at, StepOutcome outcome) {
  SimdFiniteCase c{initial_state(n, true), random_vector(n, 5, 0.25f, 1.0f), {1e-3f, 0.9f, 0.999f, 0.0f, 0.1f, 1}};
  for (int64_t i = 1; i < n; i += 2) c.g[i] = -c.g[i];
  if (outcome == StepOutcome::kZeroOverZero) c.g[at] = 0.0f;
  if (outcome == StepOutcome::kOverflow) {
    c.p.lr = 1e33f;  // the first step moves each element by lr against its gradient's sign
    c.p.weight_decay = 0.0f;
    c.s.w[at] = std::numeric_limits<float>::max();
    c.g[at] = -1.0f;
  }
  return c;
}

constexpr StepOutcome kStepOutcomes[] = {StepOutcome::kFinite, StepOutcome::kZeroOverZero, StepOutcome::kOverflow};

TEST_P(AdamWSimdTest, F32ReportsWhetherEveryParameterWrittenIsFinite) {
  for (int64_t n : {1, 15, 16, 17, 1000, 100003}) {
    for (int64_t at : {int64_t{0}, n / 2, n - 1, std::max<int64_t>(0, n - 17)}) {
      for (StepOutcome outcome : kStepOutcomes) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " at=" << at << " outcome=" << int(outcome));
        SimdFiniteCase want = simd_finite_case(n, at, outcome);
        SimdFiniteCase got = want;
        const bool want_finite =
            ref::adamw_step(want.s.w.data(), want.g.data(), want.s.m.data(), want.s.v.data(), n, want.p);
        const bool got_finite =
            adamw_step_f32(got.s.w.data(), got.g.data(), got.s.m.data(), got.s.v.data(), n, got.p, GetParam());
        ASSERT_EQ(want_finite, outcome == StepOutcome::kFinite);
        ASSERT_EQ(got_finite, outcome == StepOutcome::kFinite);
        ASSERT_EQ(std::isnan(got.s.w[at]), outcome == StepOutcome::kZeroOverZero);
        ASSERT_EQ(std::isinf(got.s.w[at]), outcome == StepOutcome::kOverflow);
        ASSERT_TRUE(same_bits(got.s.w, want.s.w));
        ASSERT_TRUE(same_bits(got.s.m, want.s.m));
        ASSERT_TRUE(same_bits(got.s.v, want.s.v));
      }
    }
  }
}

TEST_P(AdamWSimdTest, MixedReportsWhetherEveryMasterWrittenIsFinite) {
  for (int64_t n : {1, 15, 16, 17, 1000, 100003}) {
    for (int64_t at : {int64_t{0}, n / 2, n - 1, std::max<int64_t>(0, n - 17)}) {
      for (StepOutcome outcome : kStepOutcomes) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " at=" << at << " outcome=" << int(outcome));
        SimdFiniteCase want = simd_finite_case(n, at, outcome);
        std::vector<uint16_t> g(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
          g[i] = f32_to_bf16(want.g[i]);
          want.g[i] = bf16_to_f32(g[i]);  // what the mixed step reads
        }
        SimdFiniteCase got = want;
        const bool want_finite =
            ref::adamw_step(want.s.w.data(), want.g.data(), want.s.m.data(), want.s.v.data(), n, want.p);
        std::vector<uint16_t> out(static_cast<size_t>(n));
        const bool got_finite = adamw_step_mixed(got.s.w.data(), g.data(), got.s.m.data(), got.s.v.data(), out.data(),
                                                 n, got.p, GetParam());
        ASSERT_EQ(want_finite, outcome == StepOutcome::kFinite);
        ASSERT_EQ(got_finite, outcome == StepOutcome::kFinite);
        ASSERT_TRUE(same_bits(got.s.w, want.s.w));
        ASSERT_TRUE(same_bits(got.s.m, want.s.m));
        ASSERT_TRUE(same_bits(got.s.v, want.s.v));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, AdamWSimdTest,
                         ::testing::Values(SimdLevel::kScalar, SimdLevel::kAvx2,
                                           SimdLevel::kAvx512),
                         [](const ::testing::TestParamInfo<SimdLevel>& info) {
                           return std::string(simd_level_name(info.param));
                         });

// Rounding to nearest even, checked against values worked out by hand.
TEST(Bf16, NarrowingRoundsToNearestEven) {
  struct Case {
    uint32_t in;
    uint16_t out;
  };
  const Case cases[] = {
      {0x3F800000u, 0x3F80},  // 1.0 exactly
      {0x3F808000u, 0x3F80},  // tie, kept half even: stays
      {0x3F818000u, 0x3F82},  // tie, kept half odd: rounds up to even
      {0x3F808001u, 0x3F81},  // above the tie
      {0x3F807FFFu, 0x3F80},  // below the tie
      {0xBF818000u, 0xBF82},  // negative tie rounds away from zero to even
      {0x00008000u, 0x0000},  // subnormal tie to even zero
      {0x00018000u, 0x0002},  // subnormal tie rounds up to even
      {0x00000001u, 0x0000},  // smallest subnormal rounds to zero
      {0x0000C000u, 0x0001},  // subnormal above the tie
      {0x807FFFFFu, 0x8080},  // largest negative subnormal rounds up to -FLT_MIN
      {0x7F7FFFFFu, 0x7F80},  // FLT_MAX overflows to +inf
      {0x7F800000u, 0x7F80},  // +inf
      {0xFF800000u, 0xFF80},  // -inf
      {0x7FC00000u, 0x7FC0},  // quiet NaN
      {0x7F800001u, 0x7FC0},  // signalling NaN with a low payload stays a NaN (not inf)
      {0xFFA00000u, 0xFFE0},  // negative signalling NaN: quieted, sign kept
      {0x80000000u, 0x8000},  // -0
  };
  for (const Case& c : cases) {
    EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(c.in)), c.out) << std::hex << "input 0x" << c.in;
  }
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    if ((h & 0x7F80u) == 0x7F80u && (h & 0x7Fu) != 0) continue;  // NaNs are quieted
    ASSERT_EQ(f32_to_bf16(bf16_to_f32(static_cast<uint16_t>(h))), h) << "round trip of " << h;
  }
}

// Restores STRATA_SIMD when it goes out of scope.
class ScopedSimdEnv {
 public:
  explicit ScopedSimdEnv(const char* value) {
    if (const char* old = std::getenv("STRATA_SIMD")) old_ = old;
    if (value) {
      ::setenv("STRATA_SIMD", value, 1);
    } else {
      ::unsetenv("STRATA_SIMD");
    }
  }
  ~ScopedSimdEnv() {
    if (old_) {
      ::setenv("STRATA_SIMD", old_->c_str(), 1);
    } else {
      ::unsetenv("STRATA_SIMD");
    }
  }
  ScopedSimdEnv(const ScopedSimdEnv&) = delete;
  ScopedSimdEnv& operator=(const ScopedSimdEnv&) = delete;

 private:
  std::optional<std::string> old_;
};

TEST(SimdLevel, EnvironmentCapsTheDetectedLevel) {
  SimdLevel hardware;
  {
    ScopedSimdEnv env(nullptr);
    hardware = detect_simd_level();
  }
  EXPECT_TRUE(simd_level_supported(hardware));
  EXPECT_TRUE(simd_level_supported(SimdLevel::kScalar));
  const auto at_most = [&](SimdLevel l) { return int(l) < int(hardware) ? l : hardware; };
  {
    ScopedSimdEnv env("scalar");
    EXPECT_EQ(detect_simd_level(), SimdLevel::kScalar);
  }
  {
    ScopedSimdEnv env("avx2");
    EXPECT_EQ(detect_simd_level(), at_most(SimdLevel::kAvx2));
  }
  {
    ScopedSimdEnv env("avx512");
    EXPECT_EQ(detect_simd_level(), hardware);  // a cap never raises the level
  }
  {
    ScopedSimdEnv env("sse9");
    EXPECT_EQ(detect_simd_level(), hardware);
  }
}

TEST(SimdLevel, ThisMachineSupportsWhatItsCpuFlagsSay) {
  EXPECT_EQ(simd_level_supported(SimdLevel::kAvx2), bool(__builtin_cpu_supports("avx2")));
  EXPECT_EQ(simd_level_supported(SimdLevel::kAvx512), __builtin_cpu_supports("avx512f") &&
                                                          __builtin_cpu_supports("avx512bw") &&
                                                          __builtin_cpu_supports("avx512vl"));
}

}  // namespace
}  // namespace strata::kernels
