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

// Runs routing, the experts and the shared expert for N tokens of x (N, C). Writes the block's
// output to out (N, C) unless out is null (backward's recomputation needs only the
// intermediates). selection_bias (E) or null: loss-free balancing bias. stats: null to skip.
void moe_mlp_forward(const ModelConfig& config, const MoeParams& p, const float* selection_bias,
                     const ActivationTable& a, const float* x /*(N,C)*/, float* out /*(N,C)*/,
                     const RouterStats* stats, int64_t N);

// Parameter gradients accumulate (+=); activation gradients overwrite (=).
// dx (N, C) = dL/dx from dout (N, C) = dL/d(block output). prob_grad (E) or null: gradient of
// the loss with respect to every token's router softmax (the auxiliary loss). Uses a.d_tmp as
// scratch; REQUIRES: the intermediates of moe_mlp_forward for this x are in a.
void moe_mlp_backward(const ModelConfig& config, const MoeParams& p, const MoeGrads& g,
                      const ActivationTable& a, const float* x /*(N,C)*/,
                      const float* dout /*(N,C)*/, const float* prob_grad /*(E)*/,
                      float* dx /*(N,C)*/, int64_t N);

}  // namespace strata::model
