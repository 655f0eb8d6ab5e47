#include "offload/placement.h"

#include <algorithm>

namespace strata {

Placement::Placement(int num_groups) : rows_(static_cast<size_t>(num_groups)) {}

void Placement::place(int group, StateKind kind, Tier home, uint64_t bytes) {
  PlacementRow& r = row(group, kind);
  r.home = home;
  r.bytes = bytes;
  r.owned = {0, bytes};
}

std::vector<int> Placement::owners() const {
  std::vector<int> out;
  for (int g = 0; g < num_groups(); ++g) out.push_back(owner(g));
  return out;
}

bool Placement::sharded() const {
  for (const auto& group : rows_)
    for (const PlacementRow& r : group)
      if (!r.replicated) return true;
  return false;
}

void Placement::assign_owners(std::span<const uint64_t> group_elements, int world, bool shard_optimizer) {
  CHECK(group_elements.size() == rows_.size() && world >= 1);
  std::vector<int> order(rows_.size());
  for (size_t g = 0; g < order.size(); ++g) order[g] = static_cast<int>(g);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return group_elements[static_cast<size_t>(a)] > group_elements[static_cast<size_t>(b)];
  });
  std::vector<uint64_t> load(static_cast<size_t>(world), 0);
  for (int g : order) {
    const size_t r = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    load[r] += group_elements[static_cast<size_t>(g)];
    for (PlacementRow& row : rows_[static_cast<size_t>(g)]) row.owner = static_cast<int>(r);
    // ZeRO-1: the optimizer's kinds live on the owner alone, which holds all of them.
    for (StateKind k : {StateKind::kMaster, StateKind::kAdamM, StateKind::kAdamV}) {
      PlacementRow& opt = row(g, k);
      opt.replicated = !shard_optimizer;
      opt.owned = {0, opt.bytes};
    }
  }
}

}  // namespace strata
