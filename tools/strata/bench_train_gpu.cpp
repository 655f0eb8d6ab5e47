// strata bench train-gpu: how fast `strata train` trains a Llama on one GPU — the real trainer
// (run_training, the same code path as `strata train run.device=cuda`) under a device budget of
// the user's choosing — in tokens/s and model TFLOP/s as the trainer's metrics count them,
// beside a cuBLAS bf16 GEMM ceiling measured in the same run. The PyTorch baseline of the same
// shape is tools/bench_gpu_train_torch.py; tools/gpu_check.sh runs both.
// In a build without the CUDA backend the command explains that and exits 1.
#include "tools/strata/bench_train_gpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/config.h"
#include "core/status.h"
#include "train/trainer.h"

#if STRATA_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "core/check.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/cuda_device.h"
#include "core/device.h"
#include "kernels/cuda/ops.h"
#endif

namespace strata::tools {
namespace {

constexpr const char* kUsage = R"(Usage: strata bench train-gpu [--preset 0.44b|3.6b|8b|tiny] [--steps 20] [--warmup 3]
                              [--micro-batch 8] [--seq 2048] [--grad-accum 1] [--lr 3e-4]
                              [--memory-device 0] [--memory-host 0] [--nvme DIR --nvme-size SIZE]
                              [--precision bf16|fp8]

Runs `strata train run.device=cuda` itself (the same trainer, engine and metrics) on GPU 0: a
Llama from random weights (normal(0, 0.02), train.seed 1) trained on the built-in corpus with
the CUDA backend (bf16 compute copy and activations; fp32 master weights, gradients and AdamW
moments; beta 0.9/0.95, weight decay 0.1, gradient clipping at norm 1.0, a constant learning
rate) over the paged state, which the planner places across --memory-device (0 = the whole free
device), --memory-host (0 = 80% of RAM) and an optional nvme directory. A step is GRAD_ACCUM
micro-batches of MICRO_BATCH sequences of SEQ tokens, then one AdamW update. WARMUP untimed
steps, then STEPS timed ones. Sizes take units (24GiB). --precision fp8 runs the fp8 recipe
instead (E4M3 compute copies of the linear weights, their GEMMs on cuBLASLt's block-scaled FP8
kernels; docs/precision.md). The run's folder is a temporary one, removed at the end.

Presets (untied embeddings; the trainer's model.preset with model.set overrides):
  0.44b  hidden 1024, 24 layers, 16 heads, 8 KV heads, FFN 4096, vocab 32000 (0.44B; the shape of
         the PyTorch baseline tools/bench_gpu_train_torch.py)
  3.6b   the Llama-3.2-3B shape: hidden 3072, 28 layers, 24 heads, 8 KV heads, FFN 8192,
         vocab 128256
  8b     the Llama-3-8B shape (model.preset llama3-8b): hidden 4096, 32 layers, 32 heads, 8 KV
         heads, FFN 14336, vocab 128256
  tiny   hidden 256, 2 layers, 4 heads, 2 KV heads, FFN 768, vocab 1024 (a quick smoke run)

Prints the trainer's log, then tokens/s and model TFLOP/s of the timed steps from the trainer's
metrics (FLOPs per token = 6*N + 12*L*H*T, where N counts EVERY parameter, embeddings and LM
head included, L is the number of layers, H the hidden size and T the sequence length: the
formula of the PyTorch baseline), and the fraction of a cuBLAS bf16 GEMM (8192^3) ceiling timed
in the same run. The last line, "RESULT {json}", is for tools/gpu_check.sh. Needs a build
configured with -DSTRATA_CUDA=ON.
)";

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "strata bench train-gpu: error: %s (see strata bench train-gpu --help)\n", msg.c_str());
  return 2;
}

int fail(const std::string& msg) {
  std::fprintf(stderr, "strata bench train-gpu: error: %s\n", msg.c_str());
  return 1;
}

struct Options {
  std::string preset = "0.44b";
  int64_t steps = 20;
  int64_t warmup = 3;
  int64_t micro_batch = 8;
  int64_t seq = 2048;
  int64_t grad_accum = 1;
  float lr = 3e-4f;
  std::string memory_device = "0";
  std::string memory_host = "0";
  std::string nvme;
  std::string nvme_size = "0";
  std::string precision = "bf16";
};

