// AdamW's finiteness check on CUDA: the device flag the kernels set when they write a NaN or Inf
// parameter says what the CPU kernels return, for the multi-tensor fp32 step and every compact
// moment format, with the parameters still bitwise the CPU's; a skipped step (NaN clip factor)
// leaves the flag alone; and the CUDA StateKernels name the smallest tag that wrote one, also
// past the number of flags it reads at once.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "../test_util.h"
#include "core/device.h"
#include "gpu_test_util.h"
#include "kernels/adamw.h"
#include "kernels/cuda/ops.h"
#include "kernels/moments.h"
#include "train/state_kernels.h"

namespace strata::testing {
namespace {

namespace kn = kernels;
namespace cu = kernels::cuda;
using kn::MomentFormat;

// eps = 0 throughout. kFinite: every gradient nonzero. kZeroOverZero: gradient `at` is 0 with
// zero moments (0 / 0). kOverflow: element `at` steps past the largest float (Inf).
enum class Outcome { kFinite, kZeroOverZero, kOverflow };
constexpr Outcome kOutcomes[] = {Outcome::kFinite, Outcome::kZeroOverZero, Outcome::kOverflow};

struct Inputs {
  std::vector<float> w, g;
  kn::AdamWParams p;
};

Inputs inputs(int64_t n, int64_t at, Outcome outcome, uint64_t seed) {
  Inputs in{random_vector(n, seed), random_vector(n, seed + 1, 0.25f, 1.0f), {1e-3f, 0.9f, 0.999f, 0.0f, 0.1f, 1}};
  for (int64_t i = 1; i < n; i += 2) in.g[i] = -in.g[i];
  if (outcome == Outcome::kZeroOverZero) in.g[at] = 0.0f;
  if (outcome == Outcome::kOverflow) {
    in.p.lr = 1e33f;  // the first step moves each element by lr against its gradient's sign
    in.p.weight_decay = 0.0f;
    in.w[at] = std::numeric_limits<float>::max();
    in.g[at] = -1.0f;
  }
  return in;
}

int read_flag(const DeviceBuffer<int>& flag) { return flag.download<int>()[0]; }

// Elements that differ bit for bit, a NaN matching any NaN: 0/0 takes the hardware's default NaN,
// negative on x86 and positive on the GPU, and only finite values carry the update's bits.
size_t differing(const std::vector<float>& gpu, const std::vector<float>& cpu) {
  size_t d = 0;
  for (size_t i = 0; i < cpu.size(); ++i)
    d += !(std::isnan(gpu[i]) && std::isnan(cpu[i])) && std::memcmp(&gpu[i], &cpu[i], sizeof(float)) != 0;
  return d;
}

TEST(AdamWNonFiniteParity, MultiTensorFlagSaysWhatTheCpuReturns) {
  StreamGuard stream;
  for (int64_t n : {1, 4095, 4096, 4097, 100003}) {
    for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
      for (Outcome outcome : kOutcomes) {
        const std::string what = "n=" + std::to_string(n) + " at=" + std::to_string(at) +
                                 " outcome=" + std::to_string(static_cast<int>(outcome));
        // Two tensors in one launch; only the second may go wrong.
        const Inputs a = inputs(1000, 0, Outcome::kFinite, 7);
        const Inputs b = inputs(n, at, outcome, 11);
        std::vector<float> wa = a.w, wb = b.w, ma(1000, 0.0f), va = ma, mb(n, 0.0f), vb = mb;
        // One launch takes one set of parameters: b's (a stays finite with them).
        const bool a_finite = kn::cpu::adamw_step(wa.data(), a.g.data(), ma.data(), va.data(), 1000, b.p);
        const bool b_finite = kn::cpu::adamw_step(wb.data(), b.g.data(), mb.data(), vb.data(), n, b.p);
        ASSERT_TRUE(a_finite) << what;
        const bool cpu_finite = b_finite;
        DeviceBuffer<float> dwa(a.w), dga(a.g), dma(std::vector<float>(1000, 0.0f)), dva(std::vector<float>(1000, 0.0f));
        DeviceBuffer<float> dwb(b.w), dgb(b.g), dmb(std::vector<float>(n, 0.0f)), dvb(std::vector<float>(n, 0.0f));
        DeviceBuffer<int> flag(std::vector<int>{0});
        const cu::AdamWTensor list[] = {{dwa.get(), dga.get(), dma.get(), dva.get(), nullptr, 1000},
                                        {dwb.get(), dgb.get(), dmb.get(), dvb.get(), nullptr, n}};
        cu::adamw_step(list, 2, b.p, nullptr, flag.get(), stream.get());
        CUDA_CHECK(cudaStreamSynchronize(stream.get()));
        EXPECT_EQ(cpu_finite, outcome == Outcome::kFinite) << what;
        EXPECT_EQ(read_flag(flag), cpu_finite ? 0 : 1) << what;
        const std::vector<float> gwb = dwb.download<float>();
        EXPECT_EQ(differing(gwb, wb), 0u) << what << " param";
      }
    }
  }
}

TEST(AdamWNonFiniteParity, CompactFlagSaysWhatTheCpuReturns) {
  StreamGuard stream;
  for (MomentFormat format : {MomentFormat::kF32, MomentFormat::kBf16, MomentFormat::kInt8}) {
    for (int64_t n : {1, 257, 100003}) {
      for (int64_t at : {int64_t{0}, n - 1}) {
        for (Outcome outcome : kOutcomes) {
          const std::string what = std::string(kn::moment_format_name(format)) + " n=" + std::to_string(n) +
                                   " at=" + std::to_string(at) + " outcome=" + std::to_string(int(outcome));
          const Inputs in = inputs(n, at, outcome, 3);
          std::vector<float> w = in.w;
          std::vector<uint8_t> m(kn::moment_bytes(format, n)), v(kn::moment_bytes(format, n));
          const std::vector<float> zeros(static_cast<size_t>(n), 0.0f);
          kn::cpu::encode_moments(m.data(), zeros.data(), format, false, n);
          kn::cpu::encode_moments(v.data(), zeros.data(), format, true, n);
          DeviceBuffer<float> dw(in.w), dg(in.g);
          DeviceBuffer<uint8_t> dm(m), dv(v);
          DeviceBuffer<int> flag(std::vector<int>{0});
          const bool cpu_finite =
              kn::cpu::adamw_step_compact(w.data(), in.g.data(), m.data(), v.data(), format, n, in.p, {});
          cu::adamw_step_compact(dw.get(), dg.get(), dm.get(), dv.get(), format, n, in.p, {}, nullptr, flag.get(),
                                 stream.get());
          CUDA_CHECK(cudaStreamSynchronize(stream.get()));
          EXPECT_EQ(cpu_finite, outcome == Outcome::kFinite) << what;
          EXPECT_EQ(read_flag(flag), cpu_finite ? 0 : 1) << what;
          const std::vector<float> gw = dw.download<float>();
          EXPECT_EQ(differing(gw, w), 0u) << what << " param";
        }
      }
    }
  }
}

// A NaN clip factor skips the step on the device: nothing is written, the flag stays 0.
TEST(AdamWNonFiniteParity, ASkippedStepLeavesTheFlagAlone) {
  StreamGuard stream;
  const int64_t n = 1000;
  const Inputs in = inputs(n, 5, Outcome::kZeroOverZero, 5);
  DeviceBuffer<float> dw(in.w), dg(in.g), dm(std::vector<float>(n, 0.0f)), dv(std::vector<float>(n, 0.0f));
  DeviceBuffer<float> factor(std::vector<float>{std::numeric_limits<float>::quiet_NaN()});
  DeviceBuffer<int> flag(std::vector<int>{0});
  const cu::AdamWTensor t{dw.get(), dg.get(), dm.get(), dv.get(), nullptr, n};
  cu::adamw_step(&t, 1, in.p, factor.get(), flag.get(), stream.get());
  CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  EXPECT_EQ(read_flag(flag), 0);
  const std::vector<float> w = dw.download<float>();
  EXPECT_EQ(std::memcmp(w.data(), in.w.data(), w.size() * sizeof(float)), 0);
}

// The CUDA StateKernels: the smallest tag whose update wrote NaN, over more calls than the
// flags it holds (an early read in between), then -1 once read; the CPU's say the same.
TEST(AdamWNonFiniteParity, StateKernelsNameTheSmallestTagAsTheCpuDoes) {
  Result<std::unique_ptr<Device>> device = open_device("cuda", 0, uint64_t{1} << 30);
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  Result<std::unique_ptr<StateKernels>> made = make_cuda_state_kernels(**device);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  StateKernels& gpu = **made;
  std::unique_ptr<StateKernels> cpu = make_cpu_state_kernels();
  const int64_t n = 64;
  const int calls = 5000;
  const Inputs good = inputs(n, 0, Outcome::kFinite, 9), bad = inputs(n, 3, Outcome::kZeroOverZero, 9);
  const std::vector<float> zeros(static_cast<size_t>(n), 0.0f);
  // The good calls keep updating one tensor (every gradient nonzero: it stays finite); each bad
  // call starts another from fresh state.
  DeviceBuffer<float> good_w(good.w), good_g(good.g), good_m(zeros), good_v(zeros);
  DeviceBuffer<float> bad_w(bad.w), bad_g(bad.g), bad_m(zeros), bad_v(zeros);
  for (int round = 0; round < 2; ++round) {
    // Round 0: calls 4700 and 4321 go wrong (past the first read); round 1: call 17 only.
    for (int call = 0; call < calls; ++call) {
      const int64_t tag = 10000 - call;  // tags need not follow the call order
      const bool wrong = round == 0 ? (call == 4700 || call == 4321) : call == 17;
      if (wrong) {
        gpu.synchronize();  // the uploads run on another stream
        bad_w.upload(bad.w);
        bad_m.upload(zeros);
        bad_v.upload(zeros);
        gpu.adamw(bad_w.get(), bad_g.get(), bad_m.get(), bad_v.get(), nullptr, n, bad.p, false, tag);
      } else {
        gpu.adamw(good_w.get(), good_g.get(), good_m.get(), good_v.get(), nullptr, n, good.p, false, tag);
      }
      std::vector<float> w = wrong ? bad.w : good.w, g = wrong ? bad.g : good.g, m = zeros, v = zeros;
      cpu->adamw(w.data(), g.data(), m.data(), v.data(), nullptr, n, good.p, false, tag);
    }
    const int64_t want = round == 0 ? 10000 - 4700 : 10000 - 17;
    EXPECT_EQ(cpu->first_nonfinite(), want) << "round " << round;
    EXPECT_EQ(gpu.first_nonfinite(), want) << "round " << round;
    EXPECT_EQ(gpu.first_nonfinite(), -1) << "round " << round << ": read twice";
  }
}

}  // namespace
}  // namespace strata::testing
