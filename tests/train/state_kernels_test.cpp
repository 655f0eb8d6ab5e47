// The CPU StateKernels: the batched sum of squares adds tensors in the order given, and AdamW
// with the prepared clip factor is bitwise the reference's scale-then-update (the CUDA
// implementation is held to the same by tests/gpu/memops_parity_test.cpp).
#include "train/state_kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "../test_util.h"
#include "kernels/adamw.h"
#include "kernels/grad_norm.h"
#include "kernels/moments.h"

namespace strata {
namespace {

using testing::random_vector;

TEST(CpuStateKernels, SumOfSquaresAddsTheTensorsInOrder) {
  std::unique_ptr<StateKernels> k = make_cpu_state_kernels();
  const std::vector<float> a = random_vector(1001, 1), b = random_vector(7, 2), c = random_vector(300, 3);
  k->begin_norm();
  const GradBuffer first[] = {{a.data(), 1001}, {b.data(), 7}};
  const GradBuffer second[] = {{c.data(), 300}};
  k->add_sum_squares(first);
  k->add_sum_squares(second);
  double want = 0;
  want += kernels::cpu::sum_squares(a.data(), 1001);
  want += kernels::cpu::sum_squares(b.data(), 7);
  want += kernels::cpu::sum_squares(c.data(), 300);
  EXPECT_EQ(k->end_norm(), want);
}

TEST(CpuStateKernels, ClippedAdamWIsScaleThenUpdateBitwise) {
  const int64_t n = 999;
  const double max_norm = 0.5;
  std::unique_ptr<StateKernels> k = make_cpu_state_kernels();
  std::vector<float> g = random_vector(n, 10, -1.f, 1.f);  // norm ~18: clipped
  k->begin_norm();
  const GradBuffer all[] = {{g.data(), n}};
  k->add_sum_squares(all);
  const double norm = std::sqrt(k->end_norm());
  const float coefficient = kernels::clip_coefficient(norm, max_norm);
  ASSERT_TRUE(coefficient < 1.0f) << "the case must clip";
  k->prepare_clip(max_norm);

  kernels::AdamWParams p;
  p.lr = 1e-3f;
  p.weight_decay = 0.1f;
  p.step = 1;
  std::vector<float> w = random_vector(n, 11), m(n, 0.0f), v(n, 0.0f);
  std::vector<float> want_w = w, want_m = m, want_v = v, want_g = g;
  kernels::ref::scale_inplace(want_g.data(), n, coefficient);
  kernels::ref::adamw_step(want_w.data(), want_g.data(), want_m.data(), want_v.data(), n, p);

  k->adamw(w.data(), g.data(), m.data(), v.data(), nullptr, n, p, /*clipped=*/true, /*tag=*/0);
  EXPECT_EQ(std::memcmp(w.data(), want_w.data(), n * sizeof(float)), 0) << "master";
  EXPECT_EQ(std::memcmp(m.data(), want_m.data(), n * sizeof(float)), 0) << "m";
  EXPECT_EQ(std::memcmp(v.data(), want_v.data(), n * sizeof(float)), 0) << "v";
  EXPECT_EQ(k->first_nonfinite(), -1) << "every parameter written was finite";
}

// first_nonfinite() names the smallest tag of the updates since the last call that wrote a NaN
// (eps = 0 and a zero gradient with zero moments: 0 / 0), through adamw() and adamw_compact()
// alike, and forgets them.
TEST(CpuStateKernels, FirstNonFiniteNamesTheSmallestTagThatWroteNaN) {
  const int64_t n = 300;
  std::unique_ptr<StateKernels> k = make_cpu_state_kernels();
  kernels::AdamWParams p;
  p.eps = 0.0f;
  p.step = 1;
  auto update = [&](int64_t tag, bool zero_gradient, kernels::MomentFormat format) {
    std::vector<float> w = random_vector(n, 20), g = random_vector(n, 21, 0.25f, 1.0f);
    if (zero_gradient) g[n / 2] = 0.0f;
    if (format == kernels::MomentFormat::kF32) {
      std::vector<float> m(n, 0.0f), v(n, 0.0f);
      k->adamw(w.data(), g.data(), m.data(), v.data(), nullptr, n, p, false, tag);
    } else {
      std::vector<uint8_t> m(kernels::moment_bytes(format, n), 0), v(kernels::moment_bytes(format, n), 0);
      k->adamw_compact(w.data(), g.data(), m.data(), v.data(), format, n, p, {}, false, tag);
    }
    EXPECT_EQ(std::isnan(w[n / 2]), zero_gradient) << "tag " << tag;
  };
  EXPECT_EQ(k->first_nonfinite(), -1);
  update(4, false, kernels::MomentFormat::kF32);
  update(9, true, kernels::MomentFormat::kBf16);
  update(5, true, kernels::MomentFormat::kF32);
  update(2, false, kernels::MomentFormat::kInt8);
  EXPECT_EQ(k->first_nonfinite(), 5);
  EXPECT_EQ(k->first_nonfinite(), -1) << "forgotten once read";
  update(3, true, kernels::MomentFormat::kInt8);
  EXPECT_EQ(k->first_nonfinite(), 3);
}

}  // namespace
}  // namespace strata
