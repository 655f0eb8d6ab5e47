#include "train/gradient_workspace.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/check.h"
#include "core/units.h"

namespace strata {

namespace {

constexpr uint64_t kAlignFloats = 64;  // 256 bytes

// Whether `a` acquires a group's dense gradients (the part the workspace holds).
bool dense_gradients(const GroupAccess& a) {
  return a.activation < 0 && a.kind == StateKind::kGrad && a.part == kDensePart;
}

}  // namespace

std::vector<uint64_t> GradientWorkspace::offsets(const std::vector<uint64_t>& elements, const std::vector<int>& groups,
                                                 std::vector<uint64_t>* group_floats) {
  CHECK(elements.size() == groups.size());
  const int num_groups = groups.empty() ? 0 : *std::max_element(groups.begin(), groups.end()) + 1;
  group_floats->assign(static_cast<size_t>(num_groups), 0);
  std::vector<uint64_t> out(elements.size(), 0);
  for (size_t i = 0; i < elements.size(); ++i) {
    uint64_t& n = (*group_floats)[static_cast<size_t>(groups[i])];
    out[i] = n;
    n += (elements[i] + kAlignFloats - 1) / kAlignFloats * kAlignFloats;
  }
  return out;
}

uint64_t GradientWorkspace::bytes_for(const std::vector<uint64_t>& elements, const std::vector<int>& groups,
                                      const std::vector<ProgramEvent>& micro_batch) {
  std::vector<uint64_t> floats;
  offsets(elements, groups, &floats);
  const int num_groups = static_cast<int>(floats.size());
  // The micro-batch as PagedState opens and closes the groups: at the first and after the last
  // of each group's gradient batches; what is open at once, at most.
  const std::vector<int> batches = gradient_batches(micro_batch, num_groups);
  std::vector<int> seen(static_cast<size_t>(num_groups), 0);
  std::vector<bool> open(static_cast<size_t>(num_groups), false), in_batch(static_cast<size_t>(num_groups), false);
  uint64_t now = 0, most = 0;
  for (const ProgramEvent& e : micro_batch) {
    if (dense_gradients(e.access)) {
      const size_t g = static_cast<size_t>(e.access.group);
      in_batch[g] = true;
      if (!open[g]) open[g] = true, now += floats[g];
      most = std::max(most, now);
    }
    if (!e.last) continue;
    for (size_t g = 0; g < in_batch.size(); ++g) {
      if (!in_batch[g]) continue;
      in_batch[g] = false;
      if (++seen[g] == batches[g]) open[g] = false, now -= floats[g], seen[g] = 0;
    }
  }
  return most * sizeof(float);
}

Result<GradientWorkspace> GradientWorkspace::create(Device& device, const std::vector<uint64_t>& elements,
                                                    const std::vector<int>& groups,
                                                    const std::vector<ProgramEvent>& micro_batch) {
  GradientWorkspace w;
  w.offset_ = offsets(elements, groups, &w.group_floats_);
  w.group_ = groups;
  w.base_.assign(w.group_floats_.size(), kClosed);
  const uint64_t bytes = bytes_for(elements, groups, micro_batch);
  w.capacity_floats_ = bytes / sizeof(float);
  Result<DeviceAllocation> memory = device.allocate(std::max<uint64_t>(bytes, sizeof(float)));
  if (!memory.ok())
    return memory.status().with_context(fmt::format(
        "the {} of device memory backward writes full gradients into before they are summed onto the ranks "
        "(parallel.zero=2)",
        format_bytes(bytes)));
  w.memory_ = std::move(*memory);
  return w;
}

void GradientWorkspace::open(int group) {
  const size_t g = static_cast<size_t>(group);
  CHECK_MSG(base_.at(g) == kClosed, fmt::format("parameter group {} opens its gradients twice", group));
  CHECK_MSG(top_ + group_floats_[g] <= capacity_floats_,
            fmt::format("the gradient workspace of {} floats has no room for parameter group {} ({} floats on top of "
                        "{}): the step program did not size it for this order",
                        capacity_floats_, group, group_floats_[g], top_));
  base_[g] = top_;
  top_ += group_floats_[g];
  stack_.push_back(group);
}

void GradientWorkspace::close(int group) {
  const size_t g = static_cast<size_t>(group);
  CHECK_MSG(base_.at(g) != kClosed, fmt::format("parameter group {} closes gradients it has not opened", group));
  base_[g] = kClosed;
  while (!stack_.empty() && base_[static_cast<size_t>(stack_.back())] == kClosed) {
    top_ -= group_floats_[static_cast<size_t>(stack_.back())];
    stack_.pop_back();
  }
}

float* GradientWorkspace::at(size_t tensor) const {
  const uint64_t base = base_.at(static_cast<size_t>(group_.at(tensor)));
  CHECK_MSG(base != kClosed, fmt::format("the gradients of store tensor {} are not open", tensor));
  return memory_.as<float>() + base + offset_[tensor];
}

}  // namespace strata
