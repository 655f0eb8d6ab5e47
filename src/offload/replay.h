// The planner's traffic: one optimizer step replayed on the real state store and chunk space
// (offload/state_store.h, memory/chunk_space.h) over a Device and an IoEngine that move nothing
// (core/counting_backend.h). The store packs the model's tensors, homes each group's chunks
// where the placement says, and is driven along the step program (offload/step_program.h) the
// way the engine drives it: the model's parts acquired and released as the decoder batches them,
// an MoE layer's experts acquired together on demand, offloaded saved activations written and
// read back, then the optimizer's passes. So the replay's moves are the engine's by
// construction: slots, Belady eviction, prefetch and write-backs are the same code.
//
// What only data decides is taken as planned: a micro-batch's tokens reach the first
// `expert_fetch_fraction` of each MoE layer's experts (the planner's uniform routing; every
// expert for the kinds `every_expert` names), and an
// nvme read has finished when the next prefetch looks at it.
//
// The replay runs one step from the homes alone, then averages the moves of the next few: the
// steady state. That is not always one step long: which copies a full tier keeps can rotate
// over steps (e.g. 2 of every 3 steps moving more), so the steps counted cover every cycle of 1,
// 2, 3 or 6 steps whole.
// Thread-compatible; cost: the chunk space's, without a byte moved.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "core/status.h"
#include "memory/chunk_space.h"
#include "offload/state_store.h"
#include "offload/step_program.h"

namespace strata {

struct ReplayInput {
  std::vector<StateTensor> tensors;  // as the engine's store registers them
  StateStoreOptions store;           // budgets, chunk size, layout, homes, holdings, lookahead
  int activations = 0;               // offloaded saved-activation buffers
  uint64_t activation_bytes = 0;     // bytes of each
  int64_t activation_host_chunks = -1;  // of their chunks, those homed on the host (Placement's)
  std::vector<ProgramEvent> program;  // one step (StepProgram::events)
  double expert_fetch_fraction = 1.0;
  std::vector<double> expert_fetch_by_group;  // when not empty, per group instead
  // Kinds whose expert runs take every expert of the layer, whatever the tokens reach: a sliced
  // kind the ranks gather (ZeRO-3's weights) or sum (ZeRO-2's gradients) expert by expert.
  std::array<bool, kNumStateKinds> every_expert{};
  int counted_steps = 6;  // averaged, after the first step
};

// Bytes moved between the tiers.
struct ReplayMoves {
  uint64_t h2d = 0, d2h = 0, disk_read = 0, disk_write = 0;
  ReplayMoves& operator+=(const ReplayMoves& o);
};

struct ReplayResult {
  // The counted steps' moves per step, by StepPhase (each rounded to the nearest byte).
  std::array<ReplayMoves, kStepPhases> phase{};
  std::array<uint64_t, kNumTiers> peak_bytes{};  // each tier's peak in use over the replay
  ReplayMoves total() const;
  const ReplayMoves& of(StepPhase p) const { return phase[static_cast<size_t>(p)]; }
};

// Errors: what creating the store or an acquisition returns (OutOfMemory when some acquisition
// finds every slot of a tier pinned or home).
Result<ReplayResult> replay_step(const ReplayInput& input);

// Chunks the store of `tensors` takes over every kind of `layout` (each group's kind packed on
// its own, but the kinds `sliced` names, packed as the tensors' slices that continue from group
// to group where `home` homes them alike, as the store packs them), with `activations` buffers of `activation_bytes` beside them: the most a tier can hold,
// so what the engine reserves for one at most (one more with nvme staging).
uint64_t store_chunk_count(const std::vector<StateTensor>& tensors, const StateLayout& layout, uint64_t chunk_bytes,
                           int activations, uint64_t activation_bytes,
                           const std::array<bool, kNumStateKinds>& sliced = {}, const HomeOf& home = {});

}  // namespace strata
