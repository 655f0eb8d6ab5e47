// StepProgram: every acquisition of state in one optimizer step, in order, as the code that
// acquires it runs. The model's part is recorded from the decoder itself (model/recording_access.h
// runs its forward, recompute and backward without computing); the optimizer's part comes from
// the functions below, which PagedState's passes acquire by. The chunk store prefetches and
// evicts (Belady) along the program's schedule(); the planner's traffic replay
// (offload/replay.h) drives a store along its events. Nothing else writes the order down.
//
// Batches: the model holds what it acquires for a phase (a layer's parameters, gradients and
// experts; the head with a tied embedding) until it ends that phase, and the optimizer holds one
// group's kinds at a time. An event with `last` set closes a batch: everything acquired since
// the previous such event is released after it.
//
// The overlapped optimizer (OptimizerProgram::overlapped) updates each group on a thread of its
// own as soon as the step's last micro-batch is done with the group's gradients: its updates are
// then part of that micro-batch, each right after the batch that last acquires its group's
// gradients, and there is no norm pass. The compute thread acquires each update's kinds there,
// in the order, and the other thread applies it; its batch (ProgramEvent::overlapped) stays
// acquired until the next overlapped update begins, or the step's end, where the compute thread
// waits for it and releases it. So the acquisitions and releases happen at fixed points of the
// program, whatever the threads' timing.
//
// Thread-compatible value types.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "memory/chunk_space.h"
#include "memory/tier.h"
#include "offload/state_store.h"

namespace strata {

// The phases of a step, as the planner times them: zeroing the gradients, each micro-batch's
// forward (the embedding, the layers, the head's forward and backward) and backward (recompute
// and backward of the layers, the embedding's backward), the gradient norm, AdamW.
enum class StepPhase : uint8_t { kZero, kForward, kBackward, kNorm, kOptimizer };
inline constexpr int kStepPhases = 5;

// One acquisition: `access` (its prefetch_to is where it happens) with `mode`.
struct ProgramEvent {
  GroupAccess access;
  AccessMode mode = AccessMode::kRead;
  StepPhase phase = StepPhase::kForward;
  bool last = false;  // closes a batch (see above)
  // Nothing reads the state acquired here after it until an acquisition overwrites it whole:
  // AdamW's gradients, which the next step's zeroing writes. Its release discards the bytes
  // (StateStore::discard), so that no copy of them is written back.
  bool discard = false;
  // An overlapped AdamW update's (see above): its batch is released when the next such batch
  // begins, or at the step's end, not when it closes.
  bool overlapped = false;
};

struct StepProgram {
  std::vector<ProgramEvent> zero;         // before the micro-batches
  std::vector<ProgramEvent> micro_batch;  // one micro-batch, repeated for all but the step's last
  // The step's last micro-batch: micro_batch, with the overlapped optimizer's updates inside.
  std::vector<ProgramEvent> last_micro_batch;
  std::vector<ProgramEvent> optimizer;    // after them: the norm, then AdamW group by group

  // Every event of a step of `grad_accum` micro-batches, in order.
  std::vector<ProgramEvent> events(int64_t grad_accum) const;
  // Their accesses: the schedule the chunk store follows (StateStore::set_schedule).
  std::vector<GroupAccess> schedule(int64_t grad_accum) const;
};

// Where AdamW works on a group whose Adam moments are homed at `home`: on the device when they
// live there, else in host memory (nvme-homed state is read into host slots and written back by
// eviction).
inline Tier update_tier(Tier home) { return home == Tier::kDevice ? Tier::kDevice : Tier::kHost; }

// The optimizer's side of a step, for `num_groups` groups: what PagedState's zero_grads and
// clip_and_step acquire. AdamW acquires every kind of the layout for each group (a
// data-parallel rank its ranges of every group), in StateLayout::kinds() order.
struct OptimizerProgram {
  int num_groups = 0;
  std::vector<StateKind> kinds;          // the layout's kinds
  std::function<Tier(int group)> where;  // update_tier of the group
  // Data-parallel ranks sum the gradients over the ranks in place before the norm reads them:
  // the norm pass then writes them too.
  bool reduces_gradients = false;
  // AdamW overlapped with the last micro-batch's backward (see above): no norm pass, and each
  // group's update follows the batch that last acquires its gradients.
  bool overlapped = false;
  // With reduces_gradients: the ranks sum each group's gradients on a thread of their own as the
  // last micro-batch's backward hands the group over (an event of the norm's phase there, beside
  // the cursor, that writes them), hidden behind the backward of the groups before it; the norm
  // pass then only reads them.
  bool reduces_at_handover = false;
  // AdamW in host memory goes slice by slice (StateStore's update slices), not group by group:
  // those updates are marked kEachSlice, for expand_update_slices to split once the store's
  // slices are known. Not with `overlapped` (its per-group finiteness check reads the whole
  // group's gradients before changing any of it).
  bool slices_host_updates = false;
};

// How many batches of `micro_batch` acquire each of `num_groups` groups' gradients (their dense
// part, which the experts' come with): the overlapped optimizer is handed a group when the last
// of them closes in the step's last micro-batch.
std::vector<int> gradient_batches(const std::vector<ProgramEvent>& micro_batch, int num_groups);

// ZeRO-3's gathers of a micro-batch: the group of each batch that computes with weights (the
// program's acquisitions of a group's dense compute copy), in order.
std::vector<int> gather_order(const std::vector<ProgramEvent>& micro_batch);

// For each entry of `order`, whether its group's weights are still in place from its batch
// before, as overlapped ZeRO-3 runs the order with `ahead` groups gathered ahead
// (train/paged_state.h, begin_gathered and keeps_gathered), room permitting: each batch's
// begin gathers the groups after those already ahead, up to `ahead` of them and stopping at a
// group that is ahead already or its own; its end keeps its group when the group's next entry is
// the one right after those ahead. A kept entry needs no gather.
std::vector<bool> kept_gathers(const std::vector<int>& order, int ahead);

// Splits each update marked kEachSlice (OptimizerProgram::slices_host_updates) into one batch
// per update slice of its group, `slices(group)` of them, in order: the same kinds for each
// slice. A group of one slice is updated whole (kWholeGroup), as without the mark.
std::vector<ProgramEvent> expand_update_slices(const std::vector<ProgramEvent>& events,
                                               const std::function<int(int group)>& slices);

// The whole program: the optimizer's zeroing before `micro_batch` (the model's, recorded), the
// norm and AdamW after it, or the updates inside the last micro-batch when overlapped.
StepProgram make_step_program(std::vector<ProgramEvent> micro_batch, const OptimizerProgram& optimizer);

}  // namespace strata
