// AdamW: fast path bitwise equal to the reference, and both equal to torch.optim.AdamW.
#include "kernels/adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../test_util.h"

namespace strata::kernels {
namespace {

using strata::testing::max_scaled_error;
using strata::testing::random_vector;

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(AdamW, FastPathIsBitwiseEqualToReference) {
  AdamWParams configs[3];
  configs[0] = {};                                           // defaults, no weight decay
  configs[1] = {3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};         // a typical LLM setting
  configs[2] = {1e-2f, 0.3f, 0.5f, 1e-6f, 0.01f, 1};         // 1 - beta1 >= 0.5: lerp's other form
  for (int64_t n : {1, 3, 17, 127, 100003}) {
    for (const auto& base : configs) {
      auto p_ref = random_vector(n, 1), m_ref = std::vector<float>(n, 0.0f);
      auto v_ref = std::vector<float>(n, 0.0f);
      auto p = p_ref, m = m_ref, v = v_ref;
      for (int64_t step = 1; step <= 5; ++step) {
        // Gradients span several orders of magnitude, including exact zeros.
        auto g = random_vector(n, 100 + step, -1.0f, 1.0f);
        for (int64_t i = 0; i < n; ++i) g[i] *= std::pow(10.0f, -float(i % 7));
        if (n > 2) g[2] = 0.0f;
        AdamWParams params = base;
        params.step = step;
        ref::adamw_step(p_ref.data(), g.data(), m_ref.data(), v_ref.data(), n, params);
        cpu::adamw_step(p.data(), g.data(), m.data(), v.data(), n, params);
      }
      SCOPED_TRACE(::testing::Message() << "n=" << n << " beta1=" << base.beta1);
      EXPECT_TRUE(bitwise_equal(p, p_ref));
      EXPECT_TRUE(bitwise_equal(m, m_ref));
      EXPECT_TRUE(bitwise_equal(v, v_ref));
    }
  }
}

// One element worked by hand: param 1, grad 0.5, fresh moments, lr 0.1, wd 0.01, step 1.
//   param = 1 * (1 - 0.1 * 0.01) = 0.999;  m = 0.1 * 0.5 = 0.05;  v = 0.001 * 0.25 = 2.5e-4
//   step_size = 0.1 / (1 - 0.9) = 1;  denom = sqrt(2.5e-4) / sqrt(1 - 0.999) + 1e-8 = 0.5 + 1e-8
//   param = 0.999 - 1 * 0.05 / 0.5 = 0.899
TEST(AdamW, SingleElementMatchesHandComputation) {
  for (auto step_fn : {&ref::adamw_step, &cpu::adamw_step}) {
    float p = 1.0f, g = 0.5f, m = 0.0f, v = 0.0f;
    AdamWParams params{0.1f, 0.9f, 0.999f, 1e-8f, 0.01f, 1};
    step_fn(&p, &g, &m, &v, 1, params);
    // The betas are fp32: 1 - 0.9f and 1 - 0.999f differ from 0.1 and 0.001 by about 4e-7
    // and 1.3e-5 relatively, which is what the tolerances of m and v allow for.
    EXPECT_NEAR(m, 0.05, 5e-8);
    EXPECT_NEAR(v, 2.5e-4, 5e-9);
    EXPECT_NEAR(p, 0.899, 1e-6);
  }
}

// Values produced by torch 1.13 torch.optim.AdamW(foreach=False) on CPU, with lr, betas, eps
// and weight_decay set to the fp32 values of (1e-2, (0.9, 0.999), 1e-8, 0.1), after each of
// three steps. PyTorch's vectorised CPU kernels use FMA, so agreement is to about one ulp, a
// few ulps for m where lerp cancels (1e-4 + 0.1 * -1.1e-3 = -1e-5).
TEST(AdamW, MatchesTorchOverThreeSteps) {
  const std::vector<float> grads[3] = {{0.5f, -0.25f, 1e-3f, -2.0f},
                                       {0.1f, 0.3f, -1e-3f, 0.5f},
                                       {-0.2f, 0.0f, 2e-3f, 1.5f}};
  const std::vector<float> want_p[3] = {
      {0.9890000224113464f, -0.4895000159740448f, 0.23975010216236115f, 2.008000135421753f},
      {0.9799806475639343f, -0.4904399514198303f, 0.24003666639328003f, 2.0106868743896484f},
      {0.9755571484565735f, -0.491054505109787f, 0.23481425642967224f, 2.0078489780426025f}};
  const std::vector<float> want_m[3] = {
      {0.050000011920928955f, -0.025000005960464478f, 0.00010000002657761797f,
       -0.20000004768371582f},
      {0.05500001087784767f, 0.007500003557652235f, -1.0000005204346962e-05f,
       -0.1300000250339508f},
      {0.029500002041459084f, 0.006750002969056368f, 0.00019100005738437176f,
       0.03300001472234726f}};
  const std::vector<float> want_v[3] = {
      {0.00024999678134918213f, 6.249919533729553e-05f, 9.999872041532853e-10f,
       0.003999948501586914f},
      {0.0002597466518636793f, 0.00015243554662447423f, 1.9989743194059884e-09f,
       0.004245945252478123f},
      {0.00029948638984933496f, 0.00015228311531245708f, 5.996924290485595e-09f,
       0.00649167038500309f}};
  for (auto step_fn : {&ref::adamw_step, &cpu::adamw_step}) {
    std::vector<float> p = {1.0f, -0.5f, 0.25f, 2.0f}, m(4, 0.0f), v(4, 0.0f);
    for (int step = 1; step <= 3; ++step) {
      AdamWParams params{1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, step};
      step_fn(p.data(), grads[step - 1].data(), m.data(), v.data(), 4, params);
      SCOPED_TRACE(::testing::Message() << "step " << step);
      EXPECT_WITHIN(max_scaled_error(p.data(), want_p[step - 1].data(), 4, 0.0, 4e-7), 1.0);
      EXPECT_WITHIN(max_scaled_error(m.data(), want_m[step - 1].data(), 4, 0.0, 2e-6), 1.0);
      EXPECT_WITHIN(max_scaled_error(v.data(), want_v[step - 1].data(), 4, 0.0, 4e-7), 1.0);
    }
  }
}

TEST(AdamW, NanGradientPropagates) {
  float p = 1.0f, g = NAN, m = 0.0f, v = 0.0f;
  EXPECT_FALSE(cpu::adamw_step(&p, &g, &m, &v, 1, AdamWParams{})) << "a NaN written is reported";
  EXPECT_TRUE(std::isnan(p));
}

// What a step writes, and whether it says every parameter is finite: all finite, a NaN from
// eps = 0 (0 / 0 where the gradient and both moments are 0), or an Inf from a step past the
// largest float. `at` is the element that goes wrong.
enum class Outcome { kFinite, kZeroOverZero, kOverflow };

struct FiniteCase {
  std::vector<float> w, g, m, v;
  AdamWParams p;
};

FiniteCase finite_case(int64_t n, int64_t at, Outcome outcome) {
  FiniteCase c;
  c.w = random_vector(n, 1);
  c.g = random_vector(n, 2, 0.25f, 1.0f);  // no zero: eps = 0 alone writes no NaN
  for (int64_t i = 1; i < n; i += 2) c.g[i] = -c.g[i];
  c.m.assign(n, 0.0f);
  c.v.assign(n, 0.0f);
  c.p = {1e-3f, 0.9f, 0.999f, 0.0f, 0.1f, 1};  // eps = 0
  if (outcome == Outcome::kZeroOverZero) c.g[at] = 0.0f;
  if (outcome == Outcome::kOverflow) {
    // Adam's first step moves each element by lr against its gradient's sign.
    c.p.lr = 1e33f;
    c.p.weight_decay = 0.0f;
    c.w[at] = std::numeric_limits<float>::max();
    c.g[at] = -1.0f;
  }
  return c;
}

TEST(AdamW, ReportsWhetherEveryParameterWrittenIsFinite) {
  for (int64_t n : {1, 17, 100003}) {  // 100003: several threads' blocks
    for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
      for (Outcome outcome : {Outcome::kFinite, Outcome::kZeroOverZero, Outcome::kOverflow}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " at=" << at << " outcome=" << static_cast<int>(outcome));
        FiniteCase want = finite_case(n, at, outcome);
        FiniteCase got = want;
        const bool want_finite = ref::adamw_step(want.w.data(), want.g.data(), want.m.data(), want.v.data(), n, want.p);
        const bool got_finite = cpu::adamw_step(got.w.data(), got.g.data(), got.m.data(), got.v.data(), n, got.p);
        EXPECT_EQ(want_finite, outcome == Outcome::kFinite);
        EXPECT_EQ(got_finite, outcome == Outcome::kFinite);
        EXPECT_EQ(std::isnan(want.w[at]), outcome == Outcome::kZeroOverZero);
        EXPECT_EQ(std::isinf(want.w[at]), outcome == Outcome::kOverflow);
        // The check changes nothing of what is written.
        EXPECT_TRUE(bitwise_equal(got.w, want.w));
        EXPECT_TRUE(bitwise_equal(got.m, want.m));
        EXPECT_TRUE(bitwise_equal(got.v, want.v));
      }
    }
  }
}

}  // namespace
}  // namespace strata::kernels
