// LoRA over an nf4 base on CUDA (Decoder<CudaNf4Ops>) against the same recipe on the CPU
// (Decoder<CpuNf4Ops>), each over a PagedState of the nf4 recipe from the same fp32 weights: the
// loss and every adapter's gradient of one micro-batch, dense and MoE (adapters on the attention,
// the shared expert and every routed expert), then three AdamW steps, and paging the GPU's state
// through host memory bitwise equal to the resident run.
//
// The compute copies are the same NF4 bytes (written on the host at load) and the GPU's
// dequantisation is the CPU's values rounded to bf16, bit for bit (nf4_parity_test.cpp); so only
// the GEMMs' and attention's order of accumulation differ, as between the two bf16 recipes
// (model_parity_test.cpp's bounds, NaN or Inf failing every check):
//   loss           relative 5e-3
//   each gradient  relative L2 error <= 2.5e-2 and cosine similarity >= 0.999
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../test_util.h"
#include "core/cpu_device.h"
#include "gpu_test_util.h"
#include "model_test_util.h"
#include "model/config.h"
#include "model/cuda/decoder_cuda.h"
#include "model/decoder.h"
#include "train/paged_state.h"
#include "train/state_kernels.h"

namespace strata::testing {
namespace {

constexpr double kLossTol = 5e-3;
constexpr double kGradRelTol = 2.5e-2;
constexpr double kGradCosineMin = 0.999;

OptimizerConfig adam_config() {
  OptimizerConfig opt;
  opt.weight_decay = 0.1f;
  opt.grad_clip = 1.0f;
  return opt;
}

model::ModelConfig with_lora(model::ModelConfig c) {
  c.lora.rank = 8;
  c.lora.alpha = 16;
  c.lora.targets |= model::kLoraExperts;
  CHECK_MSG(c.validate("nf4_model_parity_test").ok(), "config");
  return c;
}

model::ModelConfig dense_config() {
  model::ModelConfig c;
  c.vocab_size = 256;
  c.hidden_size = 256;
  c.intermediate_size = 448;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.max_position_embeddings = 256;
  c.rms_norm_eps = 1e-5;
  c.fill_defaults();
  return with_lora(c);
}

model::ModelConfig moe_config() {
  nlohmann::json j = {{"architectures", {"Qwen2MoeForCausalLM"}}, {"vocab_size", 256}, {"hidden_size", 256},
                      {"intermediate_size", 448}, {"num_hidden_layers", 3}, {"num_attention_heads", 4},
                      {"num_key_value_heads", 2}, {"head_dim", 64}, {"max_position_embeddings", 256},
                      {"num_experts", 4}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 128},
                      {"shared_expert_intermediate_size", 64}, {"mlp_only_layers", {1}},
                      {"router_aux_loss_coef", 0.01}, {"output_router_logits", true}, {"tie_word_embeddings", false}};
  Result<model::ModelConfig> c = model::ModelConfig::from_json(j, "nf4_model_parity_test");
  CHECK_MSG(c.ok(), c.status().to_string());
  return with_lora(*c);
}

// The fp32 weights both start from, with every lora_B drawn nonzero (it starts at zero, which
// would leave every A's gradient zero).
std::vector<float> initial_params(const model::ModelConfig& config, uint64_t seed) {
  const model::ParamLayout layout(config);
  std::vector<float> params(static_cast<size_t>(layout.total_size()));
  model::init_weights(layout, params.data(), seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (const model::TensorSpec& t : layout.tensors())
    if (t.name.ends_with("lora_B.weight"))
      for (int64_t i = 0; i < t.numel; ++i) params[static_cast<size_t>(t.offset + i)] = normal(rng);
  return params;
}

class Nf4ModelParity : public ::testing::TestWithParam<bool> {};

TEST_P(Nf4ModelParity, LossAndEveryAdapterGradientMatchTheCpuRecipe) {
  const model::ModelConfig config = GetParam() ? moe_config() : dense_config();
  PagedModel gpu(config, /*cuda=*/true, DType::kNF4, adam_config());
  PagedModel cpu(config, /*cuda=*/false, DType::kNF4, adam_config());
  const std::vector<float> init = initial_params(config, 41);
  ASSERT_TRUE(gpu.state->load_params(init.data()).ok());
  ASSERT_TRUE(cpu.state->load_params(init.data()).ok());
  const int64_t B = 2, T = 88;
  const Batch batch = random_batch(B * T, config.vocab_size, 9);
  const float grad_scale = 1.0f / static_cast<float>(model::count_valid_targets(batch.targets.data(), B * T));
  ASSERT_TRUE(gpu.state->zero_grads().ok());
  ASSERT_TRUE(cpu.state->zero_grads().ok());
  Result<double> got = gpu.net->compute(batch.inputs.data(), batch.targets.data(), B, T, grad_scale, true);
  Result<double> want = cpu.net->compute(batch.inputs.data(), batch.targets.data(), B, T, grad_scale, true);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  ASSERT_TRUE(want.ok()) << want.status().to_string();
  const double loss_err = std::abs(*got - *want) / std::abs(*want);
  std::printf("loss: gpu nf4 %.6f cpu nf4 %.6f (rel %.2e)\n", *got, *want, loss_err);
  EXPECT_TRUE(loss_err <= kLossTol) << "loss " << *got << " vs the CPU recipe's " << *want;
  const std::vector<float> g = gpu.grads(), c = cpu.grads();
  int adapters = 0;
  for (const model::TensorSpec& t : gpu.net->layout().tensors()) {
    if (t.adapts < 0) continue;
    ++adapters;
    bool any = false;
    for (int64_t i = 0; i < t.numel; ++i) any = any || c[static_cast<size_t>(t.offset + i)] != 0.0f;
    if (!any) continue;  // an expert no token reached
    const double rel = relative_error(g.data() + t.offset, c.data() + t.offset, t.numel);
    const double cos = cosine(g.data() + t.offset, c.data() + t.offset, t.numel);
    std::printf("  %-56s rel %.2e cos %.6f\n", t.name.c_str(), rel, cos);
    EXPECT_TRUE(rel <= kGradRelTol) << t.name << ": relative L2 error " << rel;
    EXPECT_TRUE(cos >= kGradCosineMin) << t.name << ": cosine " << cos;
  }
  EXPECT_GT(adapters, 0);
}

TEST_P(Nf4ModelParity, StepsTrackTheCpuRecipeAndPagingIsBitwise) {
  const model::ModelConfig config = GetParam() ? moe_config() : dense_config();
  // A device of a few chunks, as the CPU's nf4 paging test has (fp8_recipe_test.cpp): the base
  // streams through it.
  const uint64_t chunk = PagedState::auto_chunk_bytes(model::ParamLayout(config), StateLayout::of(Precision::kNf4));
  expect_steps_track_cpu_and_page_bitwise(config, DType::kNF4, adam_config(), initial_params(config, 43),
                                          (GetParam() ? 24 : 8) * chunk, 60, kLossTol);
}

INSTANTIATE_TEST_SUITE_P(Models, Nf4ModelParity, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "moe" : "dense"; });

}  // namespace
}  // namespace strata::testing
