// The mixture-of-experts MLP of a decoder layer, written once over a backend's op set (the Ops
// of model/decoder.h):
//   out = sum_k weight_k * expert_k(x)  [+ sigmoid(shared_expert_gate(x)) * shared_expert(x)]
//   (DeepSeek's shared experts are ungated: + shared_experts(x))
// with x the post-attention RMSNorm output. Intermediates live in the ActivationTable. The
// router is fp32 on every backend (logits, probabilities, weights and their gradients), so the
// top-k choices do not depend on the activation type.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <vector>

#include "core/status.h"
#include "kernels/experts_loop.h"

#include "model/activations.h"
#include "model/config.h"
#include "model/params.h"

namespace strata::model {

// Router statistics a forward adds up over its MoE layers (for the auxiliary loss and metrics).
struct RouterStats {
  int64_t* counts = nullptr;    // (E) += assignments per expert
  double* prob_sums = nullptr;  // (E) += sum over tokens of the router softmax
};

// The LoRA adapters (model/lora.h) of an MoE block's projections, applied by whoever owns them
// (the decoder): `forward` adds the adapter of the weight at flat-layout offset `weight` to y
// (n rows), `backward` its dA and dB and its part of dx (dx +=); both do nothing for a weight
// without one. row0: the first row's index among the rows the block computes (dropout's mask).
template <class Ops>
struct MoeAdapters {
  using Act = typename Ops::Act;
  const MoeOffsets* offsets = nullptr;  // the block's tensors, every expert's
  bool experts = false;  // the routed experts carry adapters: they run expert by expert (below)
  std::function<void(int64_t weight, Act* y, const Act* x, int64_t n, int64_t IC, int64_t OC, int64_t row0)> forward;
  std::function<void(int64_t weight, Act* dx, const Act* dy, const Act* x, int64_t n, int64_t IC, int64_t OC,
                     int64_t row0)>
      backward;
};

// Routed experts with adapters run one expert at a time with the dense layers' ops
// (kernels/experts_loop.h, with the adapters as its hook), since the grouped expert ops have no
// place for an adapter. Over rows [row0, row0 + rows) of the expert order, whose expert e owns
// [offsets[e], offsets[e + 1]) (host memory): xs, ys, dxs and dys point at row row0, the
// intermediates (gate .. d_act) are the tile's, row row0 at their start.
template <class Ops>
struct ExpertAdapterHook {
  const MoeAdapters<Ops>& lora;
  int64_t row0;
  typename Ops::Act* dys = nullptr;  // backward: the rows' output gradients, scratch once read
  int64_t hidden = 0;                // C, their width
  typename Ops::Act* scratch(int64_t first) const { return dys + first * hidden; }
  int64_t weight(int64_t e, kernels::looped_experts::Projection p) const {
    const MoeOffsets& o = *lora.offsets;
    const size_t i = static_cast<size_t>(e);
    return p == kernels::looped_experts::Projection::kGate ? o.expert_gate[i]
           : p == kernels::looped_experts::Projection::kUp ? o.expert_up[i]
                                                           : o.expert_down[i];
  }
  template <class Act>
  void forward(int64_t e, kernels::looped_experts::Projection p, Act* y, const Act* x, int64_t n, int64_t IC,
               int64_t OC, int64_t first) const {
    lora.forward(weight(e, p), y, x, n, IC, OC, row0 + first);
  }
  template <class Act>
  void backward(int64_t e, kernels::looped_experts::Projection p, Act* dx, const Act* dy, const Act* x, int64_t n,
                int64_t IC, int64_t OC, int64_t first) const {
    lora.backward(weight(e, p), dx, dy, x, n, IC, OC, row0 + first);
  }
};

// The offsets of rows [row0, row0 + rows) of the expert order counted from row0.
inline std::vector<int64_t> tile_offsets(const int64_t* offsets, int64_t E, int64_t row0, int64_t rows) {
  std::vector<int64_t> t(static_cast<size_t>(E + 1));
  for (int64_t e = 0; e <= E; ++e) t[static_cast<size_t>(e)] = std::clamp(offsets[e] - row0, int64_t{0}, rows);
  return t;
}

template <class Ops>
void moe_experts_forward_looped(Ops& ops, const ModelConfig& config,
                                const kernels::ExpertTensors<const typename Ops::W>& w, const MoeAdapters<Ops>& lora,
                                typename Ops::Act* ys, typename Ops::Act* gate, typename Ops::Act* up,
                                typename Ops::Act* act, const typename Ops::Act* xs, const int64_t* offsets,
                                int64_t row0, int64_t rows) {
  const int64_t E = config.num_experts;
  const std::vector<int64_t> t = tile_offsets(offsets, E, row0, rows);
  kernels::looped_experts::forward(ops, ys, gate, up, act, xs, t.data(), w, E, config.hidden_size,
                                   config.moe_intermediate_size, ExpertAdapterHook<Ops>{lora, row0});
}

// Its backward (the same rows and buffers, holding the forward's intermediates): dxs = dL/dxs,
// the weight gradients += (frozen weights' are null and skipped), the adapters' likewise. On an
// op set without accumulate_data_grad, dys is scratch afterwards (kernels/experts_loop.h).
template <class Ops>
void moe_experts_backward_looped(Ops& ops, const ModelConfig& config,
                                 const kernels::ExpertTensors<const typename Ops::W>& w,
                                 const kernels::ExpertTensors<float>& dw, const MoeAdapters<Ops>& lora,
                                 typename Ops::Act* dxs, typename Ops::Act* d_gate, typename Ops::Act* d_up,
                                 typename Ops::Act* d_act, typename Ops::Act* dys, const typename Ops::Act* xs,
                                 const typename Ops::Act* gate, const typename Ops::Act* up,
                                 const typename Ops::Act* act, const int64_t* offsets, int64_t row0, int64_t rows) {
  const int64_t E = config.num_experts;
  const std::vector<int64_t> t = tile_offsets(offsets, E, row0, rows);
  kernels::looped_experts::backward(ops, dxs, dw, d_gate, d_up, d_act, dys, xs, gate, up, act, t.data(), w, E,
                                    config.hidden_size, config.moe_intermediate_size,
                                    ExpertAdapterHook<Ops>{lora, row0, dys, config.hidden_size});
}

// The row offsets of the expert order where the host reads them (a copy: a backend may reuse
// its staging buffer).
template <class Ops>
std::vector<int64_t> expert_offsets_copy(Ops& ops, const int64_t* offsets, int64_t E) {
  const int64_t* host = ops.expert_offsets_on_host(offsets, E);
  return std::vector<int64_t>(host, host + E + 1);
}

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

// The routed experts' forward over the expert order's rows: all at once into a's intermediates,
// or, when `t` (the table holding the shared tile buffers) plans them in tiles, tile by tile into
// t's, each tile's gate, up and act overwriting the last's. Either way a.expert_ys gets every row.
template <class Ops>
void moe_experts_forward_rows(Ops& ops, const ModelConfig& config, const kernels::ExpertTensors<const typename Ops::W>& w,
                              const ActivationTable<Ops>& a, const ActivationTable<Ops>& t, int64_t N,
                              const MoeAdapters<Ops>* lora = nullptr) {
  const int64_t C = config.hidden_size;
  const int64_t E = config.num_experts;
  const int64_t Fe = config.moe_intermediate_size;
  if (lora != nullptr && lora->experts) {
    const std::vector<int64_t> offsets = expert_offsets_copy(ops, a.expert_offsets, E);
    const int64_t S = N * config.num_experts_per_tok, tile = t.experts_tiled() ? t.expert_rows() : S;
    const ActivationTable<Ops>& m = t.experts_tiled() ? t : a;
    for (int64_t r0 = 0; r0 < S; r0 += tile) {
      moe_experts_forward_looped(ops, config, w, *lora, a.expert_ys + r0 * C, m.expert_gate, m.expert_up,
                                 m.expert_act, a.expert_xs + r0 * C, offsets.data(), r0, std::min(tile, S - r0));
    }
    return;
  }
  if (!t.experts_tiled()) {
    ops.moe_experts_forward(a.expert_ys, a.expert_gate, a.expert_up, a.expert_act, a.expert_xs, a.expert_offsets, w,
                            E, C, Fe);
    return;
  }
  const int64_t S = N * config.num_experts_per_tok, tile = t.expert_rows();
  for (int64_t r0 = 0; r0 < S; r0 += tile) {
    const int64_t n = std::min(tile, S - r0);
    ops.moe_tile_offsets(t.expert_tile_offsets, a.expert_offsets, E, r0, n);
    ops.moe_experts_forward(a.expert_ys + r0 * C, t.expert_gate, t.expert_up, t.expert_act, a.expert_xs + r0 * C,
                            t.expert_tile_offsets, w, E, C, Fe);
  }
}

// The shared expert's gate, up and act of n rows x (the first, row0 of the block's) into m's.
template <class Ops>
void shared_expert_tile_forward(Ops& ops, const ModelConfig& config, const MoeTensors<const typename Ops::W>& p,
                                const ActivationTable<Ops>& m, const typename Ops::Act* x, int64_t n, int64_t row0,
                                const MoeAdapters<Ops>* lora) {
  const int64_t C = config.hidden_size;
  const int64_t Fs = config.shared_expert_intermediate_size;
  ops.linear_forward(m.gate, x, p.shared_gate_proj, nullptr, n, C, Fs);
  if (lora != nullptr) lora->forward(lora->offsets->shared_gate_proj, m.gate, x, n, C, Fs, row0);
  ops.linear_forward(m.up, x, p.shared_up_proj, nullptr, n, C, Fs);
  if (lora != nullptr) lora->forward(lora->offsets->shared_up_proj, m.up, x, n, C, Fs, row0);
  ops.swiglu_forward(m.act, m.gate, m.up, n * Fs);
}

// After moe_route: the experts, the weighted combine and the shared expert. Writes the block's
// output to out (N, C) unless out is null (backward's recomputation needs only the
// intermediates). The tensors of experts without rows are not read and may be null in p.
// experts_done: a.expert_ys already holds the routed experts' outputs (expert parallelism ran
// them on their ranks, model/expert_parallel.h). t: the table with the shared buffers (a itself,
// or the decoder's when a is a kept layer's view): when it plans the MLP in tiles (mlp_tiled,
// experts_tiled) the experts and the shared expert run tile by tile in its buffers, which keep
// nothing for backward (moe_mlp_backward recomputes each tile), and out is the same bits.
template <class Ops>
void moe_mlp_forward(Ops& ops, const ModelConfig& config, const MoeTensors<const typename Ops::W>& p,
                     const ActivationTable<Ops>& a, const ActivationTable<Ops>& t, const typename Ops::Act* x /*(N,C)*/,
                     typename Ops::Act* out /*(N,C)*/, int64_t N, bool experts_done = false,
                     const MoeAdapters<Ops>* lora = nullptr) {
  const int64_t C = config.hidden_size;
  const int64_t K = config.num_experts_per_tok;
  const int64_t Fs = config.shared_expert_intermediate_size;

  // Routed experts.
  if (!experts_done) moe_experts_forward_rows(ops, config, p.experts(), a, t, N, lora);
  if (out != nullptr) ops.moe_combine_forward(out, a.expert_ys, a.route_weights, a.slot_of, N, K, C);

  // Shared expert: a dense SwiGLU MLP scaled by sigmoid(shared_expert_gate(x)).
  if (Fs == 0) return;
  const ActivationTable<Ops>& m = t.mlp_tiled() ? t : a;  // where gate .. act live
  const int64_t tile = t.mlp_tiled() ? t.mlp_rows() : N;
  for (int64_t r0 = 0; r0 < N; r0 += tile) {
    const int64_t n = std::min(tile, N - r0);
    shared_expert_tile_forward(ops, config, p, m, x + r0 * C, n, r0, lora);
    ops.linear_forward(a.shared_out + r0 * C, m.act, p.shared_down_proj, nullptr, n, Fs, C);
    if (lora != nullptr) lora->forward(lora->offsets->shared_down_proj, a.shared_out + r0 * C, m.act, n, Fs, C, r0);
  }
  if (!config.shared_expert_gated) {
    // DeepSeek's shared experts add to the routed ones ungated.
    if (out != nullptr) ops.add_inplace(out, a.shared_out, N * C);
    return;
  }
  ops.linear_forward_f32(a.shared_logit, x, p.shared_expert_gate, N, C, 1);
  if (out != nullptr) ops.shared_expert_combine(out, a.shared_out, a.shared_logit, N, C);
}

// Parameter gradients accumulate (+=); activation gradients overwrite (=).
// dx (N, C) = dL/dx from dout (N, C) = dL/d(block output). prob_grad (E) or null: gradient of
// the loss with respect to every token's router softmax (the auxiliary loss). Uses a.d_tmp as
// scratch; REQUIRES: the intermediates of moe_route and moe_mlp_forward for this x are in a (in
// t's tile buffers, those of the last tile only, which the tiled backward recomputes anyway).
// As in moe_mlp_forward, experts without rows may be null in p and g.
// experts_backward: null to run the routed experts' backward here; else a callable returning
// Status that turns a.d_expert_ys into a.d_expert_xs (and adds the experts' weight gradients)
// elsewhere: expert parallelism's exchange (model/expert_parallel.h), whose errors are returned.
// t: as for moe_mlp_forward; tiled, each tile's intermediates are recomputed before its backward,
// the activation gradients are the same bits and the weight gradients add up tile by tile.
template <class Ops, class ExpertsBackward = std::nullptr_t>
Status moe_mlp_backward(Ops& ops, const ModelConfig& config, const MoeTensors<const typename Ops::W>& p,
                        const MoeTensors<float>& g, const ActivationTable<Ops>& a, const ActivationTable<Ops>& t,
                        const typename Ops::Act* x /*(N,C)*/, const typename Ops::Act* dout /*(N,C)*/,
                        const float* prob_grad /*(E)*/, typename Ops::Act* dx /*(N,C)*/, int64_t N,
                        const MoeAdapters<Ops>* lora = nullptr, ExpertsBackward experts_backward = nullptr) {
  const int64_t C = config.hidden_size;
  const int64_t E = config.num_experts;
  const int64_t K = config.num_experts_per_tok;
  const int64_t Fe = config.moe_intermediate_size;
  const int64_t Fs = config.shared_expert_intermediate_size;

  // Routed experts: combine, experts, permutation, then the router.
  ops.moe_combine_backward(a.d_expert_ys, a.d_route_weights, dout, a.expert_ys, a.route_weights, a.slot_of, N, K,
                           C);
  if constexpr (std::is_same_v<ExpertsBackward, std::nullptr_t>) {
    if (lora != nullptr && lora->experts) {
      // Expert by expert (moe_experts_forward_looped), each tile's intermediates recomputed first.
      const std::vector<int64_t> offsets = expert_offsets_copy(ops, a.expert_offsets, E);
      const bool tiled = t.experts_tiled();
      const int64_t S = N * K, tile = tiled ? t.expert_rows() : S;
      const ActivationTable<Ops>& m = tiled ? t : a;
      for (int64_t r0 = 0; r0 < S; r0 += tile) {
        const int64_t n = std::min(tile, S - r0);
        if (tiled) {
          moe_experts_forward_looped(ops, config, p.experts(), *lora, a.expert_ys + r0 * C, m.expert_gate,
                                     m.expert_up, m.expert_act, a.expert_xs + r0 * C, offsets.data(), r0, n);
        }
        moe_experts_backward_looped(ops, config, p.experts(), g.experts(), *lora, a.d_expert_xs + r0 * C,
                                    m.d_expert_gate, m.d_expert_up, m.d_expert_act, a.d_expert_ys + r0 * C,
                                    a.expert_xs + r0 * C, m.expert_gate, m.expert_up, m.expert_act, offsets.data(),
                                    r0, n);
      }
    } else if (!t.experts_tiled()) {
      ops.moe_experts_backward(a.d_expert_xs, g.experts(), a.d_expert_gate, a.d_expert_up, a.d_expert_act,
                               a.d_expert_ys, a.expert_xs, a.expert_gate, a.expert_up, a.expert_act,
                               a.expert_offsets, p.experts(), E, C, Fe);
    } else {
      const int64_t S = N * K, tile = t.expert_rows();
      for (int64_t r0 = 0; r0 < S; r0 += tile) {
        const int64_t n = std::min(tile, S - r0);
        // The tile's gate, up and act again (its rows of expert_ys are rewritten with the bits
        // they hold), then its backward.
        ops.moe_tile_offsets(t.expert_tile_offsets, a.expert_offsets, E, r0, n);
        ops.moe_experts_forward(a.expert_ys + r0 * C, t.expert_gate, t.expert_up, t.expert_act,
                                a.expert_xs + r0 * C, t.expert_tile_offsets, p.experts(), E, C, Fe);
        ops.moe_experts_backward(a.d_expert_xs + r0 * C, g.experts(), t.d_expert_gate, t.d_expert_up,
                                 t.d_expert_act, a.d_expert_ys + r0 * C, a.expert_xs + r0 * C, t.expert_gate,
                                 t.expert_up, t.expert_act, t.expert_tile_offsets, p.experts(), E, C, Fe);
      }
    }
  } else {
    RETURN_IF_ERROR(experts_backward());
  }
  ops.moe_gather_backward(dx, a.d_expert_xs, a.slot_of, N, K, C);
  ops.moe_route_backward(a.d_router_logits, a.d_route_weights, prob_grad, a.router_probs, a.expert_idx,
                         a.route_weights, N, config.router_config());
  ops.linear_backward_f32(a.d_tmp, g.router, a.d_router_logits, x, p.router, N, C, E);
  ops.add_inplace(dx, a.d_tmp, N * C);
  if (Fs == 0) return Status::OK();

  // Shared expert: y = s * shared_out, s = sigmoid(logit). d_tmp holds dL/d shared_out, each tile's
  // rows of it free once the tile's d_act is made (the tile's input gradients go there).
  // Ungated (DeepSeek), dL/d shared_out is dout itself.
  const bool gated = config.shared_expert_gated;
  if (gated) ops.shared_expert_backward(a.d_tmp, a.d_shared_logit, dout, a.shared_out, a.shared_logit, N, C);
  const typename Ops::Act* dshared = gated ? a.d_tmp : dout;
  const bool tiled = t.mlp_tiled();
  const ActivationTable<Ops>& m = tiled ? t : a;  // where gate .. act and their gradients live
  const int64_t tile = tiled ? t.mlp_rows() : N;
  for (int64_t r0 = 0; r0 < N; r0 += tile) {
    const int64_t n = std::min(tile, N - r0);
    const typename Ops::Act* xt = x + r0 * C;
    typename Ops::Act* d = a.d_tmp + r0 * C;
    if (tiled) shared_expert_tile_forward(ops, config, p, m, xt, n, r0, lora);
    ops.linear_backward(m.d_act, g.shared_down_proj, nullptr, dshared + r0 * C, m.act, p.shared_down_proj, n, Fs, C);
    if (lora != nullptr)
      lora->backward(lora->offsets->shared_down_proj, m.d_act, dshared + r0 * C, m.act, n, Fs, C, r0);
    ops.swiglu_backward(m.d_gate, m.d_up, m.d_act, m.gate, m.up, n * Fs);
    ops.linear_backward(d, g.shared_gate_proj, nullptr, m.d_gate, xt, p.shared_gate_proj, n, C, Fs);
    if (lora != nullptr) lora->backward(lora->offsets->shared_gate_proj, d, m.d_gate, xt, n, C, Fs, r0);
    ops.add_inplace(dx + r0 * C, d, n * C);
    ops.linear_backward(d, g.shared_up_proj, nullptr, m.d_up, xt, p.shared_up_proj, n, C, Fs);
    if (lora != nullptr) lora->backward(lora->offsets->shared_up_proj, d, m.d_up, xt, n, C, Fs, r0);
    ops.add_inplace(dx + r0 * C, d, n * C);
  }
  if (!gated) return Status::OK();
  ops.linear_backward_f32(a.d_tmp, g.shared_expert_gate, a.d_shared_logit, x, p.shared_expert_gate, N, C, 1);
  ops.add_inplace(dx, a.d_tmp, N * C);
  return Status::OK();
}

}  // namespace strata::model
