// SwiGLU forward and backward.
#include "kernels/swiglu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "../test_util.h"

namespace strata::kernels {
namespace {

using strata::testing::finite_difference;
using strata::testing::random_vector;
using strata::testing::relative_error;

// Gates cover the saturated tails (where exp overflows) as well as the middle.
std::vector<float> gates(int64_t n, uint64_t seed) {
  auto g = random_vector(n, seed, -6.0f, 6.0f);
  const float extremes[] = {-200.0f, -90.0f, 0.0f, 90.0f, 200.0f};
  for (int64_t i = 0; i < n && i < 5; ++i) g[i] = extremes[i];
  return g;
}

TEST(SwiGlu, ForwardMatchesDefinition) {
  const float g[3] = {0.0f, 1.0f, -2.0f}, u[3] = {5.0f, 2.0f, 3.0f};
  for (auto forward : {&ref::swiglu_forward, &cpu::swiglu_forward}) {
    float out[3];
    forward(out, g, u, 3);
    EXPECT_EQ(out[0], 0.0f);
    EXPECT_NEAR(out[1], 2.0 / (1.0 + std::exp(-1.0)), 1e-6);
    EXPECT_NEAR(out[2], -6.0 / (1.0 + std::exp(2.0)), 1e-6);
  }
}

TEST(SwiGlu, FastPathMatchesReference) {
  for (int64_t n : {1, 3, 17, 127, 100003}) {
    auto g = gates(n, 1), u = random_vector(n, 2), dout = random_vector(n, 3);
    std::vector<float> out_ref(n), out(n, NAN);
    ref::swiglu_forward(out_ref.data(), g.data(), u.data(), n);
    cpu::swiglu_forward(out.data(), g.data(), u.data(), n);
    EXPECT_WITHIN(relative_error(out, out_ref), 1e-6) << "n=" << n;
    std::vector<float> dg_ref(n), du_ref(n), dg(n, NAN), du(n, NAN);  // overwritten
    ref::swiglu_backward(dg_ref.data(), du_ref.data(), dout.data(), g.data(), u.data(), n);
    cpu::swiglu_backward(dg.data(), du.data(), dout.data(), g.data(), u.data(), n);
    EXPECT_WITHIN(relative_error(dg, dg_ref), 1e-6) << "n=" << n;
    EXPECT_WITHIN(relative_error(du, du_ref), 1e-6) << "n=" << n;
  }
}

TEST(SwiGlu, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t n = 33;
  auto g = random_vector(n, 1, -4.0f, 4.0f), u = random_vector(n, 2), r = random_vector(n, 3);
  std::vector<float> out(n);
  auto loss = [&] {
    ref::swiglu_forward(out.data(), g.data(), u.data(), n);
    double l = 0;
    for (int64_t i = 0; i < n; ++i) l += double(out[i]) * r[i];
    return l;
  };
  std::vector<float> dg(n), du(n), num_dg(n), num_du(n);
  ref::swiglu_backward(dg.data(), du.data(), r.data(), g.data(), u.data(), n);
  for (int64_t i = 0; i < n; ++i) num_dg[i] = finite_difference(loss, &g[i], 1e-2);
  for (int64_t i = 0; i < n; ++i) num_du[i] = finite_difference(loss, &u[i], 1e-2);
  EXPECT_WITHIN(relative_error(dg, num_dg), 1e-3);
  EXPECT_WITHIN(relative_error(du, num_du), 1e-4);
}

TEST(SwiGlu, FastPathIsBitwiseReproducible) {
  const int64_t n = 200001;
  auto g = gates(n, 4), u = random_vector(n, 5), dout = random_vector(n, 6);
  std::vector<float> a(n), b(n), da(n), db(n);
  cpu::swiglu_backward(a.data(), da.data(), dout.data(), g.data(), u.data(), n);
  cpu::swiglu_backward(b.data(), db.data(), dout.data(), g.data(), u.data(), n);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(da.data(), db.data(), n * sizeof(float)), 0);
}

}  // namespace
}  // namespace strata::kernels
