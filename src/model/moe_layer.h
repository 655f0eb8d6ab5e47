// The mixture-of-experts MLP of a decoder layer, written once over a backend's op set (the Ops
// of model/decoder.h):
//   out = sum_k weight_k * expert_k(x)  [+ sigmoid(shared_expert_gate(x)) * shared_expert(x)]
// with x the post-attention RMSNorm output. Intermediates live in the ActivationTable. The
// router is fp32 on every backend (logits, probabilities, weights and their gradients), so the
// top-k choices do not depend on the activation type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/status.h"

#include "model/activations.h"
#include "model/config.h"
#include "model/params.h"

namespace strata::model {

// Router statistics a forward adds up over its MoE layers (for the auxiliary loss and metrics).
struct RouterStats {
  int64_t* counts = nullptr;    // (E) += assignments per expert
  double* prob_sums = nullptr;  // (E) += sum over tokens of the router softmax
};

// Routes N tokens of x (N, C): router logits, each token's K experts and weights, the
// permutation into expert order (a.expert_offsets: expert e owns rows [offsets[e], offsets[e+1]),
// so an expert with no rows received no token) and the gathered rows. selection_bias (E) or null:
// loss-free balancing bias. stats: null to skip.
template <class Ops>
void moe_route(Ops& ops, const ModelConfig& config, const typename Ops::W* router /*(E,C)*/,
               const float* selection_bias, const ActivationTable<Ops>& a,
               const typename Ops::Act* x /*(N,C)*/, const RouterStats* stats, int64_t N) {
  const int64_t C = config.hidden_size;
  const int64_t E = config.num_experts;
  const int64_t K = config.num_experts_per_tok;
  ops.linear_forward_f32(a.router_logits, x, router, N, C, E);
  ops.moe_route_forward(a.expert_idx, a.route_weights, a.router_probs, a.router_logits, selection_bias, N,
                        config.router_config());
  if (stats != nullptr) ops.moe_router_stats(stats->counts, stats->prob_sums, a.expert_idx, a.router_probs, N, K, E);
  ops.moe_permute(a.slot_of, a.token_of_slot, a.expert_offsets, a.expert_idx, N, K, E);
  ops.moe_gather(a.expert_xs, x, a.token_of_slot, N * K, C);
}

// After moe_route: the experts, the weighted combine and the shared expert. Writes the block's
// output to out (N, C) unless out is null (backward's recomputation needs only the
// intermediates). The tensors of experts without rows are not read and may be null in p.
// experts_done: a.expert_ys already holds the routed experts' outputs (expert parallelism ran
// them on their ranks, model/expert_parallel.h).
template <class Ops>
void moe_mlp_forward(Ops& ops, const ModelConfig& config, const MoeTensors<const typename Ops::W>& p,
                     const ActivationTable<Ops>& a, const typename Ops::Act* x /*(N,C)*/,
                     typename Ops::Act* out /*(N,C)*/, int64_t N, bool experts_done = false) {
  const int64_t C = config.hidden_size;
  const int64_t E = config.num_experts;
  const int64_t K = config.num_experts_per_tok;
  const int64_t Fe = config.moe_intermediate_size;
  const int64_t Fs = config.shared_expert_intermediate_size;

  // Routed experts.
  if (!experts_done)
    ops.moe_experts_forward(a.expert_ys, a.expert_gate, a.expert_up, a.expert_act, a.expert_xs, a.expert_offsets,
                            p.experts(), E, C, Fe);
  if (out != nullptr) ops.moe_combine_forward(out, a.expert_ys, a.route_weights, a.slot_of, N, K, C);

  // Shared expert: a dense SwiGLU MLP scaled by sigmoid(shared_expert_gate(x)).
  if (Fs == 0) return;
  ops.linear_forward(a.gate, x, p.shared_gate_proj, nullptr, N, C, Fs);
  ops.linear_forward(a.up, x, p.shared_up_proj, nullptr, N, C, Fs);
  ops.swiglu_forward(a.act, a.gate, a.up, N * Fs);
  ops.linear_forward(a.shared_out, a.act, p.shared_down_proj, nullptr, N, Fs, C);
  ops.linear_forward_f32(a.shared_logit, x, p.shared_expert_gate, N, C, 1);
  if (out != nullptr) ops.shared_expert_combine(out, a.shared_out, a.shared_logit, N, C);
}

// Parameter gradients accumulate (+=); activation gradients overwrite (=).
// dx (N, C) = dL/dx from dout (N, C) = dL/d(block output). prob_grad (E) or null: gradient of
// the loss with respect to every token's router softmax (the auxiliary loss). Uses a.d_tmp as
// scratch; REQUIRES: the intermediates of moe_route and moe_mlp_forward for this x are in a.
// As in moe_mlp_forward, experts without rows may be null in p and g.
// experts_backward: null to run the routed experts' backward here; else a callable returning
// Status that turns a.d_expert_ys into a.d_expert_xs (and adds the experts' weight gradients)
// elsewhere: expert parallelism's exchange (model/expert_parallel.h), whose errors are returned.
template <class Ops, class ExpertsBackward = std::nullptr_t>
Status moe_mlp_backward(Ops& ops, const ModelConfig& config, const MoeTensors<const typename Ops::W>& p,
                        const MoeTensors<float>& g, const ActivationTable<Ops>& a,
                        const typename Ops::Act* x /*(N,C)*/, const typename Ops::Act* dout /*(N,C)*/,
                        const float* prob_grad /*(E)*/, typename Ops::Act* dx /*(N,C)*/, int64_t N,
                        ExpertsBackward experts_backward = nullptr) {
  const int64_t C = config.hidden_size;
  const int64_t E = config.num_experts;
  const int64_t K = config.num_experts_per_tok;
  const int64_t Fe = config.moe_intermediate_size;
  const int64_t Fs = config.shared_expert_intermediate_size;

  // Routed experts: combine, experts, permutation, then the router.
  ops.moe_combine_backward(a.d_expert_ys, a.d_route_weights, dout, a.expert_ys, a.route_weights, a.slot_of, N, K,
                           C);
  if constexpr (std::is_same_v<ExpertsBackward, std::nullptr_t>) {
    ops.moe_experts_backward(a.d_expert_xs, g.experts(), a.d_expert_gate, a.d_expert_up, a.d_expert_act,
                             a.d_expert_ys, a.expert_xs, a.expert_gate, a.expert_up, a.expert_act, a.expert_offsets,
                             p.experts(), E, C, Fe);
  } else {
    RETURN_IF_ERROR(experts_backward());
  }
  ops.moe_gather_backward(dx, a.d_expert_xs, a.slot_of, N, K, C);
  ops.moe_route_backward(a.d_router_logits, a.d_route_weights, prob_grad, a.router_probs, a.expert_idx,
                         a.route_weights, N, config.router_config());
  ops.linear_backward_f32(a.d_tmp, g.router, a.d_router_logits, x, p.router, N, C, E);
  ops.add_inplace(dx, a.d_tmp, N * C);
  if (Fs == 0) return Status::OK();

  // Shared expert: y = s * shared_out, s = sigmoid(logit). d_tmp holds dL/d shared_out.
  ops.shared_expert_backward(a.d_tmp, a.d_shared_logit, dout, a.shared_out, a.shared_logit, N, C);
  ops.linear_backward(a.d_act, g.shared_down_proj, nullptr, a.d_tmp, a.act, p.shared_down_proj, N, Fs, C);
  ops.swiglu_backward(a.d_gate, a.d_up, a.d_act, a.gate, a.up, N * Fs);
  ops.linear_backward(a.d_tmp, g.shared_gate_proj, nullptr, a.d_gate, x, p.shared_gate_proj, N, C, Fs);
  ops.add_inplace(dx, a.d_tmp, N * C);
  ops.linear_backward(a.d_tmp, g.shared_up_proj, nullptr, a.d_up, x, p.shared_up_proj, N, C, Fs);
  ops.add_inplace(dx, a.d_tmp, N * C);
  ops.linear_backward_f32(a.d_tmp, g.shared_expert_gate, a.d_shared_logit, x, p.shared_expert_gate, N, C, 1);
  ops.add_inplace(dx, a.d_tmp, N * C);
  return Status::OK();
}

}  // namespace strata::model
