// SavableState: a run's training state as checkpoints see it: three fp32 kinds (parameters,
// Adam m, Adam v), each in the flat ParamLayout order whatever the state's real home (chunks
// spread over device, host and nvme for PagedState; a GPU's memory for a resident model).
// TrainCheckpointer saves it and restore_checkpoint fills it through this interface.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/params.h"
#include "offload/state_store.h"

namespace strata {

// Small training state saved beside the tensors under "state/NAME" (e.g. a MoE router's
// loss-free balancing bias): a name and its values, one-dimensional.
struct ExtraState {
  std::string name;
  std::vector<float> values;
};

using TensorFill = std::function<Status(const model::TensorSpec&, float*)>;

// Which tensors fill_kind writes: every one, the trained ones (what a checkpoint holds), or the
// frozen ones (model::TensorSpec::frozen: a LoRA run's base, which a resumed run reads from its
// source again).
enum class TensorSet : uint8_t { kAll, kTrained, kFrozen };
inline bool in_set(TensorSet set, const model::TensorSpec& t) {
  return set == TensorSet::kAll || (set == TensorSet::kFrozen) == t.frozen;
}

class SavableState {
 public:
  virtual ~SavableState() = default;

  // Writes every tensor of `kind` in `which`: fill(spec, dst) must write spec.numel floats to dst.
  // A frozen tensor has parameters alone (its compute copy, written from the values).
  virtual Status fill_kind(StateKind kind, const TensorFill& fill, TensorSet which = TensorSet::kAll) = 0;
  // Copies bytes [offset, offset + length) of the flat layout of `kind` (whole floats) into
  // dst: the state as it is now. May wait for a save in flight (through the before_modify
  // hook), so a save's own reading must not call it where flat_data() is not null.
  virtual Status read_flat(StateKind kind, uint64_t offset, uint64_t length, void* dst) = 0;
  // A save is starting (the previous one has ended): a state that is not in host memory copies
  // itself there now, so the save reads a consistent picture while training goes on.
  virtual Status capture() { return Status::OK(); }
  // The host copy capture() made of `kind`, 4 KiB aligned, for a save to write in place;
  // null when the save reads through read_flat.
  virtual const void* flat_data(StateKind /*kind*/) const { return nullptr; }
  // Called with a parameter group before bytes a save may still be reading are overwritten
  // (model::param_group_of numbering), so the save can copy them first or finish them.
  virtual void set_before_modify(std::function<void(int group)> hook) = 0;
  // The elements of `t` (the index-th of ParamLayout::tensors()) this data-parallel rank writes
  // into a sharded checkpoint: its range (offload/placement.h's tensor_shard). All of them for
  // one process; none of a frozen tensor (checkpoints hold the trained state: a frozen tensor
  // comes from the run's source again).
  virtual ElementRange saved_range(const model::TensorSpec& t, size_t /*index*/) const {
    if (t.frozen) return {0, 0};
    return {0, static_cast<uint64_t>(t.numel)};
  }
  virtual int64_t step_count() const = 0;  // AdamW steps taken (bias correction)
  virtual void set_step_count(int64_t steps) = 0;
};

}  // namespace strata
