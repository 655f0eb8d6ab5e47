// Mixture-of-experts ops: routing, token permutation to experts, the experts' SwiGLU MLPs as a
// grouped GEMM, the weighted combine back, and the load-balancing statistics.
//
// One MoE block over N tokens of width C with E experts, K of them per token:
//   logits (N,E) = x @ router^T                     (linear_forward)
//   expert_idx, weights (N,K) = route(logits)       (moe_route_forward)
//   slot_of, token_of_slot, expert_offsets          (moe_permute: order by expert, then token)
//   xs (N*K,C) = x[token_of_slot]                   (moe_gather)
//   ys (N*K,C) = down_e(silu(gate_e(xs)) * up_e(xs)) for the rows of each expert e
//   out (N,C) = sum_k weights[n,k] * ys[slot_of[n,k]]  (moe_combine_forward)
// The K choices of a token are in descending order of their selection score (as torch.topk
// returns them); ties go to the lower expert index.
//
// Auxiliary load-balancing loss (Switch Transformer; transformers' load_balancing_loss_func):
//   aux = E * sum_e f_e * P_e,  f_e = (assignments to e) / tokens,  P_e = mean_n probs[n, e]
// where an "assignment" is one of a token's K choices (so sum_e f_e = K) and probs is the
// softmax over all experts. transformers concatenates the router logits of every MoE layer of a
// forward before computing f and P, so the counts and sums below accumulate across layers.
//
// Loss-free balancing (DeepSeek-V3): a per-expert bias is added to the selection scores only
// (never to the weights) and moved after each step by rate * sign(mean load - load_e).
#pragma once
#include <cstdint>

