// ModelConfig: the architecture of a Llama-family model, read from (and written as) a Hugging
// Face config.json, or taken from a named preset. Every error names the source file and key.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "kernels/rope.h"

namespace strata::model {

struct ModelConfig {
  std::string architecture = "LlamaForCausalLM";
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // 0 means "same as num_attention_heads" (fill_defaults)
  int64_t head_dim = 0;             // 0 means hidden_size / num_attention_heads (fill_defaults)
  double rms_norm_eps = 1e-6;
  kernels::RopeConfig rope;
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v projection biases (Qwen2); o_proj never has one

  // Reads the keys of a Hugging Face Llama config.json. `source` names the file in messages.
  // RoPE: top-level `rope_theta`, or the newer `rope_parameters` object (which wins when both
  // are present); `rope_scaling` / `rope_parameters` of type "llama3" enable Llama-3 scaling,
  // other scaling types are Unimplemented. The result is validated.
  static Result<ModelConfig> from_json(const nlohmann::json& json, const std::string& source);
  static Result<ModelConfig> from_file(const std::string& path);
  // Named architectures: "tiny" (the default CPU run), "llama3.2-1b", "llama3-8b".
  static Result<ModelConfig> preset(const std::string& name);

  // Resolves the defaulted fields (num_key_value_heads, head_dim) where they can be derived.
  void fill_defaults();
  // Checks sizes and divisibility; messages name `source` and the offending key.
  Status validate(const std::string& source) const;
  // Hugging Face-compatible config.json content; from_json(to_json()) gives back this config.
  nlohmann::json to_json() const;

  int64_t q_dim() const { return num_attention_heads * head_dim; }    // width of q_proj output
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }   // width of k/v_proj output
  // Parameter count (tied embeddings counted once).
  int64_t num_parameters() const;
};

}  // namespace strata::model
