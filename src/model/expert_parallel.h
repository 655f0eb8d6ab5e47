// Expert parallelism (DESIGN §3.5): the routed experts of every MoE layer are split over the P
// ranks of an expert group, rank p holding experts [p * E/P, (p + 1) * E/P) (expert_range). Each
// rank routes its own tokens as one process would; the rows it routed are then sent to the ranks
// of their experts with one all-to-all, the experts run over every row they received, and the
// outputs come back the same way (combine). Backward moves the output gradients to the experts
// and the input gradients back alike. Everything else (attention, the router, the shared expert)
// stays on the rank's own tokens.
//
// The exchange of one MoE layer, after moe_route:
//   1. every rank's rows per expert, all-gathered (P x E counts), so each rank knows what it
//      sends and receives and sizes every all-to-all alike (ep_plan);
//   2. dispatch: a.expert_xs (in expert order, so each rank's experts are one run of rows) to the
//      experts' ranks. What arrives is in the order (source rank, expert); ep_order permutes it
//      into expert order (expert, source rank) for the grouped expert GEMMs;
//   3. the local experts over ep_xs into ep_ys, ep_unorder back to the order of arrival, and the
//      reverse all-to-all into a.expert_ys, where the combine finds each row as without
//      expert parallelism.
// A rank that routed no row to some rank, or received none, still takes part in every collective
// with empty blocks: every rank calls the same operations, in the same order.
//
// Results: an expert's rows are the same rows one process would give it (for the same tokens),
// but they reach its GEMMs as one batch of every rank's rows, so its outputs and weight gradients
// sum in another order than a process that ran those ranks' micro-batches one after another:
// equal within rounding, not bitwise.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "model/activations.h"
#include "model/config.h"
#include "model/moe_layer.h"
#include "parallel/comm.h"

