// GradientWorkspace: where backward writes a parameter group's full gradients when the ranks
// hold only their slices of the sums (ZeRO-2, train/paged_state.h). One buffer of device memory
// beside the chunks, used as a stack: a group opens at its first gradient batch of a micro-batch
// and closes at its last (a tied embedding stays open from the head's batch to its own backward,
// so that its sums are made once), each of its tensors at a fixed offset in its place. The
// buffer is as large as the most the step program (offload/step_program.h) ever has open at once.
//
// Ownership: borrows the Device (which must outlive it). Not thread-safe: the training thread's.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/status.h"
#include "offload/step_program.h"

namespace strata {

class GradientWorkspace {
 public:
  // Store tensor i has `elements[i]` elements and belongs to group `groups[i]`; `micro_batch` is
  // the program's micro-batch. Bytes create() allocates for them: the most that is open at once.
  static uint64_t bytes_for(const std::vector<uint64_t>& elements, const std::vector<int>& groups,
                            const std::vector<ProgramEvent>& micro_batch);
  static Result<GradientWorkspace> create(Device& device, const std::vector<uint64_t>& elements,
                                          const std::vector<int>& groups, const std::vector<ProgramEvent>& micro_batch);
  GradientWorkspace() = default;

  // Places `group` on top of the stack. REQUIRES: not open; room (what bytes_for() sized).
  void open(int group);
  // Gives the group's place back (the stack shrinks past every closed place on top).
  // REQUIRES: open.
  void close(int group);
  bool is_open(int group) const { return base_.at(static_cast<size_t>(group)) != kClosed; }
  // Tensor i's gradients in its group's place. REQUIRES: the group is open.
  float* at(size_t tensor) const;

 private:
  static constexpr uint64_t kClosed = UINT64_MAX;
  // Floats from its group's place of each tensor (whole 256-byte blocks apart), and each group's.
  static std::vector<uint64_t> offsets(const std::vector<uint64_t>& elements, const std::vector<int>& groups,
                                       std::vector<uint64_t>* group_floats);
  DeviceAllocation memory_;
  uint64_t capacity_floats_ = 0;
  std::vector<uint64_t> offset_;       // per tensor
  std::vector<int> group_;             // per tensor
  std::vector<uint64_t> group_floats_; // per group
  std::vector<uint64_t> base_;         // per group: its place, kClosed when closed
  std::vector<int> stack_;             // open (or closed, not yet popped) groups, bottom first
  uint64_t top_ = 0;
};

}  // namespace strata
