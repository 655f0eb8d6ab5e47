// Model parity with PyTorch: tests/model/reference_llama.py builds a small GQA Llama in plain
// PyTorch, and this test loads its config and weights into LlamaModel and compares the loss,
// every parameter gradient and the losses of 20 AdamW steps with clipping.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/decoder.h"
#include "model/flat_model.h"
#include "model/safetensors.h"
#include "../test_util.h"
#include "model/reference_util.h"
#include "reference_adamw.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

constexpr double kLossTolerance = 1e-5;
constexpr double kGradTolerance = 1e-4;
constexpr double kStepTolerance = 1e-4;

std::string generate_reference(const std::string& variant) {
  return run_reference("reference_llama.py", "model_parity", variant);
}

using strata::testing::read_json;

void check_parity(const std::string& variant) {
  if (!python_can_import("torch")) {
    GTEST_SKIP() << kReferencePython << " cannot import torch (Debian package python3-torch); "
                 << "the PyTorch parity test needs it";
  }
  const std::string dir = generate_reference(variant);
  ASSERT_FALSE(::testing::Test::HasFailure());

  Result<ModelConfig> config = ModelConfig::from_file(dir + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  FlatModel<LlamaModel> model(*config);
  Status loaded = model.load_safetensors(dir + "/model.safetensors");
  ASSERT_TRUE(loaded.ok()) << loaded.to_string();

  const nlohmann::json ref = read_json(dir + "/reference.json");
  ASSERT_FALSE(ref.is_discarded());
  const int64_t B = ref["batch"].get<int64_t>();
  const int64_t T = ref["seq"].get<int64_t>();
  const int64_t num_batches = static_cast<int64_t>(ref["inputs"].size());
  std::vector<std::vector<int32_t>> inputs(num_batches), targets(num_batches);
  for (int64_t b = 0; b < num_batches; ++b) {
    for (const auto& row : ref["inputs"][b])
      for (const auto& tok : row) inputs[b].push_back(tok.get<int32_t>());
    for (const auto& row : ref["targets"][b])
      for (const auto& tok : row) targets[b].push_back(tok.get<int32_t>());
    ASSERT_EQ(static_cast<int64_t>(inputs[b].size()), B * T);
    ASSERT_EQ(static_cast<int64_t>(targets[b].size()), B * T);
  }

  // Loss and gradients of batch 0 (the gradient of the mean loss).
  const int64_t valid = count_valid_targets(targets[0].data(), B * T);
  ASSERT_GT(valid, 0);
  model.zero_grads();
  const double loss =
      model.forward_backward(inputs[0].data(), targets[0].data(), B, T, 1.0f / static_cast<float>(valid)) /
      static_cast<double>(valid);
  EXPECT_WITHIN(relative(loss, ref["loss"].get<double>()), kLossTolerance)
      << " loss " << loss << " vs PyTorch " << ref["loss"].get<double>();

  Result<SafetensorsReader> grads = SafetensorsReader::open(dir + "/grads.safetensors");
  ASSERT_TRUE(grads.ok()) << grads.status().to_string();
  EXPECT_EQ(grads->tensors().size(), model.layout().tensors().size());
  double worst_grad = 0;
  std::string worst_grad_name;
  for (const TensorSpec& t : model.layout().tensors()) {
    std::vector<float> expected(static_cast<size_t>(t.numel));
    Status st = grads->read_f32(t.name, t.shape, expected.data());
    ASSERT_TRUE(st.ok()) << st.to_string();
    const double err = testing::relative_error(model.grads() + t.offset, expected.data(), t.numel);
    EXPECT_WITHIN(err, kGradTolerance) << " gradient of " << t.name;
    if (!(err <= worst_grad)) {
      worst_grad = err;
      worst_grad_name = t.name;
    }
  }

  // 20 AdamW steps with clipping, alternating the batches as the script does.
  const nlohmann::json& o = ref["optimizer"];
  OptimizerConfig oc;
  oc.lr = o["lr"].get<float>();
  oc.beta1 = o["beta1"].get<float>();
  oc.beta2 = o["beta2"].get<float>();
  oc.eps = o["eps"].get<float>();
  oc.weight_decay = o["weight_decay"].get<float>();
  oc.grad_clip = o["grad_clip"].get<float>();
  AdamW optimizer(model.layout(), oc);
  const auto& step_losses = ref["step_losses"];
  const auto& step_norms = ref["step_grad_norms"];
  ASSERT_EQ(step_losses.size(), step_norms.size());
  double worst_step = 0;
  for (size_t step = 0; step < step_losses.size(); ++step) {
    const int64_t b = static_cast<int64_t>(step) % num_batches;
    const int64_t n_valid = count_valid_targets(targets[b].data(), B * T);
    model.zero_grads();
    const double step_loss =
        model.forward_backward(inputs[b].data(), targets[b].data(), B, T, 1.0f / static_cast<float>(n_valid)) /
        static_cast<double>(n_valid);
    const double norm = optimizer.clip_gradients(model.grads(), oc.grad_clip);
    optimizer.step(model.params(), model.grads(), oc.lr);
    worst_step = std::max({worst_step, relative(step_loss, step_losses[step].get<double>()),
                           relative(norm, step_norms[step].get<double>())});
    EXPECT_WITHIN(relative(step_loss, step_losses[step].get<double>()), kStepTolerance)
        << " loss at step " << step << ": " << step_loss << " vs PyTorch " << step_losses[step].get<double>();
    EXPECT_WITHIN(relative(norm, step_norms[step].get<double>()), kStepTolerance)
        << " gradient norm at step " << step << ": " << norm << " vs PyTorch "
        << step_norms[step].get<double>();
  }
  // The margins, for whoever tightens or loosens the tolerances.
  std::printf("%s: loss error %.2e, worst gradient error %.2e (%s), worst step error %.2e\n", variant.c_str(),
              relative(loss, ref["loss"].get<double>()), worst_grad, worst_grad_name.c_str(), worst_step);
}

TEST(LlamaParityTest, UntiedMatchesPyTorchLossGradientsAndAdamWSteps) { check_parity("untied"); }

TEST(LlamaParityTest, TiedWithLlama3RopeMatchesPyTorchLossGradientsAndAdamWSteps) { check_parity("tied"); }

}  // namespace
}  // namespace strata::model
