#include "offload/placement.h"

#include <algorithm>

namespace strata {

Placement::Placement(int num_groups) : rows_(static_cast<size_t>(num_groups)), parts_(static_cast<size_t>(num_groups)) {}

const Placement::PartRows* Placement::find_part(int group, int part) const {
  const std::vector<PartRows>& parts = parts_.at(static_cast<size_t>(group));
  auto it = std::lower_bound(parts.begin(), parts.end(), part, [](const PartRows& p, int id) { return p.part < id; });
  return it != parts.end() && it->part == part ? &*it : nullptr;
}

Tier Placement::home(int group, StateKind kind, int part) const { return part_row(group, part, kind).home; }

const PlacementRow& Placement::part_row(int group, int part, StateKind kind) const {
  const PartRows* p = find_part(group, part);
  return p != nullptr && p->placed[index(kind)] ? p->rows[index(kind)] : row(group, kind);
}

void Placement::place_part(int group, int part, StateKind kind, Tier home, uint64_t bytes) {
  CHECK_MSG(part >= 0, "only a group's own parts (>= 0) have rows of their own");
  std::vector<PartRows>& parts = parts_.at(static_cast<size_t>(group));
  auto it = std::lower_bound(parts.begin(), parts.end(), part, [](const PartRows& p, int id) { return p.part < id; });
  if (it == parts.end() || it->part != part) {
    it = parts.insert(it, PartRows{});
    it->part = part;
  }
  PlacementRow& r = it->rows[index(kind)];
  r.home = home;
  r.bytes = bytes;
  r.sliced = row(group, kind).sliced;  // a part is shared out as its group is
  it->placed[index(kind)] = true;
}

std::vector<int> Placement::parts(int group) const {
  std::vector<int> out;
  for (const PartRows& p : parts_.at(static_cast<size_t>(group))) out.push_back(p.part);
  return out;
}

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
  auto shard = [&](Rows& rows) {
    for (StateKind k : {StateKind::kMaster, StateKind::kAdamM, StateKind::kAdamV})
      rows[index(k)].sliced = zero >= 1 && world > 1;
    rows[index(StateKind::kGrad)].sliced = zero >= 2 && world > 1;
    rows[index(StateKind::kParam)].sliced = zero >= 3 && world > 1;
  };
  for (Rows& group : rows_) shard(group);
  for (std::vector<PartRows>& parts : parts_)
    for (PartRows& p : parts) shard(p.rows);
}

ElementRange tensor_shard(const StateLayout& layout, const StateShape& shape, size_t index, int rank, int world) {
  CHECK(world >= 1 && rank >= 0 && rank < world);
  const uint64_t n = shape.elements;
  if (layout.quantized(shape))
    return static_cast<int>(index % static_cast<size_t>(world)) == rank ? ElementRange{0, n} : ElementRange{n, 0};
  const uint64_t units = (n + kShardUnit - 1) / kShardUnit, w = static_cast<uint64_t>(world);
  const uint64_t r = static_cast<uint64_t>(rank);
  // Equal parts by the floor of units x rank / w: the last rank's part is the largest, of every
  // tensor (the planner homes the groups for the largest share, planning.cpp). A tensor of fewer
  // units than ranks (a norm, a bias) instead goes to the ranks from index % w on, so that such
  // tensors spread over the ranks rather than all land on the last. Either way the ranks' ranges
  // are contiguous and in rank order, as the collectives' blocks need.
  uint64_t before = units * r / w, after = units * (r + 1) / w;
  if (units < w) {
    const uint64_t start = std::min(static_cast<uint64_t>(index) % w, w - units);
    before = std::clamp(r, start, start + units) - start;
    after = std::clamp(r + 1, start, start + units) - start;
  }
  const uint64_t first = std::min(n, before * kShardUnit);
  const uint64_t end = std::min(n, after * kShardUnit);
  return {first, end - first};
}

}  // namespace strata
