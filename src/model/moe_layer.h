// The mixture-of-experts MLP of a decoder layer on the CPU backend, composed from the kernels in
// kernels/moe.h:
//   out = sum_k weight_k * expert_k(x)  [+ sigmoid(shared_expert_gate(x)) * shared_expert(x)]
// with x the post-attention RMSNorm output. Intermediates live in the ActivationTable.
#pragma once

#include <cstdint>

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
void moe_route(const ModelConfig& config, const float* router /*(E,C)*/, const float* selection_bias,
               const ActivationTable& a, const float* x /*(N,C)*/, const RouterStats* stats, int64_t N);

// After moe_route: the experts, the weighted combine and the shared expert. Writes the block's
// output to out (N, C) unless out is null (backward's recomputation needs only the
// intermediates). The tensors of experts without rows are not read and may be null in p.
void moe_mlp_forward(const ModelConfig& config, const MoeParams& p, const ActivationTable& a,
                     const float* x /*(N,C)*/, float* out /*(N,C)*/, int64_t N);

// Parameter gradients accumulate (+=); activation gradients overwrite (=).
// dx (N, C) = dL/dx from dout (N, C) = dL/d(block output). prob_grad (E) or null: gradient of
// the loss with respect to every token's router softmax (the auxiliary loss). Uses a.d_tmp as
// scratch; REQUIRES: the intermediates of moe_route and moe_mlp_forward for this x are in a.
// As in moe_mlp_forward, experts without rows may be null in p and g.
void moe_mlp_backward(const ModelConfig& config, const MoeParams& p, const MoeGrads& g,
                      const ActivationTable& a, const float* x /*(N,C)*/,
                      const float* dout /*(N,C)*/, const float* prob_grad /*(E)*/,
                      float* dx /*(N,C)*/, int64_t N);

}  // namespace strata::model
