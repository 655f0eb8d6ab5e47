// The activation table of LlamaModel: every buffer forward and backward use, planned in one
// list of (field, size), allocated as ONE block and handed out as pointers (as llm.c does).
// N = B * T tokens; C hidden; F the widest dense MLP (ModelConfig::dense_mlp_width: dense
// layers and the shared expert); Hq, Hkv heads; D head dim; L layers. MoE: E experts, K per
// token, S = N * K expert rows, Fe one expert's width. Buffers a config does not use are empty.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"

namespace strata::model {

class ActivationTable {
 public:
  // Plans for B x T tokens. Every size depends on N = B * T only; the block is reallocated
  // only when N grows or `offload_checkpoints` changes, and the pointers below are valid until
  // then. With offload_checkpoints the checkpoints get min(3, L + 1) slots (see below).
  void reserve(const ModelConfig& config, int64_t B, int64_t T, bool offload_checkpoints = false);
  // Floats held (for logging and tests).
  int64_t size() const { return static_cast<int64_t>(storage_.size()); }
  // Slots of N * C floats in `checkpoints`: L + 1, or min(3, L + 1) when planned for offload.
  int64_t checkpoint_slots() const { return checkpoint_slots_; }

  // Kept across the whole forward/backward.
  // (slots, N, C). Without offload, slot l holds the input of layer l and slot L feeds the final
  // norm. With offload, checkpoint l < L rotates through slots l % 2 and checkpoint L is slot
  // min(L, 2).
  float* checkpoints = nullptr;
  float* final_out = nullptr;    // (N, C) final RMSNorm output, the LM head's input
  float* final_rstd = nullptr;   // (N)
  float* d_final = nullptr;      // (N, C) gradient of final_out
  float* dres = nullptr;         // (N, C) gradient of the residual stream

  // One layer's intermediates, written by forward and again by backward's recomputation.
  float* ln1 = nullptr;       // (N, C) input_layernorm output
  float* ln1_rstd = nullptr;  // (N)
  float* q = nullptr;         // (N, Hq*D) after RoPE
  float* k = nullptr;         // (N, Hkv*D) after RoPE
  float* q_raw = nullptr;     // (N, Hq*D) q_proj output before q_norm (qk_norm only)
  float* k_raw = nullptr;     // (N, Hkv*D) k_proj output before k_norm (qk_norm only)
  float* q_norm_rstd = nullptr;  // (N*Hq) (qk_norm only)
  float* k_norm_rstd = nullptr;  // (N*Hkv) (qk_norm only)
  float* v = nullptr;         // (N, Hkv*D)
  float* att = nullptr;       // (N, Hq*D) attention output before o_proj
  float* lse = nullptr;       // (B, Hq, T) softmax log-sum-exp
  float* h = nullptr;         // (N, C) residual after attention
  float* ln2 = nullptr;       // (N, C) post_attention_layernorm output
  float* ln2_rstd = nullptr;  // (N)
  float* gate = nullptr;      // (N, F)
  float* up = nullptr;        // (N, F)
  float* act = nullptr;       // (N, F) silu(gate) * up

  // One MoE layer's intermediates (MoE models only). The shared expert runs in gate/up/act.
  float* router_logits = nullptr;  // (N, E)
  float* router_probs = nullptr;   // (N, E) softmax over all experts
  float* route_weights = nullptr;  // (N, K)
  int32_t* expert_idx = nullptr;   // (N, K)
  int32_t* slot_of = nullptr;      // (N, K) row of assignment (n, k) in the expert order
  int32_t* token_of_slot = nullptr;  // (S)
  int64_t* expert_offsets = nullptr;  // (E+1)
  float* expert_xs = nullptr;      // (S, C) tokens gathered in expert order
  float* expert_gate = nullptr;    // (S, Fe)
  float* expert_up = nullptr;      // (S, Fe)
  float* expert_act = nullptr;     // (S, Fe)
  float* expert_ys = nullptr;      // (S, C)
  float* shared_out = nullptr;     // (N, C) shared expert output before its sigmoid gate
  float* shared_logit = nullptr;   // (N) shared_expert_gate(x)

  // One layer's gradient scratch.
  float* d_ln = nullptr;    // (N, C) gradient of a norm's output
  float* d_tmp = nullptr;   // (N, C) partial input gradients before they are summed
  float* d_q = nullptr;     // (N, Hq*D)
  float* d_k = nullptr;     // (N, Hkv*D)
  float* d_v = nullptr;     // (N, Hkv*D)
  float* d_att = nullptr;   // (N, Hq*D)
  float* d_gate = nullptr;  // (N, F)
  float* d_up = nullptr;    // (N, F)
  float* d_act = nullptr;   // (N, F)
  float* d_qk_raw = nullptr;  // (N, Hq*D) gradient of q_raw or k_raw (qk_norm only)
  float* d_route_weights = nullptr;  // (N, K)
  float* d_router_logits = nullptr;  // (N, E)
  float* d_expert_ys = nullptr;      // (S, C)
  float* d_expert_xs = nullptr;      // (S, C)
  float* d_expert_gate = nullptr;    // (S, Fe)
  float* d_expert_up = nullptr;      // (S, Fe)
  float* d_expert_act = nullptr;     // (S, Fe)
  float* d_shared_logit = nullptr;   // (N)

 private:
  int64_t planned_tokens_ = 0;
  bool planned_offload_ = false;
  int64_t checkpoint_slots_ = 0;
  std::vector<float> storage_;
  std::vector<int32_t> index_storage_;
  std::vector<int64_t> offset_storage_;
};

}  // namespace strata::model
