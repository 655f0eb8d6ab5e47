#include "train/group_workspace.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/check.h"
#include "core/units.h"

namespace strata {

namespace {

constexpr uint64_t kAlign = 256;

}  // namespace

std::vector<uint64_t> GroupWorkspace::offsets(const WorkspaceLayout& layout, std::vector<uint64_t>* group_bytes) {
  CHECK(layout.tensor_bytes.size() == layout.groups.size());
  const int num_groups = layout.groups.empty() ? 0 : *std::max_element(layout.groups.begin(), layout.groups.end()) + 1;
  group_bytes->assign(static_cast<size_t>(num_groups), 0);
  std::vector<uint64_t> out(layout.groups.size(), 0);
  for (size_t i = 0; i < layout.groups.size(); ++i) {
    uint64_t& n = (*group_bytes)[static_cast<size_t>(layout.groups[i])];
    out[i] = n;
    n += (layout.tensor_bytes[i] + kAlign - 1) / kAlign * kAlign;
  }
  return out;
}

uint64_t GroupWorkspace::bytes_for(const WorkspaceLayout& layout, const std::vector<ProgramEvent>& micro_batch) {
  std::vector<uint64_t> bytes;
  offsets(layout, &bytes);
  const size_t num_groups = bytes.size();
  // The batches of a micro-batch that acquire each group's dense part of the kind.
  auto opens = [&](const GroupAccess& a) { return a.activation < 0 && a.kind == layout.kind && a.part == kDensePart; };
  std::vector<int> batches(num_groups, 0), seen(num_groups, 0);
  std::vector<bool> open(num_groups, false), in_batch(num_groups, false);
  for (const ProgramEvent& e : micro_batch) {
    if (opens(e.access)) in_batch[static_cast<size_t>(e.access.group)] = true;
    if (!e.last) continue;
    for (size_t g = 0; g < num_groups; ++g) batches[g] += in_batch[g] ? 1 : 0;
    in_batch.assign(num_groups, false);
  }
  // The micro-batch as PagedState opens and closes the groups: what is open at once, at most.
  uint64_t now = 0, most = 0;
  for (const ProgramEvent& e : micro_batch) {
    if (opens(e.access)) {
      const size_t g = static_cast<size_t>(e.access.group);
      in_batch[g] = true;
      if (!open[g]) open[g] = true, now += bytes[g];
      most = std::max(most, now);
    }
    if (!e.last) continue;
    for (size_t g = 0; g < num_groups; ++g) {
      if (!in_batch[g]) continue;
      in_batch[g] = false;
      const bool closes = layout.span == WorkspaceSpan::kBatch || ++seen[g] == batches[g];
      if (closes) open[g] = false, now -= bytes[g], seen[g] = 0;
    }
  }
  const uint64_t largest = bytes.empty() ? 0 : *std::max_element(bytes.begin(), bytes.end());
  return most + static_cast<uint64_t>(std::max(layout.in_flight, 0)) * largest;
}

Result<GroupWorkspace> GroupWorkspace::create(Device& device, const WorkspaceLayout& layout,
                                              const std::vector<ProgramEvent>& micro_batch, const char* what) {
  GroupWorkspace w;
  w.device_ = &device;
  w.offset_ = offsets(layout, &w.group_bytes_);
  w.group_ = layout.groups;
  w.base_.assign(w.group_bytes_.size(), kClosed);
  w.capacity_ = bytes_for(layout, micro_batch);
  w.in_flight_room_ = layout.in_flight > 0;
  Result<DeviceAllocation> memory = device.allocate(std::max<uint64_t>(w.capacity_, kAlign));
  if (!memory.ok())
    return memory.status().with_context(fmt::format("the {} of device memory for {}", format_bytes(w.capacity_), what));
  w.memory_ = std::move(*memory);
  return w;
}

std::pair<uint64_t, uint64_t> GroupWorkspace::place_for(int group) const {
  const uint64_t need = group_bytes_[static_cast<size_t>(group)];
  // Candidates: the start, and the end of every place open or recently closed (first fit among
  // those is as tight as any). Among those free of open groups, with room for groups in flight,
  // the one whose overlapped places were closed the longest ago (none: 0) and then the lowest;
  // without, the lowest (a stack's order: only that is sure to fit the most the program opens).
  std::vector<uint64_t> candidates = {0};
  for (size_t h = 0; h < base_.size(); ++h)
    if (base_[h] != kClosed) candidates.push_back(base_[h] + group_bytes_[h]);
  for (const Closed& f : recent_) candidates.push_back(f.end);
  if (in_flight_room_ && need <= capacity_) {
    // Also the top, and just below each open place: a group in flight beside one in use lands
    // at either end of the room between them rather than in its middle, leaving the other end
    // whole for the next (the head after the last layer, each larger than the gap it'd leave).
    candidates.push_back(capacity_ - need);
    for (size_t h = 0; h < base_.size(); ++h)
      if (base_[h] != kClosed && base_[h] >= need) candidates.push_back(base_[h] - need);
  }
  auto overlaps = [](uint64_t a, uint64_t b, uint64_t c, uint64_t d) { return a < d && c < b; };
  uint64_t best = kClosed, best_cost = UINT64_MAX, best_hole = 0;
  for (uint64_t at : candidates) {
    if (at + need > capacity_) continue;
    bool clash = false;
    for (size_t h = 0; h < base_.size() && !clash; ++h)
      clash = base_[h] != kClosed && need > 0 && group_bytes_[h] > 0 &&
              overlaps(at, at + need, base_[h], base_[h] + group_bytes_[h]);
    if (clash) continue;
    uint64_t cost = 0, hole = 0;
    if (in_flight_room_) {
      for (const Closed& f : recent_)
        if (overlaps(at, at + need, f.begin, f.end)) cost = std::max(cost, f.order);
      hole = std::max(at, capacity_ - (at + need));
    }
    // Ties: the place nearer an end of the buffer (the room on its far side is whole once the
    // groups in use now close: the next group in flight fits there), then the lowest.
    if (cost < best_cost || (cost == best_cost && (hole > best_hole || (hole == best_hole && at < best))))
      best = at, best_cost = cost, best_hole = hole;
  }
  return {best, best_cost};
}

void GroupWorkspace::open(int group, Stream* user) {
  const size_t g = static_cast<size_t>(group);
  CHECK_MSG(base_.at(g) == kClosed, fmt::format("parameter group {} is opened in a workspace twice", group));
  const uint64_t need = group_bytes_[g];
  // Places done with are free again.
  std::erase_if(in_flight_, [&](Closed& f) {
    if (!f.done->query()) return false;
    spare_events_.push_back(std::move(f.done));
    return true;
  });
  const uint64_t best = place_for(group).first;
  CHECK_MSG(best != kClosed,
            fmt::format("a workspace of {} bytes has no room for parameter group {} ({} bytes): the step program did "
                        "not size it for this order",
                        capacity_, group, need));
  for (const Closed& f : in_flight_) {
    if (!(best < f.end && f.begin < best + need)) continue;
    CHECK_MSG(user != nullptr, "a workspace place reused before its last user's work is done, by the host");
    user->wait(*f.done);
  }
  base_[g] = best;
}

void GroupWorkspace::close(int group, Stream* last_user) {
  const size_t g = static_cast<size_t>(group);
  CHECK_MSG(base_.at(g) != kClosed, fmt::format("parameter group {} closes a workspace place it has not opened", group));
  if (group_bytes_[g] > 0) {
    ++closes_;
    if (recent_.size() == kRecent) recent_.erase(recent_.begin());
    recent_.push_back(Closed{base_[g], base_[g] + group_bytes_[g], closes_, nullptr});
    if (last_user != nullptr) {
      Closed f{base_[g], base_[g] + group_bytes_[g], closes_, nullptr};
      if (spare_events_.empty()) {
        f.done = device_->create_event();
      } else {
        f.done = std::move(spare_events_.back());
        spare_events_.pop_back();
      }
      f.done->record(*last_user);
      in_flight_.push_back(std::move(f));
    }
  }
  base_[g] = kClosed;
}

uint64_t GroupWorkspace::place(int group) const {
  const uint64_t base = base_.at(static_cast<size_t>(group));
  CHECK_MSG(base != kClosed, fmt::format("parameter group {} has no place in its workspace", group));
  return base;
}

void* GroupWorkspace::at(size_t tensor) const {
  const uint64_t base = base_.at(static_cast<size_t>(group_.at(tensor)));
  CHECK_MSG(base != kClosed, fmt::format("store tensor {} is not open in its workspace", tensor));
  return memory_.as<char>() + base + offset_[tensor];
}

}  // namespace strata
