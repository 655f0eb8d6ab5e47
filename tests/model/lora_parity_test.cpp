// LoRA (model/lora.h) against PEFT (tests/model/reference_lora.py, peft 0.11.1 over
// transformers 4.40): a base model and an adapter PEFT saved load in strata (the adapter through
// model/peft_io.h), and the step-1 loss, every adapter gradient and three AdamW steps match
// PEFT's; the frozen base gets no gradient and does not move. The adapter strata then exports
// loads in PeftModel.from_pretrained with PEFT's trained values and logits, and the merged export
// loads in transformers alone with the same logits.
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
#include "model/decoder.h"
#include "model/flat_model.h"
#include "model/hf_io.h"
#include "model/peft_io.h"
#include "model/reference_util.h"
#include "reference_adamw.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

constexpr double kLoraLossTolerance = 1e-6;
constexpr double kLoraGradTolerance = 1e-4;
constexpr double kStepLossTolerance = 1e-5;
constexpr double kStepParamTolerance = 3e-4;

// tests/model/reference_lora.py MODE ARGS...: exit status 0 when its check passes.
int run_check(const std::string& mode, const std::string& variant_dir, const std::string& target) {
  const std::string cmd = std::string(kReferencePython) + " " + STRATA_SOURCE_DIR + "/tests/model/reference_lora.py " +
                          mode + " " + variant_dir + " " + target + " >" + target + ".log 2>&1";
  return std::system(cmd.c_str());
}

