// ModelConfig: the architecture of a decoder model, read from (and written as) a Hugging Face
// config.json, or taken from a named preset. Every error names the source file and key.
//
// Architectures (config.json `architectures`, or `model_type` when that is absent):
//   LlamaForCausalLM, MistralForCausalLM  the Llama decoder (Mistral: sliding window only when
//                                         it covers the whole sequence)
//   Qwen2ForCausalLM                      plus q/k/v projection biases
//   MixtralForCausalLM                    every MLP is a mixture of experts (top-k logits, then
//                                         softmax), tensors under block_sparse_moe
//   Qwen2MoeForCausalLM                   q/k/v biases; experts (softmax, then top-k) plus a
//                                         sigmoid-gated shared expert; dense layers where
//                                         decoder_sparse_step / mlp_only_layers say so
//   Qwen3ForCausalLM                      the Llama decoder plus per-head RMSNorm of q and k
//                                         before RoPE (q/k/v biases when attention_bias says so)
//   Qwen3MoeForCausalLM                   like Qwen2-MoE without the shared expert and biases,
//                                         plus per-head RMSNorm of q and k before RoPE
//   DeepseekV2ForCausalLM,                multi-head latent attention (low-rank q and kv, a
//   DeepseekV3ForCausalLM                 decoupled RoPE key shared by the heads); experts with
//                                         softmax (V2) or sigmoid (V3) scores, group-limited
//                                         top-k, a routed scaling factor and ungated shared
//                                         experts; the first layers dense
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "kernels/moe.h"
#include "kernels/rope.h"
#include "model/lora.h"

namespace strata::model {

// The largest model strata accepts, in one place. Every path that builds a ModelConfig from
// outside data (config.json, `model.set`, a checkpoint's model_config) goes through
// ModelConfig::validate, which refuses a larger value naming the key, the value and the limit
// before anything is sized from it. The limits admit every published model with room to spare
// (the largest have hidden 16384-18432, vocabularies of ~262k, 61-126 layers, 256-384 experts),
// and keep every product strata forms from them (elements of a tensor, of the model, bytes of
// each state kind and of a step's traffic) far inside int64.
struct ModelLimits {
  static constexpr int64_t kVocabSize = int64_t{1} << 24;         // vocab_size
  static constexpr int64_t kHiddenSize = int64_t{1} << 16;        // hidden_size
  static constexpr int64_t kIntermediateSize = int64_t{1} << 20;  // intermediate_size and the expert widths
  static constexpr int64_t kLayers = 1024;                        // num_hidden_layers, decoder_sparse_step
  static constexpr int64_t kHeads = 4096;                         // num_attention_heads, num_key_value_heads
  static constexpr int64_t kHeadDim = 4096;                       // head_dim, the MLA head dims
  static constexpr int64_t kLoraRank = int64_t{1} << 16;          // q_lora_rank, kv_lora_rank
  static constexpr int64_t kExperts = 4096;                       // num_experts / num_local_experts
  static constexpr int64_t kPositions = int64_t{1} << 30;         // max_position_embeddings, sliding_window
  // Over the whole model: parameter tensors (a ParamLayout entry each) and parameters (2^44 is
  // about 17.6 trillion).
  static constexpr int64_t kTensors = int64_t{1} << 20;
  static constexpr int64_t kParameters = int64_t{1} << 44;
};

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
  bool qk_norm = false;         // Qwen3: RMSNorm over head_dim of every q and k head before RoPE
  // Sliding-window attention (Mistral; Qwen with use_sliding_window); 0 = none. Attention is
  // exact only while the window covers the sequence: see check_sequence_length.
  int64_t sliding_window = 0;

  // Multi-head latent attention (DeepSeek-V2/V3), on when kv_lora_rank > 0. Keys are the
  // compressed kv_a_proj_with_mqa output (kv_lora_rank, RMS-normalised, then kv_b_proj to every
  // head's qk_nope_head_dim key part and v_head_dim value) and a qk_rope_head_dim RoPE key all
  // heads share; queries come from q_proj, or through q_a_proj, its RMSNorm and q_b_proj when
  // q_lora_rank > 0. A q or k head is head_dim = qk_nope_head_dim + qk_rope_head_dim wide
  // (fill_defaults), num_key_value_heads = num_attention_heads, and RoPE turns the last
  // qk_rope_head_dim of each (DeepSeek's checkpoints hold them interleaved: rope_interleaved).
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;

