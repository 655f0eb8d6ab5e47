// A tiny Qwen2-MoE and random batches for it, shared by the decoder's MoE tests: layers 0 and 2
// have 4 experts (top-2) and a shared expert, layer 1 is dense; batches of kTinyB x kTinyT tokens.
#pragma once

#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "../test_util.h"
#include "core/check.h"
#include "model/config.h"

namespace strata::model {

inline constexpr int64_t kTinyB = 2;
inline constexpr int64_t kTinyT = 8;

// bias_rate > 0 turns on loss-free balancing's selection bias.
inline ModelConfig tiny_moe_config(bool output_router_logits, double bias_rate) {
  nlohmann::json j = {
      {"architectures", {"Qwen2MoeForCausalLM"}}, {"vocab_size", 31}, {"hidden_size", 16},
      {"intermediate_size", 24}, {"num_hidden_layers", 3}, {"num_attention_heads", 2},
      {"num_key_value_heads", 1}, {"max_position_embeddings", 64}, {"num_experts", 4},
      {"num_experts_per_tok", 2}, {"moe_intermediate_size", 12},
      {"shared_expert_intermediate_size", 20}, {"mlp_only_layers", {1}},
      {"router_aux_loss_coef", 0.1}, {"output_router_logits", output_router_logits},
      {"router_bias_update_rate", bias_rate}};
  Result<ModelConfig> c = ModelConfig::from_json(j, "tiny MoE");
  CHECK_MSG(c.ok(), c.status().to_string());
  return *c;
}

struct TinyBatch {
  std::vector<int32_t> inputs, targets;
};

// Token ids in [0, vocab - 1) drawn from `seed`.
inline TinyBatch tiny_batch(uint64_t seed, int64_t vocab) {
  const std::vector<float> r = testing::random_vector(2 * kTinyB * kTinyT, seed, 0.0f, 1.0f);
  TinyBatch b;
  for (int64_t i = 0; i < kTinyB * kTinyT; ++i) {
    b.inputs.push_back(static_cast<int32_t>(r[i] * (vocab - 1)));
    b.targets.push_back(static_cast<int32_t>(r[kTinyB * kTinyT + i] * (vocab - 1)));
  }
  return b;
}

}  // namespace strata::model
