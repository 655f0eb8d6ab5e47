#include "model/moe_layer.h"

#include <cmath>

#include "kernels/linear.h"
#include "kernels/moe.h"
#include "kernels/swiglu.h"

namespace strata::model {
namespace {

float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// a (n) += b (n)
void add_inplace(float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

}  // namespace

void moe_route(const ModelConfig& config, const float* router, const float* selection_bias,
               const ActivationTable& a, const float* x, const RouterStats* stats, int64_t N) {
  namespace k = kernels::cpu;
  const int64_t C = config.hidden_size;
  const int64_t E = config.num_experts;
  const int64_t K = config.num_experts_per_tok;
  k::linear_forward(a.router_logits, x, router, nullptr, N, C, E);
  k::moe_route_forward(a.expert_idx, a.route_weights, a.router_probs, a.router_logits, selection_bias, N,
                       config.router_config());
  if (stats != nullptr) {
    k::moe_router_stats(stats->counts, stats->prob_sums, a.expert_idx, a.router_probs, N, K, E);
  }
  k::moe_permute(a.slot_of, a.token_of_slot, a.expert_offsets, a.expert_idx, N, K, E);
  k::moe_gather(a.expert_xs, x, a.token_of_slot, N * K, C);
}

void moe_mlp_forward(const ModelConfig& config, const MoeParams& p, const ActivationTable& a, const float* x,
                     float* out, int64_t N) {
  namespace k = kernels::cpu;
  const int64_t C = config.hidden_size;
  const int64_t E = config.num_experts;
  const int64_t K = config.num_experts_per_tok;
  const int64_t Fe = config.moe_intermediate_size;
  const int64_t Fs = config.shared_expert_intermediate_size;

  // Routed experts.
  k::moe_experts_forward(a.expert_ys, a.expert_gate, a.expert_up, a.expert_act, a.expert_xs,
                         a.expert_offsets, p.experts(), E, C, Fe);
  if (out != nullptr) k::moe_combine_forward(out, a.expert_ys, a.route_weights, a.slot_of, N, K, C);

  // Shared expert: a dense SwiGLU MLP scaled by sigmoid(shared_expert_gate(x)).
  if (Fs == 0) return;
  k::linear_forward(a.gate, x, p.shared_gate_proj, nullptr, N, C, Fs);
  k::linear_forward(a.up, x, p.shared_up_proj, nullptr, N, C, Fs);
  k::swiglu_forward(a.act, a.gate, a.up, N * Fs);
  k::linear_forward(a.shared_out, a.act, p.shared_down_proj, nullptr, N, Fs, C);
  k::linear_forward(a.shared_logit, x, p.shared_expert_gate, nullptr, N, C, 1);
  if (out == nullptr) return;
  for (int64_t n = 0; n < N; ++n) {
    const float s = sigmoid(a.shared_logit[n]);
    for (int64_t c = 0; c < C; ++c) out[n * C + c] += s * a.shared_out[n * C + c];
  }
}

// Parameter gradients accumulate (+=); activation gradients overwrite (=).
void moe_mlp_backward(const ModelConfig& config, const MoeParams& p, const MoeGrads& g,
                      const ActivationTable& a, const float* x, const float* dout,
                      const float* prob_grad, float* dx, int64_t N) {
  namespace k = kernels::cpu;
  const int64_t C = config.hidden_size;
  const int64_t E = config.num_experts;
  const int64_t K = config.num_experts_per_tok;
  const int64_t Fe = config.moe_intermediate_size;
  const int64_t Fs = config.shared_expert_intermediate_size;
  const kernels::RouterConfig rc = config.router_config();

  // Routed experts: combine, experts, permutation, then the router.
  k::moe_combine_backward(a.d_expert_ys, a.d_route_weights, dout, a.expert_ys, a.route_weights,
                          a.slot_of, N, K, C);
  k::moe_experts_backward(a.d_expert_xs, g.experts(), a.d_expert_gate, a.d_expert_up, a.d_expert_act,
                          a.d_expert_ys, a.expert_xs, a.expert_gate, a.expert_up, a.expert_act,
                          a.expert_offsets, p.experts(), E, C, Fe);
  k::moe_gather_backward(dx, a.d_expert_xs, a.slot_of, N, K, C);
  k::moe_route_backward(a.d_router_logits, a.d_route_weights, prob_grad, a.router_probs, a.expert_idx,
                        a.route_weights, N, rc);
  k::linear_backward(a.d_tmp, g.router, nullptr, a.d_router_logits, x, p.router, N, C, E);
  add_inplace(dx, a.d_tmp, N * C);
  if (Fs == 0) return;

  // Shared expert: y = s * shared_out, s = sigmoid(logit). d_tmp holds dL/d shared_out.
  for (int64_t n = 0; n < N; ++n) {
    const float s = sigmoid(a.shared_logit[n]);
    float dot = 0;
    for (int64_t c = 0; c < C; ++c) {
      dot += dout[n * C + c] * a.shared_out[n * C + c];
      a.d_tmp[n * C + c] = s * dout[n * C + c];
    }
    a.d_shared_logit[n] = dot * s * (1.0f - s);
  }
  k::linear_backward(a.d_act, g.shared_down_proj, nullptr, a.d_tmp, a.act, p.shared_down_proj, N, Fs, C);
  k::swiglu_backward(a.d_gate, a.d_up, a.d_act, a.gate, a.up, N * Fs);
  k::linear_backward(a.d_tmp, g.shared_gate_proj, nullptr, a.d_gate, x, p.shared_gate_proj, N, C, Fs);
  add_inplace(dx, a.d_tmp, N * C);
  k::linear_backward(a.d_tmp, g.shared_up_proj, nullptr, a.d_up, x, p.shared_up_proj, N, C, Fs);
  add_inplace(dx, a.d_tmp, N * C);
  k::linear_backward(a.d_tmp, g.shared_expert_gate, nullptr, a.d_shared_logit, x, p.shared_expert_gate,
                     N, C, 1);
  add_inplace(dx, a.d_tmp, N * C);
}

}  // namespace strata::model