// Parses an integer in [lo, hi]; false when `text` is not one.
bool parse_int(const std::string& text, int64_t lo, int64_t hi, int64_t* out) {
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

// A benchmark preset as the trainer knows models: one of its presets (model.preset) and the
// model.set overrides that shape it.
struct BenchPreset {
  const char* name;
  const char* base;
  std::vector<std::string> set;
};

const std::vector<BenchPreset>& bench_presets() {
  static const std::vector<BenchPreset> presets = {
      {"0.44b", "tiny",
       {"vocab_size=32000", "hidden_size=1024", "intermediate_size=4096", "num_hidden_layers=24",
        "num_attention_heads=16", "num_key_value_heads=8", "rms_norm_eps=1e-6"}},
      {"3.6b", "llama3-8b",
       {"hidden_size=3072", "intermediate_size=8192", "num_hidden_layers=28", "num_attention_heads=24",
        "rms_norm_eps=1e-6"}},
      {"8b", "llama3-8b", {"rms_norm_eps=1e-6"}},
      {"tiny", "tiny",
       {"vocab_size=1024", "hidden_size=256", "intermediate_size=768", "num_hidden_layers=2", "num_attention_heads=4",
        "num_key_value_heads=2", "rms_norm_eps=1e-6"}},
  };
  return presets;
}

const BenchPreset* find_preset(const std::string& name) {
  for (const BenchPreset& p : bench_presets())
    if (name == p.name) return &p;
  return nullptr;
}

// The settings `strata train` runs the benchmark with: its schema's defaults, the preset's
// model and these options, in `run_dir`.
Result<Config> bench_config(const Options& opt, const BenchPreset& preset, const std::string& run_dir) {
  std::string yaml = std::string("model:\n  preset: ") + preset.base + "\n  set:\n";
  std::vector<std::string> set = preset.set;
  set.push_back("max_position_embeddings=" + std::to_string(std::max<int64_t>(2048, opt.seq)));
  for (const std::string& kv : set) yaml += "    - \"" + kv + "\"\n";
  const std::vector<std::string> overrides = {
      "train.micro_batch=" + std::to_string(opt.micro_batch), "train.seq_len=" + std::to_string(opt.seq),
      "train.grad_accum=" + std::to_string(opt.grad_accum),   "train.steps=" + std::to_string(opt.warmup + opt.steps),
      "train.seed=1",                                          "train.precision=" + opt.precision,
      "memory.device=" + opt.memory_device,                   "memory.host=" + opt.memory_host,
      "memory.nvme.path=" + opt.nvme,                         "memory.nvme.size=" + opt.nvme_size,
      "optim.lr=" + fmt::format("{}", opt.lr),                 "optim.schedule=constant",
      "optim.warmup_steps=0",                                 "optim.beta1=0.9",
      "optim.beta2=0.95",                                     "optim.eps=1e-8",
      "optim.weight_decay=0.1",                               "optim.grad_clip=1.0",
      "train.max_skipped_steps=0",                            "ckpt.every=0",
      "run.device=cuda",                                      "run.dir=" + run_dir};
  return Config::parse(train_schema(), yaml, "<bench train-gpu --preset " + opt.preset + ">", overrides);
}

#if STRATA_HAVE_CUDA

// The timed steps as the trainer's metrics count them (its log shows every step).
class StepRecorder final : public RunObserver {
 public:
  explicit StepRecorder(int64_t warmup) : warmup_(warmup) {}
  void on_start(const TrainConfig& /*t*/, const PagedEngine& engine) override {
    std::printf("plan: %s\n", engine.memory_summary().c_str());
    std::fflush(stdout);
  }
  void on_step_end(const StepMetrics& m) override {
    if (m.step <= warmup_) return;
    seconds_.push_back(m.ms / 1e3);
    tflop_ += m.model_tflops * m.ms / 1e3;
  }
  const std::vector<double>& seconds() const { return seconds_; }
  double tflop() const { return tflop_; }  // model TFLOP of the timed steps

 private:
  int64_t warmup_;
  std::vector<double> seconds_;
  double tflop_ = 0;
};

// Next value of a 64-bit LCG (Knuth's MMIX constants); the high bits are the random ones.
uint64_t lcg_next(uint64_t* state) {
  *state = *state * 6364136223846793005ull + 1442695040888963407ull;
  return *state >> 33;
}

// TFLOP/s of a plain cuBLAS bf16 GEMM 8192^3 (fp32 accumulation): one warm-up call, then the
// mean of 20, timed with events. Operands are random bf16 in +-[2^-7, 2^-2) so that the power
// draw is that of real data. They and the GEMM workspace come from a device arena of their own.
Result<double> gemm_ceiling_tflops() {
  constexpr int n = 8192;
  constexpr int kIters = 20;
  const size_t count = size_t{n} * n;
  const size_t workspace = kernels::cuda::Context::kDefaultGemmWorkspaceBytes;
  ASSIGN_OR_RETURN(std::unique_ptr<Device> device, open_device("cuda", 0, 3 * count * 2 + workspace + (64ull << 20)));
  ASSIGN_OR_RETURN(DeviceAllocation a, device->allocate(count * 2));
  ASSIGN_OR_RETURN(DeviceAllocation b, device->allocate(count * 2));
  ASSIGN_OR_RETURN(DeviceAllocation c, device->allocate(count * 2));
  ASSIGN_OR_RETURN(DeviceAllocation ws, device->allocate(workspace));
  std::vector<uint16_t> bits(count);
  uint64_t state = 7;
  for (auto& v : bits) {
    const uint64_t r = lcg_next(&state);
    v = static_cast<uint16_t>(0x3C00 + (r & 0x3FF)) | static_cast<uint16_t>(((r >> 10) & 1) << 15);
  }
  CUDA_CHECK(cudaMemcpy(a.data(), bits.data(), count * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(b.data(), bits.data(), count * 2, cudaMemcpyHostToDevice));
  double tflops = 0;
  {
    kernels::cuda::Context ctx(nullptr, 0, ws.data(), workspace);
    cudaStream_t stream = nullptr;
    cublasHandle_t handle = ctx.blas(stream);
    const float alpha = 1.0f, beta = 0.0f;
    const auto gemm = [&] {
      CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.data(), CUDA_R_16BF, n, b.data(),
                         CUDA_R_16BF, n, &beta, c.data(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
    };
    gemm();
    cudaEvent_t start = nullptr, stop = nullptr;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < kIters; ++i) gemm();
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    tflops = 2.0 * n * n * static_cast<double>(n) / (ms / kIters * 1e-3) / 1e12;
  }  // the Context waits for the device before the buffers go back to the arena
  return tflops;
}

int run(const Options& opt, const BenchPreset& preset) {
  if (cuda_device_count() == 0) return fail("no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)");
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::error_code ec;
  std::string tmpl = (std::filesystem::temp_directory_path(ec) / "strata-bench-train-gpu.XXXXXX").string();
  if (ec || mkdtemp(tmpl.data()) == nullptr) return fail("cannot create a temporary folder for the run");
  const std::filesystem::path work = tmpl;
  struct RemoveAll {
    std::filesystem::path path;
    ~RemoveAll() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  } remove_work{work};
  Result<Config> config = bench_config(opt, preset, (work / "run").string());
  if (!config.ok()) return fail(config.status().message());
  Result<TrainConfig> tc = make_train_config(*config);
  if (!tc.ok()) return fail(tc.status().message());
  Result<model::ModelConfig> mc = resolve_model_config(*tc);
  if (!mc.ok()) return fail(mc.status().message());
  const int64_t B = opt.micro_batch, T = opt.seq, A = opt.grad_accum;
  const int64_t n_params = mc->num_parameters();
  const int64_t tokens_per_step = B * T * A;
  std::printf(
      "train-gpu benchmark on %s: preset %s in %s, %.3fB parameters, %lld x %lld tokens x %lld "
      "micro-batches = %lld tokens/step, %lld warm-up + %lld timed steps\n",
      prop.name, opt.preset.c_str(), opt.precision.c_str(), static_cast<double>(n_params) / 1e9,
      static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(A),
      static_cast<long long>(tokens_per_step), static_cast<long long>(opt.warmup), static_cast<long long>(opt.steps));
  std::fflush(stdout);

  StepRecorder recorder(opt.warmup);
  Result<TrainSummary> trained = run_training(*tc, config->to_yaml(), &recorder);
  if (!trained.ok()) return fail(trained.status().message());
  if (trained->skipped_steps > 0 || !std::isfinite(trained->last_loss))
    return fail("the loss is not finite; the throughput of a diverged run is not a result");
  const std::vector<double>& seconds = recorder.seconds();
  if (seconds.size() != static_cast<size_t>(opt.steps))
    return fail("the run ended after " + std::to_string(trained->steps_done) + " steps, before the timed ones were done");

  double total = 0;
  for (double s : seconds) total += s;
  std::vector<double> sorted = seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median_ms = sorted[sorted.size() / 2] * 1e3;
  const double tokens_per_s = static_cast<double>(tokens_per_step) * static_cast<double>(opt.steps) / total;
  const double tflops = recorder.tflop() / total;
  // Measured with the run's engine freed, on the GPU still warm from training.
  Result<double> ceiling = gemm_ceiling_tflops();
  if (!ceiling.ok()) return fail("the GEMM ceiling: " + ceiling.status().message());

  std::printf("\nstep time       mean %.2f ms, median %.2f ms, min %.2f ms, max %.2f ms\n",
              total / static_cast<double>(opt.steps) * 1e3, median_ms, sorted.front() * 1e3, sorted.back() * 1e3);
  std::printf("tokens/s        %.0f\n", tokens_per_s);
  std::printf("model TFLOP/s   %.1f  (the trainer's 6N + 12*L*H*T per token, N = %lld, all parameters)\n", tflops,
              static_cast<long long>(n_params));
  std::printf("GEMM ceiling    %.1f TFLOP/s (cuBLAS bf16 8192^3, same run): model TFLOP/s = %.1f%%\n", *ceiling,
              100.0 * tflops / *ceiling);
  std::printf("loss            %.4f -> %.4f\n", trained->first_loss, trained->last_loss);
  std::printf(
      "RESULT {\"impl\": \"strata\", \"preset\": \"%s\", \"precision\": \"%s\", \"params\": %lld, \"micro_batch\": %lld, "
      "\"seq\": %lld, \"grad_accum\": %lld, \"tokens_per_step\": %lld, \"steps\": %lld, "
      "\"memory_device\": \"%s\", \"step_ms_median\": %.3f, \"tokens_per_s\": %.1f, \"tflops\": %.2f, "
      "\"gemm_ceiling_tflops\": %.2f, \"final_loss\": %.4f}\n",
      opt.preset.c_str(), opt.precision.c_str(), static_cast<long long>(n_params), static_cast<long long>(B),
      static_cast<long long>(T), static_cast<long long>(A), static_cast<long long>(tokens_per_step),
      static_cast<long long>(opt.steps), opt.memory_device.c_str(), median_ms, tokens_per_s, tflops, *ceiling,
      trained->last_loss);
  return 0;
}

#endif  // STRATA_HAVE_CUDA

}  // namespace

int bench_train_gpu_command(const std::vector<std::string>& args) {
  Options opt;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (i + 1 >= args.size()) return usage_error("option '" + a + "' needs a value");
    const std::string& v = args[++i];
    if (a == "--preset") {
      opt.preset = v;
    } else if (a == "--steps") {
      if (!parse_int(v, 1, 100000, &opt.steps)) return usage_error("--steps must be in [1, 100000]");
    } else if (a == "--warmup") {
      if (!parse_int(v, 0, 100000, &opt.warmup)) return usage_error("--warmup must be in [0, 100000]");
    } else if (a == "--micro-batch") {
      if (!parse_int(v, 1, 4096, &opt.micro_batch)) return usage_error("--micro-batch must be in [1, 4096]");
    } else if (a == "--seq") {
      if (!parse_int(v, 2, 1 << 20, &opt.seq)) return usage_error("--seq must be in [2, 1048576]");
    } else if (a == "--grad-accum") {
      if (!parse_int(v, 1, 4096, &opt.grad_accum)) return usage_error("--grad-accum must be in [1, 4096]");
    } else if (a == "--lr") {
      char* end = nullptr;
      const double lr = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || !(lr >= 0.0 && lr < 1.0)) {
        return usage_error("--lr must be a number in [0, 1)");
      }
      opt.lr = static_cast<float>(lr);
    } else if (a == "--memory-device") {
      opt.memory_device = v;
    } else if (a == "--memory-host") {
      opt.memory_host = v;
    } else if (a == "--nvme") {
      opt.nvme = v;
    } else if (a == "--nvme-size") {
      opt.nvme_size = v;
    } else if (a == "--precision") {
      if (v != "bf16" && v != "fp8") return usage_error("--precision must be bf16 or fp8");
      opt.precision = v;
    } else {
      return usage_error("unknown option '" + a + "'");
    }
  }
  const BenchPreset* preset = find_preset(opt.preset);
  if (preset == nullptr)
    return usage_error("unknown preset '" + opt.preset + "'; presets are 0.44b, 3.6b, 8b and tiny");
  // The settings are checked before the GPU is looked for.
  if (Result<Config> config = bench_config(opt, *preset, "<temporary>"); !config.ok()) {
    return usage_error(config.status().message());
  } else if (Result<TrainConfig> tc = make_train_config(*config); !tc.ok()) {
    return usage_error(tc.status().message());
  } else if (Result<model::ModelConfig> mc = resolve_model_config(*tc); !mc.ok()) {
    return usage_error(mc.status().message());
  }
#if STRATA_HAVE_CUDA
  return run(opt, *preset);
#else
  return fail("this build has no CUDA support; configure with -DSTRATA_CUDA=ON");
#endif
}

}  // namespace strata::tools
