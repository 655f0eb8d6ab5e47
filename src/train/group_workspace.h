// GroupWorkspace: device memory beside the chunks where whole parameter groups live for a while
// when the ranks hold only their slices of them (train/paged_state.h):
// - ZeRO-2's gradients: backward writes a group's full gradients here, from the group's first
//   gradient batch of a micro-batch to its last (a tied embedding stays from the head's batch to
//   its own backward, so that its sums are made once), which are then summed onto the ranks;
// - ZeRO-3's compute copy: a group's weights gathered from the ranks for one batch of compute.
// One buffer used as a stack: a group opens on top, each of its tensors at a fixed offset in its
// place; the buffer is as large as the most the step program (offload/step_program.h) ever has
// open at once.
//
// Ownership: borrows the Device (which must outlive it). Not thread-safe: the training thread's.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/status.h"
#include "offload/step_program.h"

namespace strata {

// How long a group stays open: from its first batch of the micro-batch that acquires `kind` to
// its last, or for each such batch.
enum class WorkspaceSpan : uint8_t { kMicroBatch, kBatch };

struct WorkspaceLayout {
  std::vector<uint64_t> tensor_bytes;  // per store tensor, what it takes whole
  std::vector<int> groups;             // per store tensor, its group
  StateKind kind = StateKind::kGrad;   // the acquisitions (of groups' dense parts) that open them
  WorkspaceSpan span = WorkspaceSpan::kMicroBatch;
};

class GroupWorkspace {
 public:
  // Bytes create() allocates for `layout` along the program's `micro_batch`: the most open at once.
  static uint64_t bytes_for(const WorkspaceLayout& layout, const std::vector<ProgramEvent>& micro_batch);
  static Result<GroupWorkspace> create(Device& device, const WorkspaceLayout& layout,
                                       const std::vector<ProgramEvent>& micro_batch, const char* what);
  GroupWorkspace() = default;

  // Places `group` on top of the stack. REQUIRES: not open; room (what bytes_for() sized).
  void open(int group);
  // Gives the group's place back (the stack shrinks past every closed place on top).
  // REQUIRES: open.
  void close(int group);
  bool is_open(int group) const { return base_.at(static_cast<size_t>(group)) != kClosed; }
  // Tensor i in its group's place. REQUIRES: the group is open.
  void* at(size_t tensor) const;

 private:
  static constexpr uint64_t kClosed = UINT64_MAX;
  // Bytes from its group's place of each tensor (whole 256-byte blocks apart), and each group's.
  static std::vector<uint64_t> offsets(const WorkspaceLayout& layout, std::vector<uint64_t>* group_bytes);
  DeviceAllocation memory_;
  uint64_t capacity_ = 0;
  std::vector<uint64_t> offset_;       // per tensor
  std::vector<int> group_;             // per tensor
  std::vector<uint64_t> group_bytes_;  // per group
  std::vector<uint64_t> base_;         // per group: its place, kClosed when closed
  std::vector<int> stack_;             // open (or closed, not yet popped) groups, bottom first
  uint64_t top_ = 0;
};

}  // namespace strata