  // Mixture of experts. num_experts == 0: every layer has a dense MLP of intermediate_size.
  int64_t num_experts = 0;                      // E (Mixtral: num_local_experts)
  int64_t num_experts_per_tok = 0;              // K
  int64_t moe_intermediate_size = 0;            // width of one expert (Mixtral: intermediate_size)
  int64_t shared_expert_intermediate_size = 0;  // Qwen2-MoE shared expert; 0 = none
  kernels::RouterScoring router_scoring = kernels::RouterScoring::kTopKThenSoftmax;
  bool norm_topk_prob = false;    // kSoftmaxThenTopK: renormalise the K probabilities
  int64_t decoder_sparse_step = 1;  // layer l is MoE when (l + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;  // ... and l is not listed here
  double router_aux_loss_coef = 0.0;
  // As in transformers, the auxiliary loss joins the training loss only when this is true.
  bool output_router_logits = false;
  // strata extension (key `router_bias_update_rate`): > 0 turns on auxiliary-loss-free
  // balancing (DeepSeek-V3), a per-expert selection bias moved by this much after each step.
  double router_bias_update_rate = 0.0;
  // DeepSeek's routing (kernels/moe.h RouterConfig): group-limited top-k over n_group groups,
  // the best topk_group of them by group_score; every weight multiplied by routed_scale.
  int64_t n_group = 1;
  int64_t topk_group = 1;
  kernels::GroupScore group_score = kernels::GroupScore::kMax;
  double routed_scale = 1.0;
  // DeepSeek-V3 (topk_method noaux_tc): each MoE layer's router holds a selection bias,
  // mlp.gate.e_score_correction_bias, added to the scores that choose the experts only. It is
  // the loss-free balancing bias (router_bias_update_rate moves it).
  bool router_selection_bias = false;
  // The shared expert's sigmoid gate (Qwen2-MoE's shared_expert_gate); DeepSeek's shared experts
  // (mlp.shared_experts, n_shared_experts x moe_intermediate_size wide) add ungated.
  bool shared_expert_gated = true;
  // DeepSeek's dense layers: layer l is MoE when l >= first_k_dense_replace and l %
  // moe_layer_freq == 0 (used instead of decoder_sparse_step and mlp_only_layers).
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  // DeepSeek-V3's multi-token prediction (num_nextn_predict_layers): after the model's layers,
  // module d (block num_hidden_layers + d, named model.layers.{num_hidden_layers + d}.* as the
  // published checkpoints store it) projects [enorm(embedding of the token d + 1 ahead),
  // hnorm(previous depth's hidden state)] through eh_proj into one more decoder block, whose
  // output goes through its shared_head.norm to the model's LM head and a cross-entropy for the
  // token d + 2 ahead. It shares the embedding and LM head. (DeepSeek-V3/R1 publish one.)
  int64_t num_nextn_predict_layers = 0;
  // What the MTP cross-entropy weighs in training (train.mtp_weight; not a config.json key): the
  // step's objective is (sum of the main NLL + mtp_loss_weight / num_nextn_predict_layers x sum of
  // the MTP NLL) / (the step's main targets). 0: the MTP modules are not computed and their
  // tensors not updated (kept as loaded, and exported unchanged).
  double mtp_loss_weight = 0.1;
  // Low-rank adapters (train.method=lora and the lora.* keys; not config.json keys): with
  // lora.enabled() the layout holds the adapters and every other tensor is frozen.
  LoraConfig lora;

  // Reads the keys of a Hugging Face Llama config.json. `source` names the file in messages.
  // RoPE: top-level `rope_theta`, or the newer `rope_parameters` object (which wins when both
  // are present); `rope_scaling` / `rope_parameters` of type "linear", "dynamic", "llama3" or
  // "yarn" enable that scaling (kernels/rope.h), other types are Unimplemented. The result is
  // validated.
  static Result<ModelConfig> from_json(const nlohmann::json& json, const std::string& source);
  static Result<ModelConfig> from_file(const std::string& path);
  // Named architectures: "tiny" (the default CPU run), "llama3.2-1b", "llama3-8b".
  static Result<ModelConfig> preset(const std::string& name);

