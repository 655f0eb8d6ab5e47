#include "model/activations.h"

#include <algorithm>
#include <utility>

#include "model/params.h"

namespace strata::model {

void ActivationTable::reserve(const ModelConfig& config, int64_t B, int64_t T, bool offload_checkpoints) {
  int64_t N = B * T;
  if (N <= planned_tokens_ && offload_checkpoints == planned_offload_) return;
  N = std::max(N, planned_tokens_);
  const int64_t C = config.hidden_size;
  const int64_t F = config.dense_mlp_width();
  const int64_t L = config.num_hidden_layers;
  const int64_t q_dim = config.q_dim();
  const int64_t kv_dim = config.kv_dim();
  const int64_t Hq = config.num_attention_heads;
  const int64_t Hkv = config.num_key_value_heads;
  const bool qk = config.qk_norm;
  const bool moe = config.is_moe();
  const int64_t E = moe ? config.num_experts : 0;
  const int64_t K = moe ? config.num_experts_per_tok : 0;
  const int64_t S = N * K;
  const int64_t Fe = moe ? config.moe_intermediate_size : 0;
  const int64_t checkpoint_slots = offload_checkpoints ? std::min<int64_t>(3, L + 1) : L + 1;
  const int64_t shared = moe && config.shared_expert_intermediate_size > 0 ? 1 : 0;

  const std::pair<float**, int64_t> plan[] = {
      {&checkpoints, checkpoint_slots * N * C},
      {&final_out, N * C},
      {&final_rstd, N},
      {&d_final, N * C},
      {&dres, N * C},
      {&ln1, N * C},
      {&ln1_rstd, N},
      {&q, N * q_dim},
      {&k, N * kv_dim},
      {&q_raw, qk ? N * q_dim : 0},
      {&k_raw, qk ? N * kv_dim : 0},
      {&q_norm_rstd, qk ? N * Hq : 0},
      {&k_norm_rstd, qk ? N * Hkv : 0},
      {&v, N * kv_dim},
      {&att, N * q_dim},
      {&lse, N * Hq},  // (B, Hq, T)
      {&h, N * C},
      {&ln2, N * C},
      {&ln2_rstd, N},
      {&gate, N * F},
      {&up, N * F},
      {&act, N * F},
      {&router_logits, N * E},
      {&router_probs, N * E},
      {&route_weights, N * K},
      {&expert_xs, S * C},
      {&expert_gate, S * Fe},
      {&expert_up, S * Fe},
      {&expert_act, S * Fe},
      {&expert_ys, S * C},
      {&shared_out, shared * N * C},
      {&shared_logit, shared * N},
      {&d_ln, N * C},
      {&d_tmp, N * C},
      {&d_q, N * q_dim},
      {&d_k, N * kv_dim},
      {&d_v, N * kv_dim},
      {&d_att, N * q_dim},
      {&d_gate, N * F},
      {&d_up, N * F},
      {&d_act, N * F},
      {&d_qk_raw, qk ? N * q_dim : 0},
      {&d_route_weights, N * K},
      {&d_router_logits, N * E},
      {&d_expert_ys, S * C},
      {&d_expert_xs, S * C},
      {&d_expert_gate, S * Fe},
      {&d_expert_up, S * Fe},
      {&d_expert_act, S * Fe},
      {&d_shared_logit, shared * N},
  };
  // Each buffer starts at a multiple of kParamAlignment elements into the block, like the
  // parameters in theirs.
  auto aligned = [](int64_t n) { return (n + kParamAlignment - 1) / kParamAlignment * kParamAlignment; };
  int64_t total = 0;
  for (const auto& [field, n] : plan) total += aligned(n);
  storage_.assign(static_cast<size_t>(total), 0.0f);
  int64_t offset = 0;
  for (const auto& [field, n] : plan) {
    *field = storage_.data() + offset;
    offset += aligned(n);
  }
  // Routing indices: expert_idx and slot_of (N, K) each, token_of_slot (S).
  index_storage_.assign(static_cast<size_t>(3 * S), 0);
  expert_idx = index_storage_.data();
  slot_of = expert_idx + S;
  token_of_slot = slot_of + S;
  offset_storage_.assign(static_cast<size_t>(E + 1), 0);
  expert_offsets = offset_storage_.data();
  planned_tokens_ = N;
  planned_offload_ = offload_checkpoints;
  checkpoint_slots_ = checkpoint_slots;
}

}  // namespace strata::model