void check_lora_parity(const std::string& variant) {
  if (!reference_script_runs("reference_lora.py"))
    GTEST_SKIP() << "tests/model/reference_lora.py probe: torch, transformers or peft cannot be imported here "
                 << "(scripts/setup.sh installs peft 0.11.1)";
  const std::string dir = run_reference("reference_lora.py", "lora_parity", variant);
  ASSERT_FALSE(::testing::Test::HasFailure());
  std::ifstream ref_file(dir + "/reference.json");
  const nlohmann::json ref = nlohmann::json::parse(ref_file, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(ref.is_discarded()) << "cannot parse " << dir << "/reference.json";

  // The base's config with the adapter's LoRA settings.
  Result<ModelConfig> config = ModelConfig::from_file(dir + "/base/config.json");
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  Result<LoraConfig> lora = read_peft_adapter_config(dir + "/adapter");
  ASSERT_TRUE(lora.ok()) << lora.status().to_string();
  EXPECT_EQ(lora->rank, ref["lora"]["r"].get<int64_t>());
  config->lora = *lora;
  ASSERT_TRUE(config->validate("test").ok());
  FlatModel<LlamaModel> model(*config);
  const ParamLayout& layout = model.layout();
  ASSERT_TRUE(layout.has_lora());
  Status loaded = model.load_safetensors(dir + "/base/model.safetensors");
  ASSERT_TRUE(loaded.ok()) << loaded.to_string();
  Result<SafetensorsReader> adapter = open_peft_adapter(dir + "/adapter", layout);
  ASSERT_TRUE(adapter.ok()) << adapter.status().to_string();
  for (const TensorSpec& t : layout.tensors()) {
    if (t.adapts < 0) continue;
    Status st = adapter->read_f32(peft_tensor_name(t.name), t.shape, model.params() + t.offset);
    ASSERT_TRUE(st.ok()) << st.to_string();
  }
  model.sync_compute_copy();
  const std::vector<float> base_before(model.params(), model.params() + layout.total_size());

  const int64_t B = ref["batch"].get<int64_t>();
  const int64_t T = ref["seq"].get<int64_t>();
  const std::vector<int32_t> inputs = flatten(ref["inputs"]);
  const std::vector<int32_t> targets = flatten(ref["targets"]);
  const int64_t valid = count_valid_targets(targets.data(), B * T);
  ASSERT_GT(valid, 0);
  auto train_loss = [&] {
    const double nll = model.forward_backward(inputs.data(), targets.data(), B, T, 1.0f / static_cast<float>(valid)) /
                       static_cast<double>(valid);
    const bool aux = config->is_moe() && config->output_router_logits;
    return nll + (aux ? config->router_aux_loss_coef * model.net().last_aux_loss() : 0.0);
  };
  model.zero_grads();
  const double loss = train_loss();
  EXPECT_WITHIN(relative(loss, ref["loss"].get<double>()), kLoraLossTolerance)
      << " loss " << loss << " vs PEFT " << ref["loss"].get<double>();

  // Gradients: every adapter's by PEFT name; none for the frozen base.
  const std::vector<float> all_grads = read_floats(dir + "/grads.bin");
  std::map<std::string, int64_t> offsets;
  for (const auto& g : ref["grads"]) offsets[g["name"].get<std::string>()] = g["offset"].get<int64_t>();
  int64_t adapters = 0;
  double worst = 0;
  for (const TensorSpec& t : layout.tensors()) {
    if (t.adapts < 0) {
      EXPECT_TRUE(t.frozen) << t.name;
      for (int64_t i = 0; i < t.numel; ++i) {
        if (model.grads()[t.offset + i] != 0.0f) {
          ADD_FAILURE() << "the frozen " << t.name << " has a gradient";
          break;
        }
      }
      continue;
    }
    ++adapters;
    const auto it = offsets.find(peft_tensor_name(t.name));
    ASSERT_NE(it, offsets.end()) << "PEFT has no tensor for " << t.name;
    ASSERT_LE(it->second + t.numel, static_cast<int64_t>(all_grads.size()));
    const double err = testing::relative_error(model.grads() + t.offset, all_grads.data() + it->second, t.numel);
    EXPECT_WITHIN(err, kLoraGradTolerance) << " gradient of " << t.name;
    worst = std::max(worst, err);
  }
  EXPECT_EQ(adapters, static_cast<int64_t>(offsets.size()));

  // Three AdamW steps on the same batch.
  const nlohmann::json& o = ref["adamw"];
  OptimizerConfig oc;
  oc.lr = o["lr"].get<float>();
  oc.beta1 = o["betas"][0].get<float>();
  oc.beta2 = o["betas"][1].get<float>();
  oc.eps = o["eps"].get<float>();
  oc.weight_decay = o["weight_decay"].get<float>();
  oc.grad_clip = 0.0f;
  AdamW optimizer(layout, oc);
  double worst_step = 0;
  for (size_t step = 0; step < o["losses"].size(); ++step) {
    model.zero_grads();
    const double l = train_loss();
    const double expected = o["losses"][step].get<double>();
    EXPECT_WITHIN(relative(l, expected), kStepLossTolerance) << " loss before step " << step;
    worst_step = std::max(worst_step, relative(l, expected));
    optimizer.step(model.params(), model.grads(), oc.lr);
    model.sync_compute_copy();
  }
  const std::vector<float> after = read_floats(dir + "/" + o["params_after"].get<std::string>());
  double worst_param = 0;
  for (const TensorSpec& t : layout.tensors()) {
    if (t.adapts < 0) {
      EXPECT_EQ(0, std::memcmp(model.params() + t.offset, base_before.data() + t.offset, t.numel * sizeof(float)))
          << "the frozen " << t.name << " moved";
      continue;
    }
    const int64_t offset = offsets.at(peft_tensor_name(t.name));
    const double err = testing::relative_error(model.params() + t.offset, after.data() + offset, t.numel);
    EXPECT_WITHIN(err, kStepParamTolerance) << " " << t.name << " after three steps";
    worst_param = std::max(worst_param, err);
  }
  std::printf("%s: loss error %.2e, worst adapter gradient error %.2e, worst step loss error %.2e, worst adapter "
              "error after three steps %.2e\n",
              variant.c_str(), relative(loss, ref["loss"].get<double>()), worst, worst_step, worst_param);

  // The trained adapter in PEFT's format: PeftModel.from_pretrained loads it with PEFT's values and logits.
  const fs::path out = fs::path(STRATA_BINARY_DIR) / "tests" / "lora_parity" / (variant + "_export");
  const float* params = model.params();
  auto read = [params](const TensorSpec& t, float* dst) {
    std::copy_n(params + t.offset, t.numel, dst);
    return Status::OK();
  };
  Status exported = export_peft_adapter(out.string(), layout, read, {.base_model = dir + "/base"});
  ASSERT_TRUE(exported.ok()) << exported.to_string();
  EXPECT_EQ(run_check("check", dir, out.string()), 0) << "PEFT's check failed; see " << out.string() << ".log";

  // Merged into the base: plain transformers, the same logits.
  const fs::path merged = fs::path(STRATA_BINARY_DIR) / "tests" / "lora_parity" / (variant + "_merged");
  auto read_merged = [&](const TensorSpec& t, float* dst) {
    std::copy_n(params + t.offset, t.numel, dst);
    if (const LoraOffsets* lo = layout.lora_of(t.offset)) {
      merge_lora(dst, params + lo->a, params + lo->b, t.shape[0], t.shape[1], config->lora.rank,
                 config->lora.scale());
    }
    return Status::OK();
  };
  exported = export_hf(merged.string(), *config, layout, read_merged);
  ASSERT_TRUE(exported.ok()) << exported.to_string();
  EXPECT_EQ(run_check("check_merged", dir, merged.string()), 0)
      << "the merged model's check failed; see " << merged.string() << ".log";
}

// Adapters on every attention and MLP projection of a Llama, B drawn nonzero so that A and B both
// get gradients.
TEST(LoraParityTest, LlamaAdaptersOnEveryProjectionMatchPeft) { check_lora_parity("llama_lora"); }

// PEFT's gaussian init on q and v only, B at its zero start: A's step-1 gradients are exactly 0.
TEST(LoraParityTest, GaussianInitOnQueriesAndValuesMatchesPeft) { check_lora_parity("llama_lora_gaussian"); }

// A Mixtral with adapters on the attention and on every expert's w1, w2 and w3 (run expert by
// expert, model/moe_layer.h), the router's auxiliary loss in the objective.
TEST(LoraParityTest, MixtralAdaptersOnTheExpertsMatchPeft) { check_lora_parity("mixtral_lora"); }

}  // namespace
}  // namespace strata::model
