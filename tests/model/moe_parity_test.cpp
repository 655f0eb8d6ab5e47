// Architecture parity with PyTorch: tests/model/reference_moe.py builds tiny random
// MixtralForCausalLM, Qwen2MoeForCausalLM, MistralForCausalLM and Qwen2ForCausalLM models with
// transformers 4.40 (saved by save_pretrained), and a Qwen3-MoE in plain PyTorch written after
// the published modeling code's conventions (transformers 4.40 has no Qwen3-MoE). This test
// loads each config.json and model.safetensors by Hugging Face name and compares the loss
// (mean NLL + router_aux_loss_coef * aux for MoE models), the auxiliary loss and every
// parameter gradient.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../test_util.h"
#include "model/reference_util.h"
#include "model/decoder.h"
#include "model/flat_model.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

constexpr double kMoeLossTolerance = 1e-5;
constexpr double kMoeGradTolerance = 1e-4;

std::string generate_reference(const std::string& variant) {
  return run_reference("reference_moe.py", "model_moe_parity", variant);
}

void check_parity(const std::string& variant, const std::string& architecture) {
  if (!python_can_import("transformers")) {
    GTEST_SKIP() << kReferencePython << " cannot import transformers; the architecture parity test needs it";
  }
  const std::string dir = generate_reference(variant);
  ASSERT_FALSE(::testing::Test::HasFailure());

  Result<ModelConfig> config = ModelConfig::from_file(dir + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_EQ(config->architecture, architecture);
  FlatModel<LlamaModel> model(*config);
  Status loaded = model.load_safetensors(dir + "/model.safetensors");
  ASSERT_TRUE(loaded.ok()) << loaded.to_string();

  std::ifstream ref_file(dir + "/reference.json");
  const nlohmann::json ref = nlohmann::json::parse(ref_file, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(ref.is_discarded()) << "cannot parse " << dir << "/reference.json";
  const int64_t B = ref["batch"].get<int64_t>();
  const int64_t T = ref["seq"].get<int64_t>();
  const std::vector<int32_t> inputs = flatten(ref["inputs"]);
  const std::vector<int32_t> targets = flatten(ref["targets"]);
  ASSERT_EQ(static_cast<int64_t>(inputs.size()), B * T);
  ASSERT_EQ(static_cast<int64_t>(targets.size()), B * T);

  // One micro-batch with grad_scale = 1 / valid: the gradient of mean NLL + coef * aux.
  const int64_t valid = count_valid_targets(targets.data(), B * T);
  ASSERT_GT(valid, 0);
  model.zero_grads();
  const double nll = model.forward_backward(inputs.data(), targets.data(), B, T, 1.0f / static_cast<float>(valid)) /
                     static_cast<double>(valid);
  const bool aux_in_loss = config->is_moe() && config->output_router_logits;
  const double loss = nll + (aux_in_loss ? config->router_aux_loss_coef * model.net().last_aux_loss() : 0.0);
  EXPECT_WITHIN(relative(loss, ref["loss"].get<double>()), kMoeLossTolerance)
      << " loss " << loss << " vs PyTorch " << ref["loss"].get<double>();
  if (config->is_moe()) {
    EXPECT_TRUE(aux_in_loss) << "the reference config sets output_router_logits";
    EXPECT_WITHIN(relative(model.net().last_aux_loss(), ref["aux_loss"].get<double>()), kMoeLossTolerance)
        << " aux loss " << model.net().last_aux_loss() << " vs PyTorch " << ref["aux_loss"].get<double>();
  }

  // Gradients, by name.
  std::ifstream grads_file(dir + "/grads.bin", std::ios::binary);
  ASSERT_TRUE(grads_file.good());
  std::vector<float> all_grads;
  for (float v; grads_file.read(reinterpret_cast<char*>(&v), sizeof(v));) all_grads.push_back(v);
  std::map<std::string, std::pair<int64_t, std::vector<int64_t>>> expected;  // name -> offset, shape
  for (const auto& g : ref["grads"]) {
    expected[g["name"].get<std::string>()] = {g["offset"].get<int64_t>(), g["shape"].get<std::vector<int64_t>>()};
  }
  EXPECT_EQ(expected.size(), model.layout().tensors().size());
  double worst = 0;
  std::string worst_name;
  for (const TensorSpec& t : model.layout().tensors()) {
    auto it = expected.find(t.name);
    ASSERT_NE(it, expected.end()) << "PyTorch has no tensor " << t.name;
    EXPECT_EQ(it->second.second, t.shape) << t.name;
    ASSERT_LE(it->second.first + t.numel, static_cast<int64_t>(all_grads.size())) << t.name;
    const double err = testing::relative_error(model.grads() + t.offset, all_grads.data() + it->second.first, t.numel);
    EXPECT_WITHIN(err, kMoeGradTolerance) << " gradient of " << t.name;
    if (!(err <= worst)) {
      worst = err;
      worst_name = t.name;
    }
  }

  // Every MoE layer routed each token K times.
  if (config->is_moe()) {
    const int64_t E = config->num_experts;
    const std::vector<int64_t>& counts = model.net().expert_token_counts();
    ASSERT_EQ(static_cast<int64_t>(counts.size()), config->num_hidden_layers * E);
    for (int64_t l = 0; l < config->num_hidden_layers; ++l) {
      int64_t sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += counts[l * E + e];
      EXPECT_EQ(sum, config->is_moe_layer(l) ? B * T * config->num_experts_per_tok : 0) << "layer " << l;
    }
  }
  std::printf("%s: loss error %.2e, worst gradient error %.2e (%s)\n", variant.c_str(),
              relative(loss, ref["loss"].get<double>()), worst, worst_name.c_str());
}

TEST(ArchitectureParityTest, MixtralMatchesTransformersLossAuxLossAndGradients) {
  check_parity("mixtral", "MixtralForCausalLM");
}

TEST(ArchitectureParityTest, Qwen2MoeWithSharedExpertMatchesTransformers) {
  check_parity("qwen2_moe", "Qwen2MoeForCausalLM");
}

TEST(ArchitectureParityTest, Qwen3MoeWithQkNormAndDenseLayerMatchesPyTorchReference) {
  check_parity("qwen3_moe", "Qwen3MoeForCausalLM");
}

TEST(ArchitectureParityTest, Qwen3WithQkNormAndTiedEmbeddingsMatchesPyTorchReference) {
  check_parity("qwen3", "Qwen3ForCausalLM");
}

TEST(ArchitectureParityTest, MistralMatchesTransformers) { check_parity("mistral", "MistralForCausalLM"); }

TEST(ArchitectureParityTest, Qwen2WithBiasesAndTiedEmbeddingsMatchesTransformers) {
  check_parity("qwen2", "Qwen2ForCausalLM");
}

}  // namespace
}  // namespace strata::model