  // Resolves the defaulted fields (num_key_value_heads, head_dim) where they can be derived.
  void fill_defaults();
  // Checks sizes against ModelLimits (each key, then the model's tensor and parameter counts,
  // with overflow-checked arithmetic) and divisibility; messages name `source`, the offending
  // key, its value and the limit. OK means every size derived from this config fits in int64.
  Status validate(const std::string& source) const;
  // The keys from_json reads (what `model.set` may override); other config.json keys are
  // ignored when reading a file.
  static bool is_known_key(const std::string& key);
  static const std::vector<std::string>& known_keys();
  // Hugging Face-compatible config.json content; from_json(to_json()) gives back this config.
  nlohmann::json to_json() const;

  // Unimplemented, naming the architecture, for models strata cannot yet generate from (latent
  // attention has no KV cache yet).
  Status check_generation() const;
  // Fails with Unimplemented naming `sliding_window` when a window shorter than seq_len would
  // change attention (strata's attention is full causal).
  Status check_sequence_length(int64_t seq_len, const std::string& source) const;

  bool is_moe() const { return num_experts > 0; }
  // The decoder blocks of the layout: the model's layers, then the MTP modules' blocks.
  int64_t num_blocks() const { return num_hidden_layers + num_nextn_predict_layers; }
  bool is_mtp_block(int64_t block) const { return block >= num_hidden_layers; }
  // Whether training computes the MTP modules (and updates them).
  bool trains_mtp() const { return num_nextn_predict_layers > 0 && mtp_loss_weight > 0; }
  bool is_mla() const { return kv_lora_rank > 0; }
  // Whether the routers hold a selection bias (loss-free balancing, or DeepSeek-V3's
  // e_score_correction_bias): training state saved beside the parameters.
  bool has_selection_bias() const { return is_moe() && (router_bias_update_rate > 0 || router_selection_bias); }
  bool is_deepseek() const {
    return architecture == "DeepseekV2ForCausalLM" || architecture == "DeepseekV3ForCausalLM";
  }
  // The dims RoPE turns in a q or k head: the last qk_rope_head_dim with MLA, else all of them.
  int64_t rope_dim() const { return is_mla() ? qk_rope_head_dim : head_dim; }
  // Width of a value head and of the attention output (o_proj's input): v_head_dim with MLA.
  int64_t value_head_dim() const { return is_mla() ? v_head_dim : head_dim; }
  int64_t att_dim() const { return num_attention_heads * value_head_dim(); }
  // Whether decoder block `layer` (a layer, or an MTP module's block) has a mixture of experts
  // instead of a dense MLP.
  bool is_moe_layer(int64_t layer) const;
  // MoE layers among the model's layers (the MTP blocks not counted).
  int64_t num_moe_layers() const;
  // Widest dense MLP any block runs: intermediate_size of the dense layers, the shared expert.
  int64_t dense_mlp_width() const;
  // The DeepSeek configs' n_shared_experts (shared_expert_intermediate_size / moe_intermediate_size).
  int64_t deepseek_shared_experts() const {
    return moe_intermediate_size > 0 ? shared_expert_intermediate_size / moe_intermediate_size : 0;
  }
  // Mixtral names its MoE tensors block_sparse_moe.{gate, experts.E.w1/w2/w3}; the Qwen models
  // mlp.{gate, experts.E.gate_proj/up_proj/down_proj}.
  bool uses_mixtral_tensor_names() const { return architecture == "MixtralForCausalLM"; }
  kernels::RouterConfig router_config() const {
    return {num_experts,  num_experts_per_tok, router_scoring, norm_topk_prob, n_group,
            topk_group,   group_score,         static_cast<float>(routed_scale)};
  }

  int64_t q_dim() const { return num_attention_heads * head_dim; }    // width of q_proj output
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }   // width of k/v_proj output (a k head's with MLA)
  int64_t v_dim() const { return num_key_value_heads * value_head_dim(); }  // the values' width
  // Parameter count (tied embeddings counted once). REQUIRES: validate(...) is OK.
  int64_t num_parameters() const;
  // Parameter tensors (ParamLayout entries) of this model. REQUIRES: validate(...) is OK.
  int64_t num_tensors() const;

 private:
  // validate() after the per-key bounds: divisibility, RoPE, sliding window and expert keys.
  Status validate_shape(const std::string& source) const;
  // The parameter count, or nullopt when it overflows int64.
  std::optional<int64_t> count_parameters() const;
};

}  // namespace strata::model
