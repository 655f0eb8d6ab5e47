// Helpers for the GPU tests of whole models: random token batches, the cosine of two gradients,
// and a decoder of some recipe over a PagedState on the GPU or on the CPU.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "core/check.h"
#include "core/device.h"
#include "model/config.h"
#include "model/cuda/decoder_cuda.h"
#include "model/decoder.h"
#include "train/paged_state.h"
#include "train/state_kernels.h"

namespace strata::testing {

struct Batch {
  std::vector<int32_t> inputs;   // (B, T)
  std::vector<int32_t> targets;  // (B, T), -1 = ignored
};

// n random tokens of a vocabulary, every seventh target ignored (as padding would be).
inline Batch random_batch(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  Batch b;
  for (int64_t i = 0; i < n; ++i) {
    b.inputs.push_back(token(rng));
    b.targets.push_back(i % 7 == 5 ? -1 : token(rng));
  }
  return b;
}

inline double cosine(const float* a, const float* b, int64_t n) {
  double ab = 0, aa = 0, bb = 0;
  for (int64_t i = 0; i < n; ++i) {
    ab += double(a[i]) * b[i];
    aa += double(a[i]) * a[i];
    bb += double(b[i]) * b[i];
  }
  return ab / (std::sqrt(aa) * std::sqrt(bb));
}

// A decoder computing with `compute` weights (kF8E4M3: the fp8 recipe, kNF4: the bf16 recipe
// over an nf4 base, kBF16: the bf16 recipe) over a PagedState of that recipe on the GPU or the
// CPU, device_bytes of its chunks on the device, the rest in host memory.
struct PagedModel {
  std::unique_ptr<Device> device;
  std::unique_ptr<StateKernels> kernels;
  std::unique_ptr<model::Model> net;
  std::unique_ptr<PagedState> state;

  PagedModel(const model::ModelConfig& config, bool cuda, DType compute, const OptimizerConfig& optimizer,
             uint64_t device_bytes = uint64_t{1} << 30) {
    Result<std::unique_ptr<Device>> d = cuda ? open_device("cuda", 0, uint64_t{8} << 30) : open_device("cpu", 0, 0);
    CHECK_MSG(d.ok(), d.status().to_string());
    device = std::move(d).value();
    if (cuda) {
      Result<std::unique_ptr<StateKernels>> k = make_cuda_state_kernels(*device);
      CHECK_MSG(k.ok(), k.status().to_string());
      kernels = std::move(k).value();
      Result<std::unique_ptr<model::Model>> m = model::make_cuda_decoder(*device, config, compute);
      CHECK_MSG(m.ok(), m.status().to_string());
      net = std::move(m).value();
    } else {
      net = model::make_cpu_decoder(compute, config, device.get());
    }
    PagedStateOptions po;
    po.device_bytes = device_bytes;
    po.host_bytes = uint64_t{1} << 30;
    po.optimizer = optimizer;
    po.precision = compute == DType::kF8E4M3 ? Precision::kFp8 : compute == DType::kNF4 ? Precision::kNf4
                                                                                          : Precision::kBf16;
    po.device_kernels = kernels.get();
    Result<std::unique_ptr<PagedState>> s = PagedState::create(*device, nullptr, net->layout(), po);
    CHECK_MSG(s.ok(), s.status().to_string());
    state = std::move(s).value();
    net->set_access(state.get());
  }
  ~PagedModel() {
    net->set_access(nullptr);
    state.reset();
    net.reset();
    kernels.reset();
  }
  std::vector<float> grads() {
    std::vector<float> g(static_cast<size_t>(net->layout().total_size()));
    CHECK(state->store_grads(g.data()).ok());
    return g;
  }
  std::vector<float> params() {
    std::vector<float> p(static_cast<size_t>(net->layout().total_size()));
    CHECK(state->store_params(p.data()).ok());
    return p;
  }
};

// Three AdamW steps (lr 1e-3) of a B x T batch each, from `init`, on the CPU, on the GPU with
// room and on the GPU with `tight_device_bytes` of device chunks: each step's loss on the GPU
// within loss_tol of the CPU's (relative), and the tight run's losses, gradient norms and final
// parameters bitwise the roomy run's.
inline void expect_steps_track_cpu_and_page_bitwise(const model::ModelConfig& config, DType compute,
                                                    const OptimizerConfig& optimizer, const std::vector<float>& init,
                                                    uint64_t tight_device_bytes, uint64_t batch_seed,
                                                    double loss_tol) {
  const int64_t B = 2, T = 64;
  auto run = [&](bool cuda, uint64_t device_bytes, std::vector<double>& losses) {
    PagedModel m(config, cuda, compute, optimizer, device_bytes);
    CHECK(m.state->load_params(init.data()).ok());
    for (int step = 0; step < 3; ++step) {
      CHECK(m.state->zero_grads().ok());
      const Batch b = random_batch(B * T, config.vocab_size, batch_seed + static_cast<uint64_t>(step));
      Result<double> loss = m.net->compute(b.inputs.data(), b.targets.data(), B, T, 1.0f / (B * T), true);
      CHECK_MSG(loss.ok(), loss.status().to_string());
      losses.push_back(*loss);
      Result<double> norm = m.state->clip_and_step(1e-3f);
      CHECK_MSG(norm.ok(), norm.status().to_string());
      losses.push_back(*norm);
    }
    return m.params();
  };
  std::vector<double> cpu_losses, resident_losses, paged_losses;
  run(false, uint64_t{1} << 30, cpu_losses);
  const std::vector<float> resident = run(true, uint64_t{1} << 30, resident_losses);
  const std::vector<float> paged = run(true, tight_device_bytes, paged_losses);
  for (size_t i = 0; i < cpu_losses.size(); i += 2) {
    const double err = std::abs(resident_losses[i] - cpu_losses[i]) / std::abs(cpu_losses[i]);
    std::printf("step %zu: loss gpu %.6f cpu %.6f (rel %.2e)\n", i / 2 + 1, resident_losses[i], cpu_losses[i], err);
    EXPECT_TRUE(err <= loss_tol) << "step " << i / 2 + 1;
  }
  EXPECT_EQ(paged_losses, resident_losses) << "paging changed the losses or gradient norms";
  EXPECT_TRUE(paged == resident) << "paging changed the parameters";
}

}  // namespace strata::testing
