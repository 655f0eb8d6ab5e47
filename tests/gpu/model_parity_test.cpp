// Model parity: the decoder on the CUDA backend (Decoder<CudaOps> over a PagedState on the GPU:
// bf16 activations and compute copy, fp32 master weights and gradients) against the CPU decoder
// (LlamaModel, fp32 throughout, and LlamaModelBf16, the same bf16 recipe) on the same weights and
// batches (also with a vocabulary in row blocks, which the CUDA ops compute block by block): the
// loss, every parameter gradient accumulated over two micro-batches, and the loss
// curve of a few AdamW steps. Then the paging invariance on the GPU: a device budget a third of
// the state's gives bitwise the run that keeps everything on the device; and a MoE model trains.
//
// The initial weights are rounded to bf16 before either model sees them, so the GPU's bf16
// compute copy equals the CPU's fp32 weights and only the computation differs: bf16 storage of
// every activation and activation gradient (unit roundoff 2^-9 ~ 2e-3, applied some 20-40 times
// along the forward and backward of two layers, mostly uncorrelated), with fp32 accumulation.
// Tolerances (NaN or Inf fails every check):
//   loss             relative 1e-2: the NLL sum is an average of logits built from bf16
//                    activations; ~1e-3 expected.
//   each gradient    relative L2 error ||gpu - cpu|| / ||cpu|| <= 5e-2 and cosine similarity
//                    >= 0.998. Calibration on the CPU model: perturbing these configs' weights
//                    by a relative 4e-3 (twice bf16's unit roundoff) moves every gradient tensor
//                    by 0.6-1.5% (cosine >= 0.9999); bf16 activations round at a few dozen
//                    places, so a few percent is expected and 5e-2 leaves margin. A wrong
//                    tensor, sign or missing term gives errors of order 1.
//   AdamW curve      relative 2e-2 per step on the mean loss and 1e-1 on the pre-clip gradient
//                    norm, over 5 steps on one batch at lr 3e-3 (the CPU loss falls from ~5.59
//                    to ~4.4 and every step clips at 0.5): after the first update the master
//                    weights differ by the bf16 gradient error, which AdamW's normalisation
//                    amplifies for tiny gradients. The norm is the sensitive one: from step 3
//                    the run overshoots (the norm goes 1.6, 3.2, 2.4), and where it turns the
//                    difference in weights is a difference in the norm's slope. An H200 gave
//                    norm errors of 1e-3 to 1.4e-2 but 5.2e-2 at step 5 of one variant, whose
//                    losses stayed within 1.6e-3; 1e-1 keeps that factor of two.
// Against the CPU's emulation of the same bf16 recipe (model::LlamaModelBf16: the same rounding
// points, fp32 accumulation), which leaves only the order of fp32 sums and the attention
// kernel's internal bf16 rounding of P between them, the tolerances are half of the above:
//   loss             relative 5e-3
//   each gradient    relative L2 error <= 2.5e-2, cosine >= 0.999.
// These are set from the CPU-side analysis (a 1-ulp bf16 flip needs a sum to move by 2^-9 of
// its value, which fp32 reordering almost never does) and have not yet been calibrated on a GPU.
// Every tensor's errors are printed, so a run shows the margins, not just pass or fail.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gpu_test_util.h"
#include "model_test_util.h"
#include "model/config.h"
#include "model/cuda/decoder_cuda.h"
#include "model/decoder.h"
#include "model/flat_model.h"
#include "reference_adamw.h"
#include "train/paged_state.h"
#include "train/state_kernels.h"

