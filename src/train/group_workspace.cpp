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
  return most;
}

Result<GroupWorkspace> GroupWorkspace::create(Device& device, const WorkspaceLayout& layout,
                                              const std::vector<ProgramEvent>& micro_batch, const char* what) {
  GroupWorkspace w;
  w.offset_ = offsets(layout, &w.group_bytes_);
  w.group_ = layout.groups;
  w.base_.assign(w.group_bytes_.size(), kClosed);
  w.capacity_ = bytes_for(layout, micro_batch);
  Result<DeviceAllocation> memory = device.allocate(std::max<uint64_t>(w.capacity_, kAlign));
  if (!memory.ok())
    return memory.status().with_context(fmt::format("the {} of device memory for {}", format_bytes(w.capacity_), what));
  w.memory_ = std::move(*memory);
  return w;
}

void GroupWorkspace::open(int group) {
  const size_t g = static_cast<size_t>(group);
  CHECK_MSG(base_.at(g) == kClosed, fmt::format("parameter group {} is opened in a workspace twice", group));
  CHECK_MSG(top_ + group_bytes_[g] <= capacity_,
            fmt::format("a workspace of {} bytes has no room for parameter group {} ({} bytes on top of {}): the "
                        "step program did not size it for this order",
                        capacity_, group, group_bytes_[g], top_));
  base_[g] = top_;
  top_ += group_bytes_[g];
  stack_.push_back(group);
}

void GroupWorkspace::close(int group) {
  const size_t g = static_cast<size_t>(group);
  CHECK_MSG(base_.at(g) != kClosed, fmt::format("parameter group {} closes a workspace place it has not opened", group));
  base_[g] = kClosed;
  while (!stack_.empty() && base_[static_cast<size_t>(stack_.back())] == kClosed) {
    top_ -= group_bytes_[static_cast<size_t>(stack_.back())];
    stack_.pop_back();
  }
}

void* GroupWorkspace::at(size_t tensor) const {
  const uint64_t base = base_.at(static_cast<size_t>(group_.at(tensor)));
  CHECK_MSG(base != kClosed, fmt::format("store tensor {} is not open in its workspace", tensor));
  return memory_.as<char>() + base + offset_[tensor];
}

}  // namespace strata
