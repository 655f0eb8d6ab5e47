// RMSNorm forward and backward.
#include "kernels/rmsnorm.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "../test_util.h"

namespace strata::kernels {
namespace {

using strata::testing::finite_difference;
using strata::testing::max_scaled_error;
using strata::testing::random_vector;
using strata::testing::relative_error;

struct Shape {
  int64_t N, C;
};
const Shape kShapes[] = {{1, 1}, {3, 17}, {17, 3}, {127, 33}, {33, 127}, {300, 1024}};

TEST(RmsNorm, ForwardMatchesDefinitionOnOneRow) {
  // x = (3, 4): mean(x^2) = 12.5, rstd = 1 / sqrt(12.5 + eps).
  const float x[2] = {3.0f, 4.0f}, w[2] = {1.0f, 2.0f};
  for (auto forward : {&ref::rmsnorm_forward, &cpu::rmsnorm_forward}) {
    float out[2], rstd;
    forward(out, &rstd, x, w, 1, 2, 1e-5f);
    const double r = 1.0 / std::sqrt(12.5 + 1e-5);
    EXPECT_NEAR(rstd, r, 1e-7);
    EXPECT_NEAR(out[0], 3 * r, 1e-6);
    EXPECT_NEAR(out[1], 8 * r, 1e-6);
  }
}

TEST(RmsNorm, FastForwardMatchesReference) {
  for (const auto& s : kShapes) {
    auto x = random_vector(s.N * s.C, 1, -2.0f, 2.0f), w = random_vector(s.C, 2);
    std::vector<float> out_ref(s.N * s.C), out(s.N * s.C, NAN), r_ref(s.N), r(s.N, NAN);
    ref::rmsnorm_forward(out_ref.data(), r_ref.data(), x.data(), w.data(), s.N, s.C, 1e-6f);
    cpu::rmsnorm_forward(out.data(), r.data(), x.data(), w.data(), s.N, s.C, 1e-6f);
    SCOPED_TRACE(::testing::Message() << "N=" << s.N << " C=" << s.C);
    EXPECT_WITHIN(relative_error(out, out_ref), 1e-6);
    EXPECT_WITHIN(relative_error(r, r_ref), 1e-6);
  }
}

TEST(RmsNorm, FastBackwardMatchesReferenceAndAccumulatesDweight) {
  for (const auto& s : kShapes) {
    auto x = random_vector(s.N * s.C, 1, -2.0f, 2.0f), w = random_vector(s.C, 2);
    auto dout = random_vector(s.N * s.C, 3);
    std::vector<float> out(s.N * s.C), rstd(s.N);
    ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), s.N, s.C, 1e-6f);
    auto dw0 = random_vector(s.C, 4);
    auto dw_ref = dw0, dw = dw0;
    std::vector<float> dx_ref(s.N * s.C, NAN), dx(s.N * s.C, NAN);  // dx is overwritten
    ref::rmsnorm_backward(dx_ref.data(), dw_ref.data(), dout.data(), x.data(), w.data(),
                          rstd.data(), s.N, s.C);
    cpu::rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), s.N,
                          s.C);
    SCOPED_TRACE(::testing::Message() << "N=" << s.N << " C=" << s.C);
    // With C = 1 the two terms of dx cancel to nearly zero, so dx is compared against an
    // absolute floor set by the size of its terms (r w g is of order one here).
    EXPECT_WITHIN(max_scaled_error(dx.data(), dx_ref.data(), s.N * s.C, 1e-6, 1e-4), 1.0);
    EXPECT_WITHIN(relative_error(dw, dw_ref), 1e-5);
    // Starting from zero instead gives the increment alone: dweight was added onto.
    std::vector<float> from_zero(s.C, 0.0f), increment(s.C);
    cpu::rmsnorm_backward(dx.data(), from_zero.data(), dout.data(), x.data(), w.data(),
                          rstd.data(), s.N, s.C);
    for (int64_t c = 0; c < s.C; ++c) increment[c] = dw[c] - dw0[c];
    EXPECT_WITHIN(relative_error(increment, from_zero), 1e-4);
  }
}

TEST(RmsNorm, ReferenceBackwardMatchesFiniteDifferences) {
  const Shape s{3, 17};
  auto x = random_vector(s.N * s.C, 1, -2.0f, 2.0f), w = random_vector(s.C, 2);
  auto r = random_vector(s.N * s.C, 3);
  std::vector<float> out(s.N * s.C), rstd(s.N);
  auto loss = [&] {
    ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), s.N, s.C, 1e-5f);
    double l = 0;
    for (size_t i = 0; i < out.size(); ++i) l += double(out[i]) * r[i];
    return l;
  };
  loss();
  std::vector<float> dx(x.size()), dw(w.size(), 0.0f);
  ref::rmsnorm_backward(dx.data(), dw.data(), r.data(), x.data(), w.data(), rstd.data(), s.N,
                        s.C);
  std::vector<float> num_dx(x.size()), num_dw(w.size());
  for (size_t i = 0; i < x.size(); ++i) num_dx[i] = finite_difference(loss, &x[i], 1e-2);
  for (size_t i = 0; i < w.size(); ++i) num_dw[i] = finite_difference(loss, &w[i], 1e-2);
  EXPECT_WITHIN(relative_error(dx, num_dx), 1e-2);
  EXPECT_WITHIN(relative_error(dw, num_dw), 1e-3);
}

TEST(RmsNorm, FastBackwardDoesNotDependOnThreadCount) {
  const Shape s{517, 384};
  auto x = random_vector(s.N * s.C, 1), w = random_vector(s.C, 2), dout = random_vector(s.N * s.C, 3);
  std::vector<float> out(s.N * s.C), rstd(s.N);
  cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), s.N, s.C, 1e-5f);
  std::vector<float> dx[3], dw[3];
  const int saved = omp_get_max_threads();
  const int threads[3] = {1, 3, saved};
  for (int k = 0; k < 3; ++k) {
    omp_set_num_threads(threads[k]);
    dx[k].assign(s.N * s.C, 0.0f);
    dw[k].assign(s.C, 0.125f);
    cpu::rmsnorm_backward(dx[k].data(), dw[k].data(), dout.data(), x.data(), w.data(),
                          rstd.data(), s.N, s.C);
  }
  omp_set_num_threads(saved);
  for (int k = 1; k < 3; ++k) {
    EXPECT_EQ(std::memcmp(dx[0].data(), dx[k].data(), dx[0].size() * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(dw[0].data(), dw[k].data(), dw[0].size() * sizeof(float)), 0);
  }
}

}  // namespace
}  // namespace strata::kernels
