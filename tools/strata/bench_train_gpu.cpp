// strata bench train-gpu: how fast `strata train` trains a Llama on one GPU — the decoder on the
// CUDA backend over the paged state, under a device budget of the user's choosing — in tokens/s
// and model TFLOP/s, beside a cuBLAS bf16 GEMM ceiling measured in the same run. The PyTorch
// baseline of the same shape is tools/bench_gpu_train_torch.py; tools/gpu_check.sh runs both.
// In a build without the CUDA backend the command explains that and exits 1.
#include "tools/strata/bench_train_gpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/config.h"

#if STRATA_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "core/check.h"
#include "core/cuda/cuda_check.h"
#include "core/units.h"
#include "core/cuda/cuda_device.h"
#include "model/params.h"
#include "train/paged_engine.h"
#include "train/train_config.h"
#endif

namespace strata::tools {
namespace {

using model::ModelConfig;

constexpr const char* kUsage = R"(Usage: strata bench train-gpu [--preset 0.44b|3.6b|8b|tiny] [--steps 20] [--warmup 3]
                              [--micro-batch 8] [--seq 2048] [--grad-accum 1] [--lr 3e-4]
                              [--memory-device 0] [--memory-host 0] [--nvme DIR --nvme-size SIZE]
                              [--precision bf16|fp8]

Trains a Llama from random weights (normal(0, 0.02), seed 1) on random tokens on GPU 0 exactly
as `strata train run.device=cuda` does: the decoder's CUDA backend (bf16 compute copy and
activations; fp32 master weights, gradients and AdamW moments; beta 0.9/0.95, weight decay 0.1,
gradient clipping at norm 1.0) over the paged state, which the planner places across
--memory-device (0 = the whole free device), --memory-host (0 = 80% of RAM) and an optional
nvme directory. A step is GRAD_ACCUM micro-batches of MICRO_BATCH sequences of SEQ tokens, then
one AdamW update. WARMUP untimed steps, then STEPS timed ones. Sizes take units (24GiB).
--precision fp8 runs the fp8 recipe instead (E4M3 compute copies of the linear weights, their
GEMMs on cuBLASLt's block-scaled FP8 kernels; docs/precision.md).

Presets (untied embeddings):
  0.44b  hidden 1024, 24 layers, 16 heads, 8 KV heads, FFN 4096, vocab 32000 (0.44B; the shape of
         the PyTorch baseline tools/bench_gpu_train_torch.py)
  3.6b   the Llama-3.2-3B shape: hidden 3072, 28 layers, 24 heads, 8 KV heads, FFN 8192,
         vocab 128256
  8b     the Llama-3-8B shape: hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336,
         vocab 128256
  tiny   hidden 256, 2 layers, 4 heads, 2 KV heads, FFN 768, vocab 1024 (a quick smoke run)

Prints the plan, then tokens/s and model TFLOP/s with FLOPs per token = 6*N + 12*L*H*T, where N
counts EVERY parameter (embeddings and LM head included), L is the number of layers, H the
hidden size and T the sequence length (the formula of the PyTorch baseline), and the fraction of
a cuBLAS bf16 GEMM (8192^3) ceiling timed in the same run. The last line, "RESULT {json}", is
for tools/gpu_check.sh. Needs a build configured with -DSTRATA_CUDA=ON.
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

Result<ModelConfig> preset_config(const std::string& name, int64_t seq) {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.tie_word_embeddings = false;
  c.rms_norm_eps = 1e-6;
  c.rope.theta = 10000.0;
  if (name == "0.44b") {
    c.vocab_size = 32000;
    c.hidden_size = 1024;
    c.intermediate_size = 4096;
    c.num_hidden_layers = 24;
    c.num_attention_heads = 16;
    c.num_key_value_heads = 8;
  } else if (name == "3.6b" || name == "8b") {
    const bool big = name == "8b";
    c.vocab_size = 128256;
    c.hidden_size = big ? 4096 : 3072;
    c.intermediate_size = big ? 14336 : 8192;
    c.num_hidden_layers = big ? 32 : 28;
    c.num_attention_heads = big ? 32 : 24;
    c.num_key_value_heads = 8;
    c.rope.theta = 500000.0;
  } else if (name == "tiny") {
    c.vocab_size = 1024;
    c.hidden_size = 256;
    c.intermediate_size = 768;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
  } else {
    return Status::InvalidArgument("unknown preset '" + name + "'; presets are 0.44b, 3.6b, 8b and tiny");
  }
  c.max_position_embeddings = std::max<int64_t>(2048, seq);
  c.fill_defaults();
  RETURN_IF_ERROR(c.validate("bench train-gpu --preset " + name));
  return c;
}

#if STRATA_HAVE_CUDA

// Next value of a 64-bit LCG (Knuth's MMIX constants); the high bits are the random ones.
uint64_t lcg_next(uint64_t* state) {
  *state = *state * 6364136223846793005ull + 1442695040888963407ull;
  return *state >> 33;
}

// One micro-batch of random tokens: each row is T+1 tokens in [0, vocab); inputs get the first
// T, targets the last T (next-token prediction, every target counted).
void random_batch(uint64_t* state, int64_t B, int64_t T, int64_t vocab, std::vector<int32_t>* inputs,
                  std::vector<int32_t>* targets) {
  std::vector<int32_t> row(static_cast<size_t>(T + 1));
  for (int64_t b = 0; b < B; ++b) {
    for (auto& t : row) t = static_cast<int32_t>(lcg_next(state) % static_cast<uint64_t>(vocab));
    std::copy(row.begin(), row.end() - 1, inputs->begin() + b * T);
    std::copy(row.begin() + 1, row.end(), targets->begin() + b * T);
  }
}

// TFLOP/s of a plain cuBLAS bf16 GEMM 8192^3 (fp32 accumulation) on `stream`: one warm-up call,
// then the mean of 20, timed with events. Operands are random bf16 in +-[2^-7, 2^-2) so that the
// power draw is that of real data.
double gemm_ceiling_tflops(cudaStream_t stream) {
  constexpr int n = 8192;
  constexpr int kIters = 20;
  const size_t count = size_t{n} * n;
  std::vector<uint16_t> bits(count);
  uint64_t state = 7;
  for (auto& b : bits) {
    const uint64_t r = lcg_next(&state);
    b = static_cast<uint16_t>(0x3C00 + (r & 0x3FF)) | static_cast<uint16_t>(((r >> 10) & 1) << 15);
  }
  void* a = nullptr;
  void* b = nullptr;
  void* c = nullptr;
  CUDA_CHECK(cudaMalloc(&a, count * 2));
  CUDA_CHECK(cudaMalloc(&b, count * 2));
  CUDA_CHECK(cudaMalloc(&c, count * 2));
  CUDA_CHECK(cudaMemcpy(a, bits.data(), count * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(b, bits.data(), count * 2, cudaMemcpyHostToDevice));
  cublasHandle_t handle = nullptr;
  CHECK(cublasCreate(&handle) == CUBLAS_STATUS_SUCCESS);
  CHECK(cublasSetStream(handle, stream) == CUBLAS_STATUS_SUCCESS);
  const float alpha = 1.0f, beta = 0.0f;
  const auto gemm = [&] {
    CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n, &beta,
                       c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
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
  CHECK(cublasDestroy(handle) == CUBLAS_STATUS_SUCCESS);
  for (void* p : {a, b, c}) CUDA_CHECK(cudaFree(p));
  return 2.0 * n * n * static_cast<double>(n) / (ms / kIters * 1e-3) / 1e12;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int run(const Options& opt) {
  if (cuda_device_count() == 0) return fail("no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)");
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  Result<ModelConfig> config = preset_config(opt.preset, opt.seq);
  if (!config.ok()) return fail(config.status().message());
  const ModelConfig& c = *config;
  const int64_t B = opt.micro_batch, T = opt.seq, A = opt.grad_accum;
  const int64_t n_params = c.num_parameters();
  const int64_t tokens_per_step = B * T * A;
  // Model FLOPs per token: 6N for the matmuls of forward and backward, 12*L*H*T for attention.
  const double flops_per_token = 6.0 * static_cast<double>(n_params) + 12.0 * static_cast<double>(c.num_hidden_layers) *
                                                                           static_cast<double>(c.hidden_size) *
                                                                           static_cast<double>(T);
  std::printf(
      "train-gpu benchmark on %s: preset %s in %s, %.3fB parameters, %lld x %lld tokens x %lld "
      "micro-batches = %lld tokens/step, %lld warm-up + %lld timed steps\n",
      prop.name, opt.preset.c_str(), opt.precision.c_str(), static_cast<double>(n_params) / 1e9, static_cast<long long>(B),
      static_cast<long long>(T), static_cast<long long>(A), static_cast<long long>(tokens_per_step),
      static_cast<long long>(opt.warmup), static_cast<long long>(opt.steps));
  std::fflush(stdout);

  // The settings `strata train` would use, from its schema's defaults and these overrides.
  std::vector<std::string> overrides = {
      "train.micro_batch=" + std::to_string(B), "train.seq_len=" + std::to_string(T),
      "train.grad_accum=" + std::to_string(A),  "train.steps=" + std::to_string(opt.warmup + opt.steps),
      "memory.device=" + opt.memory_device,     "memory.host=" + opt.memory_host,
      "memory.nvme.path=" + opt.nvme,           "memory.nvme.size=" + opt.nvme_size,
      "optim.warmup_steps=0",                   "run.device=cuda",
      "train.precision=" + opt.precision};
  Result<Config> parsed = Config::parse(train_schema(), "model: {preset: tiny}\n", "<bench train-gpu>", overrides);
  if (!parsed.ok()) return fail(parsed.status().message());
  Result<TrainConfig> tc = make_train_config(*parsed);
  if (!tc.ok()) return fail(tc.status().message());
  OptimizerConfig oc;
  oc.lr = opt.lr;
  oc.beta1 = 0.9f;
  oc.beta2 = 0.95f;
  oc.eps = 1e-8f;
  oc.weight_decay = 0.1f;
  oc.grad_clip = 1.0f;
  Result<std::unique_ptr<PagedEngine>> created = PagedEngine::create(c, *tc, oc, /*cuda=*/true);
  if (!created.ok()) return fail(created.status().message());
  PagedEngine& engine = **created;
  std::printf("plan: %s\n", engine.memory_summary().c_str());
  {
    const auto start = std::chrono::steady_clock::now();
    Status st = engine.state().fill_kind(StateKind::kParam, [](const model::TensorSpec& spec, float* dst) {
      model::init_tensor(spec, dst, /*seed=*/1);
      return Status::OK();
    });
    if (!st.ok()) return fail(st.message());
    std::printf("random init of %.3fB parameters: %.1f s\n", static_cast<double>(n_params) / 1e9, seconds_since(start));
  }

  const float grad_scale = 1.0f / static_cast<float>(tokens_per_step);  // mean loss of the step
  std::vector<int32_t> inputs(static_cast<size_t>(B * T)), targets(static_cast<size_t>(B * T));
  uint64_t token_state = 12345;
  std::vector<double> step_seconds;
  double first_loss = 0, last_loss = 0;
  for (int64_t step = 0; step < opt.warmup + opt.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    if (Status st = engine.zero_grads(); !st.ok()) return fail(st.message());
    double loss_sum = 0;
    for (int64_t micro = 0; micro < A; ++micro) {
      random_batch(&token_state, B, T, c.vocab_size, &inputs, &targets);
      Result<double> loss = engine.micro_batch(inputs.data(), targets.data(), B, T, grad_scale, micro == A - 1, opt.lr);
      if (!loss.ok()) return fail(loss.status().message());
      loss_sum += *loss;
    }
    Result<double> norm = engine.step(opt.lr);
    if (!norm.ok()) return fail(norm.status().message());
    const double seconds = seconds_since(start);
    const double loss = loss_sum / static_cast<double>(tokens_per_step);
    const bool timed = step >= opt.warmup;
    if (timed) step_seconds.push_back(seconds);
    if (step == 0) {
      first_loss = loss;
      const EngineStats stats = engine.stats();
      std::printf("state in use: device %s, host %s, nvme %s\n", format_bytes(stats.tier_bytes[0]).c_str(),
                  format_bytes(stats.tier_bytes[1]).c_str(), format_bytes(stats.tier_bytes[2]).c_str());
    }
    last_loss = loss;
    std::printf("step %3lld  loss %8.4f  grad norm %8.4f  %9.2f ms  %10.0f tokens/s%s\n", static_cast<long long>(step),
                loss, *norm, seconds * 1e3, static_cast<double>(tokens_per_step) / seconds, timed ? "" : "  (warm-up)");
    std::fflush(stdout);
    if (!std::isfinite(loss)) {
      return fail("the loss is not finite at step " + std::to_string(step) +
                  "; the throughput of a diverged run is not a result");
    }
  }

  double total = 0;
  for (double s : step_seconds) total += s;
  std::vector<double> sorted = step_seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median_ms = sorted[sorted.size() / 2] * 1e3;
  const double tokens_per_s = static_cast<double>(tokens_per_step) * static_cast<double>(opt.steps) / total;
  const double tflops = tokens_per_s * flops_per_token / 1e12;
  // The ceiling's operands (384 MiB) and cuBLAS handle need room the run may have taken: measure
  // it with the engine freed, on the GPU still warm from training.
  created.value().reset();
  const double ceiling = gemm_ceiling_tflops(/*stream=*/nullptr);

  std::printf("\nstep time       mean %.2f ms, median %.2f ms, min %.2f ms, max %.2f ms\n",
              total / static_cast<double>(opt.steps) * 1e3, median_ms, sorted.front() * 1e3, sorted.back() * 1e3);
  std::printf("tokens/s        %.0f\n", tokens_per_s);
  std::printf("model TFLOP/s   %.1f  (6N + 12*L*H*T = %.3f GFLOP/token, N = %lld, all parameters)\n", tflops,
              flops_per_token / 1e9, static_cast<long long>(n_params));
  std::printf("GEMM ceiling    %.1f TFLOP/s (cuBLAS bf16 8192^3, same run): model TFLOP/s = %.1f%%\n", ceiling,
              100.0 * tflops / ceiling);
  std::printf("loss            %.4f -> %.4f (random tokens: ln(vocab) = %.4f)\n", first_loss, last_loss,
              std::log(static_cast<double>(c.vocab_size)));
  std::printf(
      "RESULT {\"impl\": \"strata\", \"preset\": \"%s\", \"precision\": \"%s\", \"params\": %lld, \"micro_batch\": %lld, "
      "\"seq\": %lld, \"grad_accum\": %lld, \"tokens_per_step\": %lld, \"steps\": %lld, "
      "\"memory_device\": \"%s\", \"step_ms_median\": %.3f, \"tokens_per_s\": %.1f, \"tflops\": %.2f, "
      "\"gemm_ceiling_tflops\": %.2f, \"final_loss\": %.4f}\n",
      opt.preset.c_str(), opt.precision.c_str(), static_cast<long long>(n_params), static_cast<long long>(B), static_cast<long long>(T),
      static_cast<long long>(A), static_cast<long long>(tokens_per_step), static_cast<long long>(opt.steps),
      opt.memory_device.c_str(), median_ms, tokens_per_s, tflops, ceiling, last_loss);
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
  if (Result<ModelConfig> c = preset_config(opt.preset, opt.seq); !c.ok()) {
    return usage_error(c.status().message());
  }
#if STRATA_HAVE_CUDA
  return run(opt);
#else
  return fail("this build has no CUDA support; configure with -DSTRATA_CUDA=ON");
#endif
}

}  // namespace strata::tools
