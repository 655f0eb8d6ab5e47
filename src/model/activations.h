// The activation table of LlamaModel: every buffer forward and backward use, planned in one
// list of (field, size), allocated as ONE block and handed out as pointers (as llm.c does).
// N = B * T tokens; C hidden; F intermediate; Hq, Hkv heads; D head dim; L layers.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"

namespace strata::model {

class ActivationTable {
 public:
  // Plans for B x T tokens. Every size depends on N = B * T only; the block is reallocated
  // only when N grows, and the pointers below are valid until then.
  void reserve(const ModelConfig& config, int64_t B, int64_t T);
  // Floats held (for logging and tests).
  int64_t size() const { return static_cast<int64_t>(storage_.size()); }

  // Kept across the whole forward/backward.
  float* checkpoints = nullptr;  // (L+1, N, C) input of layer l at slot l; slot L feeds the final norm
  float* final_out = nullptr;    // (N, C) final RMSNorm output, the LM head's input
  float* final_rstd = nullptr;   // (N)
  float* d_final = nullptr;      // (N, C) gradient of final_out
  float* dres = nullptr;         // (N, C) gradient of the residual stream

  // One layer's intermediates, written by forward and again by backward's recomputation.
  float* ln1 = nullptr;       // (N, C) input_layernorm output
  float* ln1_rstd = nullptr;  // (N)
  float* q = nullptr;         // (N, Hq*D) after RoPE
  float* k = nullptr;         // (N, Hkv*D) after RoPE
  float* v = nullptr;         // (N, Hkv*D)
  float* att = nullptr;       // (N, Hq*D) attention output before o_proj
  float* lse = nullptr;       // (B, Hq, T) softmax log-sum-exp
  float* h = nullptr;         // (N, C) residual after attention
  float* ln2 = nullptr;       // (N, C) post_attention_layernorm output
  float* ln2_rstd = nullptr;  // (N)
  float* gate = nullptr;      // (N, F)
  float* up = nullptr;        // (N, F)
  float* act = nullptr;       // (N, F) silu(gate) * up

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

 private:
  int64_t planned_tokens_ = 0;
  std::vector<float> storage_;
};

}  // namespace strata::model
