// strata bench queue: the CPU backend's compute stream against direct calls. Two fp32 models of
// the configured shape with the same weights: one made without a Device (every op runs in the
// caller), one on a cpu Device (every op is a task on its compute stream, as `strata train`
// runs it). Both read flat buffers through a FlatAccess, so the queued one waits for its ops
// each time it ends a layer (a paged run orders its moves on the stream instead). Their
// forward/backward passes alternate on the same micro-batch, so both see the same machine
// state, and the medians are compared. The cost of one queued task (enqueue, run,
// synchronize) is measured apart, as the reference that bounds the difference.
#include "tools/strata/bench_queue.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cpu_device.h"
#include "core/log.h"
#include "model/decoder.h"
#include "model/flat_access.h"
#include "model/params.h"
#include "tools/strata/run_args.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace strata::tools {
namespace {

constexpr const char* kUsage = R"(Usage: strata bench queue [CONFIG.yaml] [key=value ...] [--steps N]

What the CPU backend's queued compute stream costs. Builds the model of CONFIG (default: the
embedded demo) twice in fp32 with the same weights, once with its ops run in the caller and once
with them queued on a cpu device's compute stream (what `strata train` runs), and alternates
--steps forward/backward passes (default 30) of one micro-batch (train.micro_batch x
train.seq_len) between them. Prints the median pass of each, their ratio, whether their losses
agree bit for bit, and the cost of one empty queued task measured apart.
)";

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Microseconds per task of `tasks` empty tasks queued then waited for together.
double empty_task_us(CpuDevice& device, int tasks) {
  std::unique_ptr<CpuStream> stream = device.create_cpu_stream();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < tasks; ++i) stream->enqueue([] {});
  stream->synchronize();
  return ms_since(t0) * 1e3 / tasks;
}

int fail(const std::string& message) {
  std::fprintf(stderr, "strata bench queue: error: %s\n", message.c_str());
  return 1;
}

}  // namespace

int bench_queue_command(const std::vector<std::string>& args) {
  RunArgs run_args;
  run_args.steps = 30;
  if (const int rc = parse_run_args(args, "strata bench queue", kUsage, 2, &run_args); rc >= 0) return rc;
  const int64_t steps = run_args.steps;
  Result<Config> config = load_train_config(run_args.config_path, run_args.overrides);
  if (!config.ok()) return fail(config.status().message());
  Result<TrainConfig> tc = make_train_config(*config);
  if (!tc.ok()) return fail(tc.status().message());
  Result<model::ModelConfig> mc = resolve_model_config(*tc);
  if (!mc.ok()) return fail(mc.status().message());
  LogOptions lo;
  lo.level = LogLevel::kWarn;
  init_logging(lo);

  Result<std::unique_ptr<CpuDevice>> device = CpuDevice::create(0, 0, 0);
  if (!device.ok()) return fail(device.status().message());
  model::LlamaModel direct(*mc);
  model::LlamaModel queued(*mc, model::CpuF32Model(device->get()));
  // Each model's fp32 parameters and gradients in flat buffers, the same initial weights in both.
  const size_t n = static_cast<size_t>(direct.layout().total_size());
  std::vector<float> direct_params(n), queued_params(n), direct_grads(n), queued_grads(n);
  model::init_weights(direct.layout(), direct_params.data(), tc->seed);
  queued_params = direct_params;
  model::FlatAccess direct_access(DType::kF32, direct_params.data(), direct_grads.data());
  model::FlatAccess queued_access(DType::kF32, queued_params.data(), queued_grads.data());
  direct.set_access(&direct_access);
  queued.set_access(&queued_access);
  const int64_t B = tc->micro_batch, T = tc->seq_len, N = B * T;
  std::vector<int32_t> inputs(static_cast<size_t>(N)), targets(static_cast<size_t>(N));
  std::mt19937 rng(1);
  for (int64_t i = 0; i < N; ++i) {
    inputs[static_cast<size_t>(i)] = static_cast<int32_t>(rng() % static_cast<uint32_t>(mc->vocab_size));
    targets[static_cast<size_t>(i)] = static_cast<int32_t>(rng() % static_cast<uint32_t>(mc->vocab_size));
  }
  std::vector<double> direct_ms, queued_ms;
  bool same = true;
  for (int64_t s = 0; s < steps + 1; ++s) {
    std::fill(direct_grads.begin(), direct_grads.end(), 0.0f);
    std::fill(queued_grads.begin(), queued_grads.end(), 0.0f);
    auto t0 = std::chrono::steady_clock::now();
    const double a = direct.forward_backward(inputs.data(), targets.data(), B, T, 1.0f / static_cast<float>(N));
    const double da = ms_since(t0);
    t0 = std::chrono::steady_clock::now();
    const double b = queued.forward_backward(inputs.data(), targets.data(), B, T, 1.0f / static_cast<float>(N));
    const double db = ms_since(t0);
    same = same && std::memcmp(&a, &b, sizeof(double)) == 0;
    if (s == 0) continue;  // warm-up: first touches of the activation table
    direct_ms.push_back(da);
    queued_ms.push_back(db);
  }
  same = same && std::memcmp(direct_grads.data(), queued_grads.data(), n * sizeof(float)) == 0;
  const double d = median(direct_ms), q = median(queued_ms);
  const double task_us = empty_task_us(**device, 100000);
  std::printf("queued compute stream against direct calls: %lld forward/backward passes of %lld x %lld tokens each, "
              "alternating (medians)\n",
              static_cast<long long>(steps), static_cast<long long>(B), static_cast<long long>(T));
  std::printf("  %-34s %10.3f ms   (reference)\n", "pass, ops in the caller", d);
  std::printf("  %-34s %10.3f ms   %+.2f%%\n", "pass, ops on the compute stream", q, d > 0 ? 100.0 * (q - d) / d : 0.0);
  std::printf("  %-34s %10.3f us\n", "an empty queued task", task_us);
  std::printf("  %-34s %10s\n", "losses and gradients bitwise equal", same ? "yes" : "NO");
  return same ? 0 : 1;
}

}  // namespace strata::tools