namespace strata::testing {
namespace {

using model::FlatModel;
using model::LlamaModel;
using model::ModelConfig;
using model::TensorRole;
using model::TensorSpec;

constexpr double kLossTol = 1e-2;
constexpr double kGradRelTol = 5e-2;
constexpr double kGradCosineMin = 0.998;
constexpr double kBf16LossTol = 5e-3;
constexpr double kBf16GradRelTol = 2.5e-2;
constexpr double kBf16GradCosineMin = 0.999;
constexpr double kCurveLossTol = 2e-2;
constexpr double kCurveNormTol = 1e-1;

struct Variant {
  const char* name;
  bool tied;
  bool qwen_extras;     // q/k/v biases (Qwen2) and per-head q/k RMSNorm (Qwen3)
  int64_t vocab = 256;  // 2000: far larger than every other tensor, so in row blocks
};

// hidden 128, 2 layers, 4 query heads over 2 KV heads of 64 (the smallest head dim the CUDA
// attention kernel has; q_dim 256 != hidden exercises the o_proj shapes), FFN 256, vocab 256.
ModelConfig tiny_config(const Variant& v) {
  ModelConfig c;
  c.vocab_size = v.vocab;
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.max_position_embeddings = 256;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = v.tied;
  c.attention_bias = v.qwen_extras;
  c.qk_norm = v.qwen_extras;
  c.fill_defaults();
  return c;
}

// The standard init, with norm gains and biases moved off 1 and 0 so that a misplaced gain or
// bias shows; then every value rounded to bf16.
std::vector<float> initial_params(const model::ParamLayout& layout, uint64_t seed) {
  std::vector<float> p(static_cast<size_t>(layout.total_size()), 0.0f);
  model::init_weights(layout, p.data(), seed);
  std::mt19937_64 rng(seed + 1);
  std::uniform_real_distribution<float> gain(0.8f, 1.2f), bias(-0.05f, 0.05f);
  for (const TensorSpec& t : layout.tensors()) {
    for (int64_t i = 0; i < t.numel; ++i) {
      float& x = p[static_cast<size_t>(t.offset + i)];
      if (t.kind == TensorRole::kNormWeight) x = gain(rng);
      if (t.kind == TensorRole::kBias) x = bias(rng);
    }
  }
  round_to_bf16(p);
  return p;
}

OptimizerConfig adam_config(float clip) {
  OptimizerConfig opt;
  opt.beta1 = 0.9f;
  opt.beta2 = 0.95f;
  opt.eps = 1e-8f;
  opt.weight_decay = 0.1f;
  opt.grad_clip = clip;
  return opt;
}

// The decoder on GPU 0 over a PagedState, as strata train builds it: `device_bytes` of chunks
// on the device (0: room for everything), the rest in host memory.
struct GpuModel {
  std::unique_ptr<Device> device;
  std::unique_ptr<StateKernels> kernels;
  std::unique_ptr<model::Model> net;
  std::unique_ptr<PagedState> state;