namespace strata::model {

// The experts rank `rank` of an expert group of `ranks` holds: [first, first + count).
// REQUIRES: ranks divides num_experts.
struct ExpertRange {
  int64_t first = 0;
  int64_t count = 0;
  bool holds(int64_t e) const { return e >= first && e < first + count; }
};
inline ExpertRange expert_range(int64_t num_experts, int64_t ranks, int64_t rank) {
  const int64_t per = num_experts / ranks;
  return {rank * per, per};
}

// One MoE layer's exchange as ep_plan computed it (host memory), kept for the layer's backward.
struct ExpertRoute {
  std::vector<int64_t> rows;        // (P, E): rows[q * E + e] rows rank q routed to expert e
  std::vector<size_t> send_bytes;   // (P) bytes of rows this rank sends to each rank
  std::vector<size_t> recv_bytes;   // (P) bytes of rows it receives from each
  std::vector<int32_t> order;       // (R) ep_order's values
  std::vector<int32_t> unorder;     // (R) ep_unorder's values
  std::vector<int64_t> offsets;     // (E + 1) row offsets into ep_xs: only the local experts own rows
  int64_t received = 0;             // R: rows this rank's experts received
  // The local experts with at least one row, ascending (what the access begins).
  std::vector<int> active;
  // Where the ops read order, unorder and offsets: a's ep_* slots, or these vectors themselves
  // on a backend whose ops read host memory in the caller (stage_tokens/stage_offsets).
  const int32_t* order_at = nullptr;
  const int32_t* unorder_at = nullptr;
  const int64_t* offsets_at = nullptr;
};

// Step 1: all-gathers every rank's rows per expert over `comm` (the expert group) and plans the
// exchange into `route`; stages the permutations and offsets into a's ep_* buffers on the ops'
// stream. `expert_offsets` (E + 1) are this rank's routing's, on the host.
template <class Ops>
Status ep_plan(Ops& ops, parallel::Comm& comm, const ModelConfig& config, const ActivationTable<Ops>& a,
               const int64_t* expert_offsets, ExpertRoute& route) {
  const int64_t E = config.num_experts;
  const int64_t C = config.hidden_size;
  const int64_t P = comm.world_size();
  const int64_t me = comm.rank();
  const uint64_t row_bytes = static_cast<uint64_t>(C) * sizeof(typename Ops::Act);
  std::vector<int64_t> mine(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) mine[static_cast<size_t>(e)] = expert_offsets[e + 1] - expert_offsets[e];
  route.rows.assign(static_cast<size_t>(P * E), 0);
  RETURN_IF_ERROR(comm.all_gather(mine.data(), route.rows.data(), mine.size() * sizeof(int64_t))
                      .with_context("sharing the routed rows per expert of the expert group"));
  auto rows = [&](int64_t q, int64_t e) { return route.rows[static_cast<size_t>(q * E + e)]; };
  const ExpertRange local = expert_range(E, P, me);
  route.send_bytes.assign(static_cast<size_t>(P), 0);
  route.recv_bytes.assign(static_cast<size_t>(P), 0);
  std::vector<int64_t> arrival_start(static_cast<size_t>(P + 1), 0);  // first arrival row of each source
  for (int64_t q = 0; q < P; ++q) {
    const ExpertRange theirs = expert_range(E, P, q);
    int64_t to_q = 0, from_q = 0;
    for (int64_t e = theirs.first; e < theirs.first + theirs.count; ++e) to_q += rows(me, e);
    for (int64_t e = local.first; e < local.first + local.count; ++e) from_q += rows(q, e);
    route.send_bytes[static_cast<size_t>(q)] = static_cast<size_t>(to_q) * row_bytes;
    route.recv_bytes[static_cast<size_t>(q)] = static_cast<size_t>(from_q) * row_bytes;
    arrival_start[static_cast<size_t>(q + 1)] = arrival_start[static_cast<size_t>(q)] + from_q;
  }
  route.received = arrival_start[static_cast<size_t>(P)];
  // Expert order: expert by expert, each expert's rows by source rank. Within a source's block,
  // its rows for expert e follow its rows for the local experts before e.
  route.order.resize(static_cast<size_t>(route.received));
  route.unorder.resize(static_cast<size_t>(route.received));
  route.offsets.assign(static_cast<size_t>(E + 1), 0);
  route.active.clear();
  std::vector<int64_t> seen(static_cast<size_t>(P), 0);  // arrival rows of each source placed so far
  int64_t i = 0;
  for (int64_t e = 0; e < E; ++e) {
    route.offsets[static_cast<size_t>(e)] = i;
    if (!local.holds(e)) continue;
    for (int64_t q = 0; q < P; ++q) {
      const int64_t n = rows(q, e);
      const int64_t start = arrival_start[static_cast<size_t>(q)] + seen[static_cast<size_t>(q)];
      for (int64_t j = 0; j < n; ++j, ++i) {
        route.order[static_cast<size_t>(i)] = static_cast<int32_t>(start + j);
        route.unorder[static_cast<size_t>(start + j)] = static_cast<int32_t>(i);
      }
      seen[static_cast<size_t>(q)] += n;
    }
    if (i > route.offsets[static_cast<size_t>(e)]) route.active.push_back(static_cast<int>(e));
  }
  route.offsets[static_cast<size_t>(E)] = i;
  route.order_at = route.unorder_at = nullptr;
  if (route.received > 0) {
    route.order_at = ops.stage_tokens(route.order.data(), route.received, a.ep_order);
    route.unorder_at = ops.stage_tokens(route.unorder.data(), route.received, a.ep_unorder);
  }
  route.offsets_at = ops.stage_offsets(route.offsets.data(), E + 1, a.ep_offsets);
  return Status::OK();
}

// Steps 2 and 3: the routed experts' forward over every rank's rows for the local experts, their
// outputs back in a.expert_ys. `w` holds the local experts with rows (route.active); the others
// may be null.
template <class Ops, class Weights>
Status ep_experts_forward(Ops& ops, parallel::Comm& comm, const ModelConfig& config, const Weights& w,
                          const ActivationTable<Ops>& a, const ExpertRoute& route,
                          const MoeAdapters<Ops>* lora = nullptr) {
  const int64_t E = config.num_experts;
  const int64_t C = config.hidden_size;
  const int64_t Fe = config.moe_intermediate_size;
  Stream* stream = ops.compute_stream();
  RETURN_IF_ERROR(comm.all_to_all_v(a.expert_xs, route.send_bytes, a.ep_arrival, route.recv_bytes, stream)
                      .with_context("sending routed tokens to their experts' ranks"));
  const int64_t R = route.received;
  if (R > 0) {
    ops.moe_gather(a.ep_xs, a.ep_arrival, route.order_at, R, C);
    if (lora != nullptr && lora->experts) {
      moe_experts_forward_looped(ops, config, w, *lora, a.ep_ys, a.expert_gate, a.expert_up, a.expert_act, a.ep_xs,
                                 route.offsets.data(), 0, R);
    } else {
      ops.moe_experts_forward(a.ep_ys, a.expert_gate, a.expert_up, a.expert_act, a.ep_xs, route.offsets_at, w, E, C,
                              Fe);
    }
    ops.moe_gather(a.ep_arrival, a.ep_ys, route.unorder_at, R, C);
  }
  return comm.all_to_all_v(a.ep_arrival, route.recv_bytes, a.expert_ys, route.send_bytes, stream)
      .with_context("returning the experts' outputs to their tokens' ranks");
}

// The backward of ep_experts_forward: a.d_expert_ys (this rank's rows, from the combine's
// backward) to the experts' ranks, the local experts' backward (their weight gradients +=), and
// the input gradients back into a.d_expert_xs. REQUIRES: a holds the forward's ep_* buffers for
// this route.
template <class Ops, class Weights, class Grads>
Status ep_experts_backward(Ops& ops, parallel::Comm& comm, const ModelConfig& config, const Weights& w,
                           const Grads& dw, const ActivationTable<Ops>& a, const ExpertRoute& route,
                           const MoeAdapters<Ops>* lora = nullptr) {
  const int64_t E = config.num_experts;
  const int64_t C = config.hidden_size;
  const int64_t Fe = config.moe_intermediate_size;
  Stream* stream = ops.compute_stream();
  RETURN_IF_ERROR(comm.all_to_all_v(a.d_expert_ys, route.send_bytes, a.ep_arrival, route.recv_bytes, stream)
                      .with_context("sending output gradients to their experts' ranks"));
  const int64_t R = route.received;
  if (R > 0) {
    ops.moe_gather(a.ep_dys, a.ep_arrival, route.order_at, R, C);
    if (lora != nullptr && lora->experts) {
      moe_experts_backward_looped(ops, config, w, dw, *lora, a.ep_dxs, a.d_expert_gate, a.d_expert_up, a.d_expert_act,
                                  a.ep_dys, a.ep_xs, a.expert_gate, a.expert_up, a.expert_act, route.offsets.data(), 0,
                                  R);
    } else {
      ops.moe_experts_backward(a.ep_dxs, dw, a.d_expert_gate, a.d_expert_up, a.d_expert_act, a.ep_dys, a.ep_xs,
                               a.expert_gate, a.expert_up, a.expert_act, route.offsets_at, w, E, C, Fe);
    }
    ops.moe_gather(a.ep_arrival, a.ep_dxs, route.unorder_at, R, C);
  }
  return comm.all_to_all_v(a.ep_arrival, route.recv_bytes, a.d_expert_xs, route.send_bytes, stream)
      .with_context("returning input gradients to their tokens' ranks");
}

}  // namespace strata::model
