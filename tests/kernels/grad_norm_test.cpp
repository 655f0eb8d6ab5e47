// Gradient-norm pieces: sum of squares (deterministic across thread counts), scaling and
// the clip coefficient of clip_grad_norm_.
#include "kernels/grad_norm.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "../test_util.h"

namespace strata::kernels {
namespace {

using strata::testing::random_vector;

TEST(GradNorm, FastSumSquaresMatchesReference) {
  for (int64_t n : {0, 1, 3, 17, 127, 16384, 16385, 100003}) {
    auto x = random_vector(n, 1, -3.0f, 3.0f);
    const double want = ref::sum_squares(x.data(), n);
    const double got = cpu::sum_squares(x.data(), n);
    EXPECT_WITHIN(std::fabs(got - want), 1e-12 * want) << "n=" << n;
  }
  const float three[] = {1.0f, -2.0f, 0.5f};
  EXPECT_EQ(ref::sum_squares(three, 3), 5.25);
  EXPECT_EQ(cpu::sum_squares(three, 3), 5.25);
}

TEST(GradNorm, FastSumSquaresDoesNotDependOnThreadCount) {
  auto x = random_vector(300001, 2, -1.0f, 1.0f);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const double one = cpu::sum_squares(x.data(), 300001);
  omp_set_num_threads(3);
  const double three = cpu::sum_squares(x.data(), 300001);
  omp_set_num_threads(saved);
  EXPECT_EQ(std::memcmp(&one, &three, sizeof(double)), 0);
  EXPECT_EQ(cpu::sum_squares(x.data(), 300001), one);
}

TEST(GradNorm, SumSquaresPropagatesNan) {
  auto x = random_vector(40000, 3);
  x[39000] = NAN;
  EXPECT_TRUE(std::isnan(ref::sum_squares(x.data(), 40000)));
  EXPECT_TRUE(std::isnan(cpu::sum_squares(x.data(), 40000)));
}

TEST(GradNorm, ScaleInplaceMatchesReference) {
  for (int64_t n : {1, 17, 100003}) {
    auto a = random_vector(n, 4), b = a;
    ref::scale_inplace(a.data(), n, 0.37f);
    cpu::scale_inplace(b.data(), n, 0.37f);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), n * sizeof(float)), 0);
    EXPECT_EQ(a[0], random_vector(n, 4)[0] * 0.37f);
  }
}

TEST(GradNorm, ClipCoefficientFollowsClipGradNorm) {
  EXPECT_EQ(clip_coefficient(10.0, 0.0), 1.0f);   // clipping off
  EXPECT_EQ(clip_coefficient(10.0, -1.0), 1.0f);  // clipping off
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0f);    // below the limit: unchanged
  EXPECT_EQ(clip_coefficient(0.0, 1.0), 1.0f);
  EXPECT_EQ(clip_coefficient(10.0, 1.0), static_cast<float>(1.0 / (10.0 + 1e-6)));
  EXPECT_EQ(clip_coefficient(INFINITY, 1.0), 0.0f);
  EXPECT_TRUE(std::isnan(clip_coefficient(NAN, 1.0)));
}

}  // namespace
}  // namespace strata::kernels
