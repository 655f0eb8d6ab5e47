// GroupWorkspace: device memory beside the chunks where whole parameter groups live for a while
// when the ranks hold only their slices of them (train/paged_state.h):
// - ZeRO-2's gradients: backward writes a group's full gradients here, from the group's first
//   gradient batch of a micro-batch to its last (a tied embedding stays from the head's batch to
//   its own backward, so that its sums are made once), which are then summed onto the ranks;
// - ZeRO-3's compute copy: a group's weights gathered from the ranks for one batch of compute.
// One buffer: a group opens in the first place free of open groups, each of its tensors at a
// fixed offset there; the buffer is as large as the most the step program
// (offload/step_program.h) ever has open at once, plus `in_flight` of the largest group.
//
// In flight: with communication on a stream of its own (PagedState's collectives overlapped
// with compute), a group closes while work queued on some stream still uses its place (a
// gradient sum not yet made, weights not yet read). close() with that stream records an event,
// and an open() whose place overlaps such a place makes its own stream wait for it; so that
// opening a group rarely waits for the one before it, open() prefers places whose users are
// done, or else closed the longest ago, and the extra room holds a group still in flight. Among
// places alike so, it takes the one nearer an end of the buffer: a group opened beside the one
// in use then leaves the far side whole for the next, once that one closes.
//
// Ownership: borrows the Device (which must outlive it). Not thread-safe: the training thread's.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
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
  int in_flight = 0;  // largest groups' room beside the most open at once (see above)
};

class GroupWorkspace {
 public:
  // Bytes create() allocates for `layout` along the program's `micro_batch`: the most open at once.
  static uint64_t bytes_for(const WorkspaceLayout& layout, const std::vector<ProgramEvent>& micro_batch);
  static Result<GroupWorkspace> create(Device& device, const WorkspaceLayout& layout,
                                       const std::vector<ProgramEvent>& micro_batch, const char* what);
  GroupWorkspace() = default;

  // Gives `group` a place. With `user` (a stream of the workspace's device) the stream waits
  // for the work queued on the streams of earlier groups' places it overlaps (close()).
  // REQUIRES: not open; room (what bytes_for() sized).
  void open(int group, Stream* user = nullptr);
  // Gives the group's place back. With `last_user`, the place is reused only after the work
  // queued on that stream so far (an event recorded now); without, at once (the next user's
  // stream is the one that used it, or the host waited). REQUIRES: open.
  void close(int group, Stream* last_user = nullptr);
  bool is_open(int group) const { return base_.at(static_cast<size_t>(group)) != kClosed; }
  // The group's place: its offset in the buffer. REQUIRES: open.
  uint64_t place(int group) const;
  // Whether open(group) finds a place now (what is open leaves one).
  bool can_open(int group) const { return place_for(group).first != kClosed; }
  // Tensor i in its group's place. REQUIRES: the group is open.
  void* at(size_t tensor) const;

 private:
  static constexpr uint64_t kClosed = UINT64_MAX;
  // Bytes from its group's place of each tensor (whole 256-byte blocks apart), and each group's.
  static std::vector<uint64_t> offsets(const WorkspaceLayout& layout, std::vector<uint64_t>* group_bytes);
  // The place open(group) takes, and the latest close() order among the recent places it
  // overlaps (0: none); kClosed when none is free of open groups. It depends on the order of
  // opens and closes only, never on how far streams have got, so that ranks running the same
  // program make the same choices (PagedState prefetches only when there is room).
  std::pair<uint64_t, uint64_t> place_for(int group) const;
  // A closed place: its bytes and close() order (the recent ones, for place_for), and with an
  // event when its last user may still be using it (in_flight_, until the event completes).
  struct Closed {
    uint64_t begin = 0, end = 0;
    uint64_t order = 0;
    std::unique_ptr<Event> done;
  };
  static constexpr size_t kRecent = 16;
  Device* device_ = nullptr;
  DeviceAllocation memory_;
  uint64_t capacity_ = 0;
  bool in_flight_room_ = false;  // WorkspaceLayout::in_flight > 0
  std::vector<uint64_t> offset_;       // per tensor
  std::vector<int> group_;             // per tensor
  std::vector<uint64_t> group_bytes_;  // per group
  std::vector<uint64_t> base_;         // per group: its place, kClosed when closed
  std::vector<Closed> recent_;     // the last kRecent closes (no events)
  std::vector<Closed> in_flight_;  // closes whose users' events have not completed (seen at open)
  std::vector<std::unique_ptr<Event>> spare_events_;
  uint64_t closes_ = 0;
};

}  // namespace strata
