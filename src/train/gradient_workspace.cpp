#include "train/gradient_workspace.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/check.h"
#include "core/units.h"

namespace strata {

namespace {

constexpr uint64_t kAlignFloats = 64;  // 256 bytes

}  // namespace

std::vector<uint64_t> GradientWorkspace::offsets(const std::vector<uint64_t>& elements, const std::vector<int>& groups,
                                                 uint64_t* region_floats) {
  CHECK(elements.size() == groups.size());
  const int num_groups = groups.empty() ? 0 : *std::max_element(groups.begin(), groups.end()) + 1;
  std::vector<uint64_t> next(static_cast<size_t>(num_groups), 0), out(elements.size(), 0);
  for (size_t i = 0; i < elements.size(); ++i) {
    uint64_t& n = next[static_cast<size_t>(groups[i])];
    out[i] = n;
    n += (elements[i] + kAlignFloats - 1) / kAlignFloats * kAlignFloats;
  }
  *region_floats = next.empty() ? 0 : *std::max_element(next.begin(), next.end());
  return out;
}

uint64_t GradientWorkspace::bytes_for(const std::vector<uint64_t>& elements, const std::vector<int>& groups) {
  uint64_t region = 0;
  offsets(elements, groups, &region);
  return 2 * region * sizeof(float);
}

Result<GradientWorkspace> GradientWorkspace::create(Device& device, const std::vector<uint64_t>& elements,
                                                    const std::vector<int>& groups) {
  GradientWorkspace w;
  w.offset_ = offsets(elements, groups, &w.region_floats_);
  w.group_ = groups;
  const size_t num_groups = groups.empty() ? 0 : static_cast<size_t>(*std::max_element(groups.begin(), groups.end()) + 1);
  w.users_.assign(num_groups, 0);
  w.region_.assign(num_groups, -1);
  const uint64_t bytes = 2 * w.region_floats_ * sizeof(float);
  Result<DeviceAllocation> memory = device.allocate(bytes);
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
  if (users_.at(g)++ > 0) return;
  const auto free = std::find(holder_.begin(), holder_.end(), -1);
  CHECK_MSG(free != holder_.end(), fmt::format("no gradient region is free for parameter group {} (groups {} and {} "
                                               "hold them)", group, holder_[0], holder_[1]));
  *free = group;
  region_[g] = static_cast<int>(free - holder_.begin());
}

void GradientWorkspace::close(int group) {
  const size_t g = static_cast<size_t>(group);
  CHECK_MSG(users_.at(g) > 0, fmt::format("parameter group {} closes a gradient region it does not hold", group));
  if (--users_[g] > 0) return;
  holder_[static_cast<size_t>(region_[g])] = -1;
  region_[g] = -1;
}

float* GradientWorkspace::at(size_t tensor) const {
  const int r = region_.at(static_cast<size_t>(group_.at(tensor)));
  CHECK_MSG(r >= 0, fmt::format("the gradients of store tensor {} are not open", tensor));
  return memory_.as<float>() + static_cast<uint64_t>(r) * region_floats_ + offset_[tensor];
}

}  // namespace strata
