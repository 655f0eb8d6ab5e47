// Helpers shared by the training-state tests: a small Llama config, random batches, an
// optimizer configuration.
#pragma once

#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>

#include "core/check.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/flat_model.h"
#include "model/params.h"
#include "ckpt/writer.h"
#include "core/io_faulty.h"
#include "reference_adamw.h"

namespace strata {

inline model::ModelConfig tiny_config(bool tied) {
  auto c = model::ModelConfig::preset("tiny");
  CHECK(c.ok());
  model::ModelConfig mc = *c;
  mc.hidden_size = 32;
  mc.intermediate_size = 48;
  mc.num_hidden_layers = 3;
  mc.num_attention_heads = 4;
  mc.num_key_value_heads = 2;
  mc.head_dim = 8;
  mc.tie_word_embeddings = tied;
  return mc;
}

// A model whose linear layers span more than one 128 x 128 block in both directions, so that the
// fp8 copies have several scales per tensor and ragged edge blocks.
inline model::ModelConfig fp8_config() {
  model::ModelConfig mc = tiny_config(false);
  mc.hidden_size = 160;
  mc.intermediate_size = 288;
  mc.num_attention_heads = 4;
  mc.num_key_value_heads = 2;
  mc.head_dim = 40;
  mc.num_hidden_layers = 3;
  return mc;
}

// A small DeepSeek-V3 (latent attention with a low-rank q, 8 sigmoid-scored experts in 2
// groups with the selection bias, an ungated shared expert, layer 0 dense) whose projections
// span more than one 128-block.
inline model::ModelConfig deepseek_config() {
  nlohmann::json j = {
      {"architectures", {"DeepseekV3ForCausalLM"}}, {"vocab_size", 256}, {"hidden_size", 160},
      {"intermediate_size", 288}, {"num_hidden_layers", 3}, {"num_attention_heads", 4},
      {"q_lora_rank", 136}, {"kv_lora_rank", 144}, {"qk_nope_head_dim", 32}, {"qk_rope_head_dim", 16},
      {"v_head_dim", 24}, {"max_position_embeddings", 64}, {"n_routed_experts", 8}, {"num_experts_per_tok", 2},
      {"n_group", 2}, {"topk_group", 1}, {"moe_intermediate_size", 136}, {"n_shared_experts", 1},
      {"first_k_dense_replace", 1}, {"routed_scaling_factor", 2.5}, {"num_nextn_predict_layers", 0},
      {"router_bias_update_rate", 0.001}, {"tie_word_embeddings", false}};
  Result<model::ModelConfig> c = model::ModelConfig::from_json(j, "train_test_util");
  CHECK_MSG(c.ok(), c.status().to_string());
  return *c;
}

// A small Qwen2-MoE (8 experts, top-2, a shared expert; layer 1 dense) whose projections span
// more than one 128-block: the experts' ops quantise too.
inline model::ModelConfig fp8_moe_config() {
  nlohmann::json j = {
      {"architectures", {"Qwen2MoeForCausalLM"}}, {"vocab_size", 256}, {"hidden_size", 160},
      {"intermediate_size", 288}, {"num_hidden_layers", 3}, {"num_attention_heads", 4},
      {"num_key_value_heads", 2}, {"max_position_embeddings", 64}, {"num_experts", 8},
      {"num_experts_per_tok", 2}, {"moe_intermediate_size", 136},
      {"shared_expert_intermediate_size", 96}, {"mlp_only_layers", {1}},
      {"router_aux_loss_coef", 0.01}, {"output_router_logits", true}, {"tie_word_embeddings", false}};
  Result<model::ModelConfig> c = model::ModelConfig::from_json(j, "train_test_util");
  CHECK_MSG(c.ok(), c.status().to_string());
  return *c;
}

struct Batch {
  std::vector<int32_t> inputs, targets;
};

// The fp32 weights model::init_weights gives a model of `layout` with `seed`: what a paged
// state's load_params starts from.
inline std::vector<float> initial_params(const model::ParamLayout& layout, uint64_t seed) {
  std::vector<float> params(static_cast<size_t>(layout.total_size()));
  model::init_weights(layout, params.data(), seed);
  return params;
}

inline std::vector<Batch> make_batches(int n, int64_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Batch> out(n);
  for (auto& b : out) {
    for (int64_t i = 0; i < tokens; ++i) {
      b.inputs.push_back(static_cast<int32_t>(rng() % 256));
      b.targets.push_back(static_cast<int32_t>(rng() % 256));
    }
  }
  return out;
}

// grad_clip 0.5 is small enough that clipping is active; overlapping AdamW with backward
// needs it off (0).
inline OptimizerConfig optimizer_config(float grad_clip) {
  OptimizerConfig oc;
  oc.lr = 1e-2f;
  oc.weight_decay = 0.1f;
  oc.grad_clip = grad_clip;
  return oc;
}

// The reference run: `steps` AdamW steps on the model's flat buffers, `accum` micro-batches of
// B x T tokens each (batches[s * accum + m]), the global norm clipped to `grad_clip` first.
// Returns each step's loss sum; the parameters stay in `net`.
// Net: model::LlamaModel or model::LlamaModelBf16 (AdamW on the fp32 master, then a fresh
// compute copy).
template <class Net>
std::vector<double> train_flat(model::FlatModel<Net>& net, const std::vector<Batch>& batches, int steps, int accum, int64_t B, int64_t T,
                               float grad_clip, float lr) {
  AdamW opt(net.layout(), optimizer_config(grad_clip));
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    net.zero_grads();
    double loss = 0;
    for (int m = 0; m < accum; ++m) {
      const Batch& b = batches[static_cast<size_t>(s * accum + m)];
      loss += net.forward_backward(b.inputs.data(), b.targets.data(), B, T, 1.0f / static_cast<float>(accum * B * T));
    }
    opt.clip_gradients(net.grads(), grad_clip);
    opt.step(net.params(), net.grads(), lr);
    net.sync_compute_copy();
    losses.push_back(loss);
  }
  return losses;
}

// Two runs gave bitwise the same losses and parameters (flat layout of mc).
inline void expect_runs_bitwise_equal(const std::vector<double>& losses_a, const std::vector<float>& params_a,
                                      const std::vector<double>& losses_b, const std::vector<float>& params_b,
                                      const model::ModelConfig& mc) {
  ASSERT_EQ(losses_a.size(), losses_b.size());
  for (size_t i = 0; i < losses_a.size(); ++i)
    EXPECT_EQ(std::memcmp(&losses_a[i], &losses_b[i], sizeof(double)), 0)
        << "step " << i << ": " << losses_a[i] << " vs " << losses_b[i];
  model::ParamLayout layout(mc);
  for (const auto& t : layout.tensors())
    EXPECT_EQ(std::memcmp(params_a.data() + t.offset, params_b.data() + t.offset, t.numel * sizeof(float)), 0)
        << t.name << " differs";
}

// A thread-pool engine behind a fault injector: a slow disk, and ENOSPC after `enospc_after`.
inline ckpt::IoEngineFactory faulty_engine(std::chrono::microseconds latency, uint64_t enospc_after = UINT64_MAX) {
  return [=] {
    FaultOptions f;
    f.write_latency = latency;
    f.enospc_after_bytes = enospc_after;
    return make_faulty_io_engine({.kind = "threads"}, f);
  };
}

}  // namespace strata