namespace strata::kernels {

enum class RouterScoring : uint8_t {
  // Mixtral: the K largest logits, then a softmax over those K.
  kTopKThenSoftmax,
  // Qwen2-MoE / Qwen3-MoE / DeepSeek-V2: softmax over all E experts, then the K largest
  // probabilities, divided by their sum when normalize_top_k.
  kSoftmaxThenTopK,
  // DeepSeek-V3: each expert's score is sigmoid(logit), independently of the others; the K
  // largest are chosen and weighted by their scores, divided by their sum when normalize_top_k.
  kSigmoidThenTopK,
};

// Group-limited routing (DeepSeek-V2's group_limited_greedy, V3's noaux_tc): the E experts form
// num_groups equal groups of consecutive indices; each group is scored from its experts'
// selection scores, the top_groups best groups are kept (ties to the lower group), and the K
// experts are chosen among theirs only. The weights are untouched by it.
enum class GroupScore : uint8_t {
  kMax,        // the group's largest selection score (V2)
  kTopTwoSum,  // the sum of its two largest selection scores (V3; groups of at least 2)
};

struct RouterConfig {
  int64_t num_experts = 0;  // E
  int64_t top_k = 0;        // K, 1 <= K <= E
  RouterScoring scoring = RouterScoring::kTopKThenSoftmax;
  bool normalize_top_k = false;  // kSoftmaxThenTopK and kSigmoidThenTopK
  // Groups: 1 (no limiting), else a divisor of E with top_groups in [1, num_groups] whose
  // experts number at least K. Not with kTopKThenSoftmax.
  int64_t num_groups = 1;
  int64_t top_groups = 1;
  GroupScore group_score = GroupScore::kMax;
  // Every routing weight is multiplied by it after any normalisation (DeepSeek's
  // routed_scaling_factor as V3 applies it). DeepSeek-V2 applies its factor only when it does not
  // normalise: a V2 config with norm_topk_prob maps to 1. Not with kTopKThenSoftmax, whose
  // weights sum to 1 by definition.
  float scale = 1.0f;
};

// Whether c is a routing strata computes (the rules above); the reason when it is not.
bool router_config_ok(const RouterConfig& c, const char** why = nullptr);

// The experts' weights, one pointer per expert (E entries each): the Hugging Face tensors are
// separate, so they need not be contiguous. T = const float for weights, float for gradients.
template <typename T>
struct ExpertTensors {
  T* const* gate;  // E x (F, C)
  T* const* up;    // E x (F, C)
  T* const* down;  // E x (C, F)
};

#define STRATA_MOE_OPS                                                                            \
  /* probs (N,E) = softmax(logits) over all experts, or sigmoid(logits) for kSigmoidThenTopK   \
     (kept for backward and the aux loss). Selection uses logits (kTopKThenSoftmax) or probs    \
     (the others), plus selection_bias when it is not null, within the chosen groups.           \
     expert_idx, weights (N,K) are overwritten. */                                               \
  void moe_route_forward(int32_t* expert_idx /*(N,K)*/, float* weights /*(N,K)*/,                 \
                         float* probs /*(N,E)*/, const float* logits /*(N,E)*/,                   \
                         const float* selection_bias /*(E) or null*/, int64_t N,                  \
                         const RouterConfig& config);                                             \
  /* dlogits (N,E) = gradient through the routing weights plus, when prob_grad is not null,     \
     through probs with dL/dprobs[n,e] = prob_grad[e] for every token (the aux loss). The      \
     top-k selection itself is piecewise constant and has no gradient. */                         \
  void moe_route_backward(float* dlogits /*(N,E)*/, const float* dweights /*(N,K)*/,              \
                          const float* prob_grad /*(E) or null*/, const float* probs /*(N,E)*/,   \
                          const int32_t* expert_idx /*(N,K)*/, const float* weights /*(N,K)*/,    \
                          int64_t N, const RouterConfig& config);                                 \
  /* Stable counting sort of the N*K assignments by expert: expert e owns slots               \
     [expert_offsets[e], expert_offsets[e+1]), filled in (token, k) order. All overwritten. */  \
  void moe_permute(int32_t* slot_of /*(N,K)*/, int32_t* token_of_slot /*(N*K)*/,                  \
                   int64_t* expert_offsets /*(E+1)*/, const int32_t* expert_idx /*(N,K)*/,        \
                   int64_t N, int64_t K, int64_t E);                                              \
  /* xs[s] = x[token_of_slot[s]] */                                                               \
  void moe_gather(float* xs /*(S,C)*/, const float* x /*(N,C)*/,                                  \
                  const int32_t* token_of_slot /*(S)*/, int64_t S, int64_t C);                    \
  /* dx (N,C) = sum_k dxs[slot_of[n,k]] (overwritten) */                                          \
  void moe_gather_backward(float* dx /*(N,C)*/, const float* dxs /*(N*K,C)*/,                     \
                           const int32_t* slot_of /*(N,K)*/, int64_t N, int64_t K, int64_t C);    \
  /* out (N,C) = sum_k weights[n,k] * ys[slot_of[n,k]] (overwritten) */                           \
  void moe_combine_forward(float* out /*(N,C)*/, const float* ys /*(N*K,C)*/,                     \
                           const float* weights /*(N,K)*/, const int32_t* slot_of /*(N,K)*/,      \
                           int64_t N, int64_t K, int64_t C);                                      \
  /* dys (N*K,C) =, dweights (N,K) = */                                                           \
  void moe_combine_backward(float* dys /*(N*K,C)*/, float* dweights /*(N,K)*/,                    \
                            const float* dout /*(N,C)*/, const float* ys /*(N*K,C)*/,             \
                            const float* weights /*(N,K)*/, const int32_t* slot_of /*(N,K)*/,     \
                            int64_t N, int64_t K, int64_t C);                                     \
  /* For each expert e over its rows [offsets[e], offsets[e+1]) of xs (S = offsets[E] rows):    \
     gate = xs @ W_gate^T, up = xs @ W_up^T, act = silu(gate) * up, ys = act @ W_down^T.       \
     gate, up, act are kept for backward. Experts with no rows are skipped. */                    \
  void moe_experts_forward(float* ys /*(S,C)*/, float* gate /*(S,F)*/, float* up /*(S,F)*/,       \
                           float* act /*(S,F)*/, const float* xs /*(S,C)*/,                       \
                           const int64_t* expert_offsets /*(E+1)*/,                               \
                           const ExpertTensors<const float>& w, int64_t E, int64_t C, int64_t F); \
  /* dxs (S,C) =; dw.gate/up/down += ; dgate, dup, dact (S,F) are scratch (overwritten). */       \
  void moe_experts_backward(float* dxs /*(S,C)*/, const ExpertTensors<float>& dw,                 \
                            float* dgate /*(S,F)*/, float* dup /*(S,F)*/, float* dact /*(S,F)*/,  \
                            const float* dys /*(S,C)*/, const float* xs /*(S,C)*/,                \
                            const float* gate /*(S,F)*/, const float* up /*(S,F)*/,               \
                            const float* act /*(S,F)*/, const int64_t* expert_offsets /*(E+1)*/,  \
                            const ExpertTensors<const float>& w, int64_t E, int64_t C, int64_t F);\
  /* Load-balancing statistics of one layer, added to running totals: counts[e] += number of    \
     assignments to e; prob_sums[e] += sum_n probs[n,e]. */                                        \
  void moe_router_stats(int64_t* counts /*(E)*/, double* prob_sums /*(E)*/,                       \
                        const int32_t* expert_idx /*(N,K)*/, const float* probs /*(N,E)*/,        \
                        int64_t N, int64_t K, int64_t E);
namespace ref { STRATA_MOE_OPS }
namespace cpu { STRATA_MOE_OPS }
#undef STRATA_MOE_OPS

// aux = E * sum_e (counts[e] / tokens) * (prob_sums[e] / tokens), tokens = routed tokens summed
// over the layers that produced the statistics (each token counted once per layer).
double moe_aux_loss(const int64_t* counts /*(E)*/, const double* prob_sums /*(E)*/, int64_t tokens,
                    int64_t E);
// prob_grad (E) = scale * d aux / d probs[n, e] = scale * E * counts[e] / tokens^2, the same for
// every token of every layer (f_e is piecewise constant).
void moe_aux_loss_prob_grad(float* prob_grad /*(E)*/, const int64_t* counts /*(E)*/, int64_t tokens,
                            int64_t E, double scale);
// One tile of the expert order, rows [row0, row0 + rows) of the S rows moe_permute ordered:
// tile_offsets[e] = clamp(expert_offsets[e] - row0, 0, rows) for e in [0, E], so that the
// experts' ops, given the tile's rows of xs and ys and buffers of `rows` rows, run each expert
// over its rows within the tile (an expert spanning tiles runs in each). Both arrays (E+1).
void moe_tile_offsets(int64_t* tile_offsets, const int64_t* expert_offsets, int64_t E, int64_t row0, int64_t rows);
// Loss-free balancing update: bias[e] += rate * sign(mean_e(counts) - counts[e]).
void moe_update_selection_bias(float* bias /*(E)*/, const int64_t* counts /*(E)*/, int64_t E,
                               float rate);

}  // namespace strata::kernels
