// GradientWorkspace: where backward writes a parameter group's full gradients when the ranks
// hold only their slices of the sums (ZeRO-2, train/paged_state.h). Two regions of device memory
// beside the chunks, each as large as the largest group's fp32 gradients: the head's and a tied
// embedding's are open at once. A group takes a free region when the first of its parts opens and
// gives it back when the last one closes; each of its tensors sits at a fixed offset in it.
//
// Ownership: borrows the Device (which must outlive it). Not thread-safe: the training thread's.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/status.h"

namespace strata {

class GradientWorkspace {
 public:
  // Store tensor i has `elements[i]` elements and belongs to group `groups[i]`.
  // Bytes create() allocates for them.
  static uint64_t bytes_for(const std::vector<uint64_t>& elements, const std::vector<int>& groups);
  static Result<GradientWorkspace> create(Device& device, const std::vector<uint64_t>& elements,
                                          const std::vector<int>& groups);
  GradientWorkspace() = default;

  // Takes a region for `group` (or counts one more user of the one it has).
  // REQUIRES: a region is free when the group has none.
  void open(int group);
  // One user fewer; the region is free again after the last. REQUIRES: open.
  void close(int group);
  // Tensor i's gradients in its group's region. REQUIRES: the group is open.
  float* at(size_t tensor) const;

 private:
  // Floats from a region's start of each tensor (whole 256-byte blocks apart), and a region's.
  static std::vector<uint64_t> offsets(const std::vector<uint64_t>& elements, const std::vector<int>& groups,
                                       uint64_t* region_floats);
  DeviceAllocation memory_;
  std::vector<uint64_t> offset_;
  std::vector<int> group_;
  uint64_t region_floats_ = 0;
  std::array<int, 2> holder_{-1, -1};  // the group in each region
  std::vector<int> users_;              // per group
  std::vector<int> region_;             // per group, -1: none
};

}  // namespace strata
