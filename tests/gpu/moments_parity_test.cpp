// Compact Adam moments on CUDA: parameters and stored moment bytes bitwise equal to
// kernels::cpu::adamw_step_compact, for every format, both roundings, sizes that are and are
// not a multiple of the 8-bit block, and blocks whose v spans more decades than the table.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../test_util.h"
#include "gpu_test_util.h"
#include "kernels/cuda/ops.h"
#include "kernels/moments.h"

namespace strata::testing {
namespace {

namespace kn = kernels;
using kn::MomentFormat;

// Moments as a few steps of training leave them: m signed, v >= 0, magnitudes spread over
// `decades` decades, some zeros, and (for n > 512) a whole block of zeros.
std::vector<float> moment_values(int64_t n, uint64_t seed, bool is_v, double decades) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double mag = 1e-3 * std::pow(10.0, -decades * u(rng));
    x[i] = static_cast<float>(is_v ? mag * mag : (u(rng) < 0.5 ? -mag : mag));
    if (i % 61 == 2 || i / kn::kMomentBlock == 2) x[i] = 0.0f;
  }
  return x;
}

TEST(MomentsParity, CompactAdamWMatchesTheCpuBitwise) {
  StreamGuard stream;
  for (MomentFormat format : {MomentFormat::kF32, MomentFormat::kBf16, MomentFormat::kInt8}) {
    for (int64_t n : {1, 255, 257, 1000, 100003}) {
      for (bool stochastic : {false, true}) {
        const std::string what = std::string(kn::moment_format_name(format)) + " n=" + std::to_string(n) +
                                 (stochastic ? " stochastic" : " nearest");
        std::vector<float> p = random_vector(n, 1 + n);
        std::vector<uint8_t> m(kn::moment_bytes(format, n)), v(kn::moment_bytes(format, n));
        kn::cpu::encode_moments(m.data(), moment_values(n, 2 + n, false, 6).data(), format, false, n);
        kn::cpu::encode_moments(v.data(), moment_values(n, 3 + n, true, 9).data(), format, true, n);
        DeviceBuffer<float> dp(p);
        DeviceBuffer<uint8_t> dm(m), dv(v);
        for (int64_t step = 1; step <= 4; ++step) {
          // Gradients over six decades, some exactly 0.
          std::vector<float> g = random_vector(n, 10 * n + step, -1e-2f, 1e-2f);
          for (int64_t i = 0; i < n; ++i) g[i] *= std::pow(10.0f, -float(i % 6));
          if (n > 5) g[5] = 0.0f;
          DeviceBuffer<float> dg(g);
          kn::AdamWParams params;
          params.lr = 3e-4f;
          params.beta1 = step % 2 == 0 ? 0.9f : 0.3f;  // both of PyTorch's lerp formulas
          params.weight_decay = 0.1f;
          params.step = step;
          const kn::MomentRounding rounding{stochastic, 1234 + uint64_t(step)};
          kn::cpu::adamw_step_compact(p.data(), g.data(), m.data(), v.data(), format, n, params, rounding);
          kn::cuda::adamw_step_compact(dp.get(), dg.get(), dm.get(), dv.get(), format, n, params, rounding,
                                       stream.get());
          CUDA_CHECK(cudaStreamSynchronize(stream.get()));
        }
        const std::vector<float> gp = dp.download<float>();
        EXPECT_EQ(std::memcmp(gp.data(), p.data(), p.size() * sizeof(float)), 0) << what << " param";
        EXPECT_TRUE(dm.download<uint8_t>() == m) << what << " m";
        EXPECT_TRUE(dv.download<uint8_t>() == v) << what << " v";
      }
    }
  }
}

}  // namespace
}  // namespace strata::testing
