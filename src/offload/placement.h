// Placement: the one table of where each parameter group's training state lives and which
// data-parallel rank holds it. The planner (plan.h) makes it from its decisions; the state store
// homes each group's chunks as it says; the optimizer, the gradient reduction and the checkpoint
// writer take the groups' owners from it. Nothing else decides a home or an owner.
//
// Rows: one per parameter group and kind of state (param, grad, master, adam_m, adam_v). Groups
// are numbered as the state store numbers them: 0 the embedding, 1..L the decoder layers, L + 1
// the LM head (and final norm). The planner decides the embedding and the head together, as its
// one "edge" group.
//
// Owners: with several data-parallel ranks every group has an owner, the rank that updates it
// and writes it into checkpoints. A row that is not replicated exists on its owner only, which
// holds the byte range `owned` of the group's state of that kind (ZeRO-1 today: whole groups'
// master weights and Adam moments, [0, bytes)); a replicated row exists on every rank.
// Thread-compatible value type.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/check.h"
#include "memory/chunk.h"
#include "memory/tier.h"
#include "offload/state_layout.h"

namespace strata {

// PlacementRow::owner of a row no rank was given (one process: it owns everything).
inline constexpr int kNoOwner = -1;

struct PlacementRow {
  Tier home = Tier::kHost;
  int owner = kNoOwner;
  bool replicated = true;  // every rank holds it; false: only the owner
  uint64_t bytes = 0;      // the group's state of this kind, as the planner counts it
  ByteRange owned;         // the part of those bytes the owner holds
};

class Placement {
 public:
  Placement() = default;
  // `num_groups` groups, every row homed in host memory and replicated, no owners.
  explicit Placement(int num_groups);

  int num_groups() const { return static_cast<int>(rows_.size()); }
  const PlacementRow& row(int group, StateKind kind) const { return rows_.at(static_cast<size_t>(group))[index(kind)]; }
  PlacementRow& row(int group, StateKind kind) { return rows_.at(static_cast<size_t>(group))[index(kind)]; }
  Tier home(int group, StateKind kind) const { return row(group, kind).home; }

  // Sets the home of `kind` in `group` and that it is `bytes` large.
  void place(int group, StateKind kind, Tier home, uint64_t bytes);

  // The rank that updates group g and writes it into checkpoints; kNoOwner without ranks.
  int owner(int group) const { return row(group, StateKind::kAdamM).owner; }
  // Every group's owner, in group order.
  std::vector<int> owners() const;
  // Whether rank `rank` holds `kind` of group g.
  bool holds(int rank, int group, StateKind kind) const {
    const PlacementRow& r = row(group, kind);
    return r.replicated || r.owner == rank;
  }
  // Whether some row exists on its owner only (the optimizer state is sharded over the ranks).
  bool sharded() const;

  // Gives each group an owner among `world` ranks: the groups, largest (`group_elements`) first,
  // each to the rank that owns the fewest elements so far (the lowest such rank on a tie). With
  // shard_optimizer the master weights and Adam moments then live on their group's owner only,
  // whole ([0, bytes)); otherwise every rank keeps every row and the owners only write
  // checkpoints. REQUIRES: group_elements.size() == num_groups(), world >= 1.
  void assign_owners(std::span<const uint64_t> group_elements, int world, bool shard_optimizer);

 private:
  static size_t index(StateKind kind) {
    const size_t k = static_cast<size_t>(kind);
    CHECK_MSG(k < kNumStateKinds, "activations have no row in the placement");
    return k;
  }
  std::vector<std::array<PlacementRow, kNumStateKinds>> rows_;  // per group, per kind
};

}  // namespace strata
