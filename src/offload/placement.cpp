#include "offload/placement.h"

#include <algorithm>

namespace strata {

Placement::Placement(int num_groups) : rows_(static_cast<size_t>(num_groups)) {}

void Placement::place(int group, StateKind kind, Tier home, uint64_t bytes) {
  PlacementRow& r = row(group, kind);
  r.home = home;
  r.bytes = bytes;
}

bool Placement::sharded() const {
  for (const auto& group : rows_)
    for (const PlacementRow& r : group)
      if (r.sliced) return true;
  return false;
}

void Placement::shard_over(int world, int zero) {
  CHECK(world >= 1 && zero >= 0 && zero <= 3);
  world_ = world;
  for (auto& group : rows_) {
    for (StateKind k : {StateKind::kMaster, StateKind::kAdamM, StateKind::kAdamV})
      group[index(k)].sliced = zero >= 1 && world > 1;
    group[index(StateKind::kGrad)].sliced = zero >= 2 && world > 1;
    group[index(StateKind::kParam)].sliced = zero >= 3 && world > 1;
  }
}

ElementRange tensor_shard(const StateLayout& layout, const StateShape& shape, size_t index, int rank, int world) {
  CHECK(world >= 1 && rank >= 0 && rank < world);
  const uint64_t n = shape.elements;
  if (layout.quantized(shape))
    return static_cast<int>(index % static_cast<size_t>(world)) == rank ? ElementRange{0, n} : ElementRange{n, 0};
  const uint64_t units = (n + kShardUnit - 1) / kShardUnit, w = static_cast<uint64_t>(world);
  const uint64_t r = static_cast<uint64_t>(rank);
  const uint64_t first = std::min(n, units * r / w * kShardUnit);
  const uint64_t end = std::min(n, units * (r + 1) / w * kShardUnit);
  return {first, end - first};
}

}  // namespace strata
