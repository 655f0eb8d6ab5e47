#include "model/activations.h"

#include <utility>

#include "model/params.h"

namespace strata::model {

void ActivationTable::reserve(const ModelConfig& config, int64_t B, int64_t T) {
  const int64_t N = B * T;
  if (N <= planned_tokens_) return;
  const int64_t C = config.hidden_size;
  const int64_t F = config.intermediate_size;
  const int64_t L = config.num_hidden_layers;
  const int64_t q_dim = config.q_dim();
  const int64_t kv_dim = config.kv_dim();
  const int64_t Hq = config.num_attention_heads;

  const std::pair<float**, int64_t> plan[] = {
      {&checkpoints, (L + 1) * N * C},
      {&final_out, N * C},
      {&final_rstd, N},
      {&d_final, N * C},
      {&dres, N * C},
      {&ln1, N * C},
      {&ln1_rstd, N},
      {&q, N * q_dim},
      {&k, N * kv_dim},
      {&v, N * kv_dim},
      {&att, N * q_dim},
      {&lse, N * Hq},  // (B, Hq, T)
      {&h, N * C},
      {&ln2, N * C},
      {&ln2_rstd, N},
      {&gate, N * F},
      {&up, N * F},
      {&act, N * F},
      {&d_ln, N * C},
      {&d_tmp, N * C},
      {&d_q, N * q_dim},
      {&d_k, N * kv_dim},
      {&d_v, N * kv_dim},
      {&d_att, N * q_dim},
      {&d_gate, N * F},
      {&d_up, N * F},
      {&d_act, N * F},
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
  planned_tokens_ = N;
}

}  // namespace strata::model
