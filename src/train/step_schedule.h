// The step schedule: every acquisition of one optimizer step, in order — what the decoder's
// forward and backward begin and end (model/decoder_impl.h), the activation checkpoints it
// offloads and fetches, and what the one optimizer (PagedState) touches. The chunk store
// prefetches and evicts (Belady) along it. It lives here only: a change to the order in which
// the model or the optimizer touches state changes this function too, and the paging tests
// (which count acquisitions, prefetches and stalls) catch a mismatch.
#pragma once

#include <functional>
#include <vector>

#include "memory/tier.h"
#include "offload/state_store.h"

namespace strata {

// num_layers decoder layers; tied embeddings (the head reads group 0); grad_accum micro-batches;
// `offloaded` activation checkpoints; experts[g]: the experts of group g (0 for dense groups);
// adam_tier(g): where AdamW updates group g; optimizer_kinds: the state kinds AdamW acquires.
// updates(g, k): whether the optimizer phase acquires kind k of group g (empty: every
// optimizer kind of every group; a data-parallel rank updates only the groups it owns and
// receives the others' compute copies).
std::vector<GroupAccess> step_schedule(int num_layers, bool tied, int64_t grad_accum, int offloaded,
                                       const std::vector<int>& experts, const std::function<Tier(int)>& adam_tier,
                                       const std::vector<StateKind>& optimizer_kinds,
                                       const std::function<bool(int, StateKind)>& updates = {});

}  // namespace strata