  GpuModel(const ModelConfig& config, const OptimizerConfig& opt, uint64_t device_bytes = 0) {
    Result<std::unique_ptr<Device>> d = open_device("cuda", 0, uint64_t{8} << 30);  // an 8 GiB arena
    CHECK_MSG(d.ok(), d.status().to_string());
    device = std::move(d).value();
    Result<std::unique_ptr<StateKernels>> k = make_cuda_state_kernels(*device);
    CHECK_MSG(k.ok(), k.status().to_string());
    kernels = std::move(k).value();
    Result<std::unique_ptr<model::Model>> m = model::make_cuda_decoder(*device, config);
    CHECK_MSG(m.ok(), m.status().to_string());
    net = std::move(m).value();
    PagedStateOptions po;
    po.device_bytes = device_bytes ? device_bytes : 1ull << 30;
    po.host_bytes = 1ull << 30;
    po.optimizer = opt;
    po.precision = Precision::kBf16;
    po.device_kernels = kernels.get();
    Result<std::unique_ptr<PagedState>> s = PagedState::create(*device, nullptr, net->layout(), po);
    CHECK_MSG(s.ok(), s.status().to_string());
    state = std::move(s).value();
    net->set_access(state.get());
  }
  ~GpuModel() {
    net->set_access(nullptr);
    state.reset();
    net.reset();
    kernels.reset();
  }
  Result<double> forward_backward(const Batch& b, int64_t B, int64_t T, float grad_scale) {
    return net->compute(b.inputs.data(), b.targets.data(), B, T, grad_scale, /*backward=*/true);
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

struct TensorError {
  double relative = 0;  // ||a - b|| / ||b||
  double cosine = 0;
};

TensorError compare(const float* a, const float* b, int64_t n) {
  double diff = 0, aa = 0, bb = 0, ab = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = a[i], y = b[i];
    diff += (x - y) * (x - y);
    aa += x * x;
    bb += y * y;
    ab += x * y;
  }
  TensorError e;
  e.relative = std::sqrt(diff) / std::sqrt(bb);
  e.cosine = ab / (std::sqrt(aa) * std::sqrt(bb));
  return e;
}

class ModelParity : public ::testing::TestWithParam<Variant> {};

// Against the fp32 reference and against the CPU's bf16 recipe; both errors are printed.
TEST_P(ModelParity, LossAndEveryGradientMatchTheCpuModels) {
  const ModelConfig config = tiny_config(GetParam());
  FlatModel<LlamaModel> fp32(config);
  FlatModel<model::LlamaModelBf16> bf16(config);
  GpuModel gpu(config, adam_config(1.0f));
  const std::vector<float> init = initial_params(fp32.layout(), 17);
  std::copy(init.begin(), init.end(), fp32.params());
  std::copy(init.begin(), init.end(), bf16.params());
  bf16.sync_compute_copy();
  ASSERT_TRUE(gpu.state->load_params(init.data()).ok());
  ASSERT_TRUE(gpu.params() == init) << "store_params(load_params(x)) != x";

  // Two micro-batches of different shapes accumulate into one step's gradient.
  const int64_t B = 2, T = 96, B2 = 1, T2 = 160;
  const Batch first = random_batch(B * T, config.vocab_size, 3);
  const Batch second = random_batch(B2 * T2, config.vocab_size, 4);
  const int64_t valid = model::count_valid_targets(first.targets.data(), B * T) +
                        model::count_valid_targets(second.targets.data(), B2 * T2);
  const float grad_scale = 1.0f / static_cast<float>(valid);

  fp32.zero_grads();
  bf16.zero_grads();
  ASSERT_TRUE(gpu.state->zero_grads().ok());
  double want32 = 0, want16 = 0, got = 0;
  for (const auto& [b, BB, TT] : {std::tuple{&first, B, T}, std::tuple{&second, B2, T2}}) {
    want32 += fp32.forward_backward(b->inputs.data(), b->targets.data(), BB, TT, grad_scale);
    want16 += bf16.forward_backward(b->inputs.data(), b->targets.data(), BB, TT, grad_scale);
    Result<double> loss = gpu.forward_backward(*b, BB, TT, grad_scale);
    ASSERT_TRUE(loss.ok()) << loss.status().to_string();
    got += *loss;
  }
  const double err32 = std::abs(got - want32) / std::abs(want32), err16 = std::abs(got - want16) / std::abs(want16);
  std::printf("loss: gpu %.6f cpu-fp32 %.6f (rel %.2e) cpu-bf16 %.6f (rel %.2e)\n", got, want32, err32, want16, err16);
  EXPECT_TRUE(err32 <= kLossTol) << "loss " << got << " vs the fp32 CPU model's " << want32;
  EXPECT_TRUE(err16 <= kBf16LossTol) << "loss " << got << " vs the CPU bf16 recipe's " << want16;

  const std::vector<float> grads = gpu.grads();
  for (const TensorSpec& t : fp32.layout().tensors()) {
    const TensorError e32 = compare(grads.data() + t.offset, fp32.grads() + t.offset, t.numel);
    const TensorError e16 = compare(grads.data() + t.offset, bf16.grads() + t.offset, t.numel);
    std::printf("  %-48s vs fp32 rel %.2e cos %.6f | vs bf16 rel %.2e cos %.6f\n", t.name.c_str(), e32.relative,
                e32.cosine, e16.relative, e16.cosine);
    EXPECT_TRUE(e32.relative <= kGradRelTol) << t.name << ": relative L2 error vs fp32 " << e32.relative;
    EXPECT_TRUE(e32.cosine >= kGradCosineMin) << t.name << ": cosine vs fp32 " << e32.cosine;
    EXPECT_TRUE(e16.relative <= kBf16GradRelTol) << t.name << ": relative L2 error vs bf16 " << e16.relative;
    EXPECT_TRUE(e16.cosine >= kBf16GradCosineMin) << t.name << ": cosine vs bf16 " << e16.cosine;
  }
}

TEST_P(ModelParity, AdamWLossCurveTracksTheCpuModel) {
  const ModelConfig config = tiny_config(GetParam());
  const OptimizerConfig opt = adam_config(0.5f);  // low enough that some steps clip
  FlatModel<LlamaModel> cpu(config);
  GpuModel gpu(config, opt);
  const std::vector<float> init = initial_params(cpu.layout(), 23);
  std::copy(init.begin(), init.end(), cpu.params());
  ASSERT_TRUE(gpu.state->load_params(init.data()).ok());
  AdamW cpu_adam(cpu.layout(), opt);
  const float lr = 3e-3f;

  // The same batch every step, so the loss falls steadily and the curves are comparable.
  const int64_t B = 2, T = 64;
  const Batch batch = random_batch(B * T, config.vocab_size, 5);
  const int64_t valid = model::count_valid_targets(batch.targets.data(), B * T);
  const float grad_scale = 1.0f / static_cast<float>(valid);
  std::vector<double> cpu_curve, gpu_curve;
  for (int step = 0; step < 5; ++step) {
    cpu.zero_grads();
    ASSERT_TRUE(gpu.state->zero_grads().ok());
    const double cpu_loss = cpu.forward_backward(batch.inputs.data(), batch.targets.data(), B, T, grad_scale) / valid;
    Result<double> gpu_sum = gpu.forward_backward(batch, B, T, grad_scale);
    ASSERT_TRUE(gpu_sum.ok()) << gpu_sum.status().to_string();
    const double gpu_loss = *gpu_sum / valid;
    const double cpu_norm = cpu_adam.clip_gradients(cpu.grads(), opt.grad_clip);
    cpu_adam.step(cpu.params(), cpu.grads(), lr);
    Result<double> gpu_norm = gpu.state->clip_and_step(lr);
    ASSERT_TRUE(gpu_norm.ok()) << gpu_norm.status().to_string();
    cpu_curve.push_back(cpu_loss);
    gpu_curve.push_back(gpu_loss);
    const double loss_err = std::abs(gpu_loss - cpu_loss) / cpu_loss;
    const double norm_err = std::abs(*gpu_norm - cpu_norm) / cpu_norm;
    std::printf("step %d: loss gpu %.6f cpu %.6f (rel %.2e)  grad norm gpu %.6f cpu %.6f (rel %.2e)\n", step + 1,
                gpu_loss, cpu_loss, loss_err, *gpu_norm, cpu_norm, norm_err);
    EXPECT_TRUE(loss_err <= kCurveLossTol) << "step " << step + 1;
    EXPECT_TRUE(norm_err <= kCurveNormTol) << "step " << step + 1;
  }
  EXPECT_EQ(gpu.state->step_count(), cpu_adam.step_count());
  // The curves must actually move, or the comparison above proves little.
  EXPECT_TRUE(cpu_curve.back() < cpu_curve.front()) << "CPU loss did not fall";
  EXPECT_TRUE(gpu_curve.back() < gpu_curve.front()) << "GPU loss did not fall";
}

// Paging invariance on the GPU: chunks through a device budget a third of the state's give
// bitwise the losses, norms and parameters of the run that keeps everything on the device.
TEST_P(ModelParity, PagingThroughHostMemoryIsBitwiseTheResidentRun) {
  const ModelConfig config = tiny_config(GetParam());
  const OptimizerConfig opt = adam_config(1.0f);
  const model::ParamLayout layout(config);
  const std::vector<float> init = initial_params(layout, 29);
  const uint64_t state_bytes = static_cast<uint64_t>(layout.total_size()) * 18;  // bf16 recipe
  const int64_t B = 2, T = 64;
  std::vector<std::vector<double>> results;
  std::vector<std::vector<float>> params;
  for (uint64_t device_bytes : {uint64_t{0}, state_bytes / 3}) {
    GpuModel gpu(config, opt, device_bytes);
    ASSERT_TRUE(gpu.state->load_params(init.data()).ok());
    std::vector<double> out;
    for (int step = 0; step < 3; ++step) {
      ASSERT_TRUE(gpu.state->zero_grads().ok());
      for (int m = 0; m < 2; ++m) {
        const Batch b = random_batch(B * T, config.vocab_size, 100 + 2 * step + m);
        Result<double> loss = gpu.forward_backward(b, B, T, 1.0f / (2 * B * T));
        ASSERT_TRUE(loss.ok()) << loss.status().to_string();
        out.push_back(*loss);
      }
      Result<double> norm = gpu.state->clip_and_step(1e-3f);
      ASSERT_TRUE(norm.ok()) << norm.status().to_string();
      out.push_back(*norm);
    }
    if (device_bytes > 0) {
      EXPECT_GT(gpu.state->stats().moved_bytes(), 0u) << "the tight run moved nothing";
    }
    results.push_back(out);
    params.push_back(gpu.params());
  }
  ASSERT_EQ(results[0].size(), results[1].size());
  for (size_t i = 0; i < results[0].size(); ++i)
    EXPECT_EQ(std::memcmp(&results[0][i], &results[1][i], sizeof(double)), 0)
        << "loss/norm " << i << ": resident " << results[0][i] << " paged " << results[1][i];
  EXPECT_TRUE(params[0] == params[1]) << "parameters differ";
}

INSTANTIATE_TEST_SUITE_P(Variants, ModelParity,
                         ::testing::Values(Variant{"Untied", false, false}, Variant{"Tied", true, false},
                                           Variant{"BiasAndQkNorm", false, true},
                                           Variant{"VocabInRowBlocks", false, false, 2000}),
                         [](const ::testing::TestParamInfo<Variant>& info) { return std::string(info.param.name); });

// A MoE model (routed experts, a shared expert, the aux loss) on the GPU tracks the CPU's bf16
// recipe and trains.
TEST(ModelParityMoe, TracksTheBf16RecipeAndTrains) {
  ModelConfig config = tiny_config(Variant{"", false, false});
  config.architecture = "Qwen2MoeForCausalLM";
  config.num_experts = 4;
  config.num_experts_per_tok = 2;
  config.moe_intermediate_size = 64;
  config.shared_expert_intermediate_size = 128;
  config.router_scoring = kernels::RouterScoring::kSoftmaxThenTopK;
  config.output_router_logits = true;
  config.router_aux_loss_coef = 0.01;
  config.fill_defaults();
  ASSERT_TRUE(config.validate("test").ok());
  FlatModel<model::LlamaModelBf16> cpu(config);
  GpuModel gpu(config, adam_config(1.0f));
  const std::vector<float> init = initial_params(cpu.layout(), 31);
  std::copy(init.begin(), init.end(), cpu.params());
  cpu.sync_compute_copy();
  ASSERT_TRUE(gpu.state->load_params(init.data()).ok());
  const int64_t B = 2, T = 64;
  const Batch batch = random_batch(B * T, config.vocab_size, 9);
  cpu.zero_grads();
  ASSERT_TRUE(gpu.state->zero_grads().ok());
  const double want = cpu.forward_backward(batch.inputs.data(), batch.targets.data(), B, T, 1.0f / (B * T));
  Result<double> got = gpu.forward_backward(batch, B, T, 1.0f / (B * T));
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  const double err = std::abs(*got - want) / std::abs(want);
  std::printf("moe loss: gpu %.6f cpu-bf16 %.6f (rel %.2e)\n", *got, want, err);
  EXPECT_TRUE(err <= kLossTol);
  const std::vector<float> grads = gpu.grads();
  const TensorError e = compare(grads.data(), cpu.grads(), cpu.layout().total_size());
  std::printf("moe gradients: rel %.2e cos %.6f\n", e.relative, e.cosine);
  EXPECT_TRUE(e.relative <= kGradRelTol);
  double first = *got, last = first;
  for (int step = 0; step < 10; ++step) {
    Result<double> norm = gpu.state->clip_and_step(3e-3f);
    ASSERT_TRUE(norm.ok()) << norm.status().to_string();
    ASSERT_TRUE(gpu.state->zero_grads().ok());
    Result<double> loss = gpu.forward_backward(batch, B, T, 1.0f / (B * T));
    ASSERT_TRUE(loss.ok()) << loss.status().to_string();
    last = *loss;
  }
  EXPECT_TRUE(std::isfinite(last));
  EXPECT_LT(last, first) << "the MoE loss did not fall on the GPU";
}

// Document packing (data.packing: document): a packed batch with positions restarting at each
// document runs on the WMMA kernel with document masks (CudaOps never gives cuDNN such a batch)
// and matches the CPU bf16 recipe given the same positions, within the bf16-recipe tolerances.
TEST(ModelParityPacking, DocumentPackedBatchMatchesTheCpuBf16Recipe) {
  const ModelConfig config = tiny_config(Variant{"untied", false, true});
  FlatModel<model::LlamaModelBf16> bf16(config);
  GpuModel gpu(config, adam_config(1.0f));
  const std::vector<float> init = initial_params(bf16.layout(), 23);
  std::copy(init.begin(), init.end(), bf16.params());
  bf16.sync_compute_copy();
  ASSERT_TRUE(gpu.state->load_params(init.data()).ok());

  const int64_t B = 2, T = 160;
  Batch b = random_batch(B * T, config.vocab_size, 5);
  const int32_t eos = 7;
  std::vector<int32_t> positions(static_cast<size_t>(B * T));
  std::mt19937_64 rng(9);
  for (int64_t r = 0; r < B; ++r) {
    int64_t left = 1 + static_cast<int64_t>(rng() % 70);  // tokens left in the current document
    for (int64_t t = 0; t < T; ++t) {
      const size_t i = static_cast<size_t>(r * T + t);
      if (b.inputs[i] == eos) b.inputs[i] = eos + 1;
      if (--left == 0) {
        b.inputs[i] = eos;
        left = 1 + static_cast<int64_t>(rng() % 70);
      }
      positions[i] = t == 0 || b.inputs[i - 1] == eos ? 0 : positions[i - 1] + 1;
      if (b.inputs[i] == eos) b.targets[i] = -1;
    }
  }
  const float grad_scale = 1.0f / static_cast<float>(model::count_valid_targets(b.targets.data(), B * T));
  bf16.zero_grads();
  ASSERT_TRUE(gpu.state->zero_grads().ok());
  Result<double> want = bf16.compute(b.inputs.data(), b.targets.data(), B, T, grad_scale, true, positions.data());
  Result<double> got = gpu.net->compute(b.inputs.data(), b.targets.data(), B, T, grad_scale, true, positions.data());
  ASSERT_TRUE(want.ok() && got.ok());
  const double err = std::abs(*got - *want) / std::abs(*want);
  std::printf("document-packed loss: gpu %.6f cpu-bf16 %.6f (rel %.2e)\n", *got, *want, err);
  EXPECT_TRUE(err <= kBf16LossTol) << "loss " << *got << " vs " << *want;
  const std::vector<float> grads = gpu.grads();
  for (const TensorSpec& t : bf16.layout().tensors()) {
    const TensorError e = compare(grads.data() + t.offset, bf16.grads() + t.offset, t.numel);
    std::printf("  %-48s rel %.2e cos %.6f\n", t.name.c_str(), e.relative, e.cosine);
    EXPECT_TRUE(e.relative <= kBf16GradRelTol) << t.name << ": relative L2 error " << e.relative;
    EXPECT_TRUE(e.cosine >= kBf16GradCosineMin) << t.name << ": cosine " << e.cosine;
  }
  // The masks matter: without them the same batch loses differently.
  Result<double> unmasked = bf16.compute(b.inputs.data(), b.targets.data(), B, T, 0.0f, false);
  ASSERT_TRUE(unmasked.ok());
  EXPECT_NE(*unmasked, *want);
}

TEST(ModelParityErrors, RefusesHeadDimsTheAttentionKernelLacks) {
  ModelConfig narrow = tiny_config(Variant{"", false, false});
  narrow.head_dim = 32;
  const Status st = model::cuda_supports(narrow);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kUnimplemented) << st.to_string();
}

}  // namespace
}  // namespace strata::testing
