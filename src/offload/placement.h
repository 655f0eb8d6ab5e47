// Placement: the one table of where each parameter group's training state lives and how it is
// shared out over the data-parallel ranks. The planner (plan.h) makes it from its decisions; the
// state store homes each group's chunks as it says; the optimizer, the gradient reduction and
// the checkpoint writer take each rank's ranges from it. Nothing else decides a home or a share.
//
// Rows: one per parameter group and kind of state (param, grad, master, adam_m, adam_v). Groups
// are numbered as the state store numbers them: 0 the embedding, 1..L the decoder layers, L + 1
// the LM head (and final norm). The planner decides the embedding and the head together, as its
// one "edge" group.
//
// Parts: a group may have parts with chunks of their own (StateTensor::part: each expert of an
// MoE layer). A part may have rows of its own (place_part): its chunks are then homed there,
// while the group's row homes its dense part and every part without rows. A part too small to
// open a chunk of its own starts in the chunk before it, with that chunk's home (a chunk it
// opens further on takes its own row's). The bytes
// of a group's row are the whole group's; a part's row counts the chunks it opens.
//
// Sharding: with several data-parallel ranks each rank owns a contiguous range of the elements
// of every tensor (tensor_shard): it writes those into checkpoints and, for a row that is
// `sliced`, holds that kind of state for its ranges only (ZeRO-1: the master weights and Adam
// moments), updates them and sends the other ranks its part of the new compute copy. So every
// rank's share is 1/W of every group, whatever the layer count. A row that is not sliced exists
// whole on every rank. Thread-compatible value type.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/check.h"
#include "memory/chunk.h"
#include "memory/tier.h"
#include "offload/state_layout.h"

namespace strata {

struct PlacementRow {
  Tier home = Tier::kHost;
  bool sliced = false;  // each rank holds its element ranges of it; false: every rank holds it whole
  uint64_t bytes = 0;   // the group's state of this kind, as the planner counts it
};

// Elements of a data-parallel shard: whole blocks of kernels::kMomentBlock, so that compact
// moments (kernels/moments.h) of a rank's range are the blocks of the whole tensor's encoding.
inline constexpr uint64_t kShardUnit = 256;

// The range of a tensor of `shape` (the `index`-th of the model's tensors) that rank `rank` of
// `world` owns: equal contiguous parts in whole kShardUnit blocks, in rank order (the last rank's
// is the largest and ends at the tensor's end). A tensor of fewer blocks than ranks (a norm) is
// owned by consecutive ranks from index % world on, one block each, so that such tensors spread
// over the ranks; the others' ranges are empty. The fp8 recipe's quantised matrices are not split,
// as their block scales need whole 128 x 128 blocks: each is owned whole, by rank index % world.
// The ranges of all ranks partition the tensor. REQUIRES: 0 <= rank < world.
ElementRange tensor_shard(const StateLayout& layout, const StateShape& shape, size_t index, int rank, int world);

class Placement {
 public:
  Placement() = default;
  // `num_groups` groups, every row homed in host memory and whole, one rank.
  explicit Placement(int num_groups);

  int num_groups() const { return static_cast<int>(rows_.size()); }
  const PlacementRow& row(int group, StateKind kind) const { return rows_.at(static_cast<size_t>(group))[index(kind)]; }
  PlacementRow& row(int group, StateKind kind) { return rows_.at(static_cast<size_t>(group))[index(kind)]; }
  Tier home(int group, StateKind kind) const { return row(group, kind).home; }
  // The home of part `part` of a group (kDensePart, or an expert's index): its own row's when it
  // has rows, else the group's.
  Tier home(int group, StateKind kind, int part) const;

  // Sets the home of `kind` in `group` and that it is `bytes` large.
  void place(int group, StateKind kind, Tier home, uint64_t bytes);
  // Gives part `part` (>= 0) of a group a row of its own for `kind`: its chunks are homed at
  // `home` and take `bytes`. Its other kinds keep the group's home until placed.
  void place_part(int group, int part, StateKind kind, Tier home, uint64_t bytes);
  // The parts of `group` with rows of their own, ascending, and a part's row of a kind (the
  // group's when the part was not placed for that kind).
  std::vector<int> parts(int group) const;
  const PlacementRow& part_row(int group, int part, StateKind kind) const;

  // The data-parallel ranks the tensors' element ranges are shared out over (1: one process).
  int world() const { return world_; }
  // Whether `kind` of group g is held as each rank's element ranges only.
  bool sliced(int group, StateKind kind) const { return row(group, kind).sliced; }
  // Whether some row is sliced (the optimizer state is sharded over the ranks).
  bool sharded() const;

  // Shares the tensors out over `world` ranks (tensor_shard) at ZeRO level `zero`: from 1 the
  // master weights and Adam moments are sliced (each rank holds them for its ranges only), from
  // 2 the gradients too (each rank keeps the sums of its ranges; backward's full gradients live
  // in a working buffer beside the chunks until they are summed onto their ranks), at 3 the
  // compute copy too (gathered from the ranks for each batch of compute); at 0 every rank keeps
  // every row whole and the ranges only say what each rank writes into checkpoints.
  // REQUIRES: world >= 1, 0 <= zero <= 3.
  void shard_over(int world, int zero);

  // Chunks of the offloaded saved activations homed in host memory, the rest on NVMe
  // (StateStore::add_activations); -1: as many as the host tier holds.
  int64_t activation_host_chunks() const { return activation_host_chunks_; }
  void set_activation_host_chunks(int64_t chunks) { activation_host_chunks_ = chunks; }

 private:
  static size_t index(StateKind kind) {
    const size_t k = static_cast<size_t>(kind);
    CHECK_MSG(k < kNumStateKinds, "activations have no row in the placement");
    return k;
  }
  using Rows = std::array<PlacementRow, kNumStateKinds>;
  struct PartRows {
    int part = 0;
    Rows rows;
    std::array<bool, kNumStateKinds> placed{};  // kinds place_part() set; others follow the group
  };
  const PartRows* find_part(int group, int part) const;
  std::vector<Rows> rows_;                    // per group, per kind
  std::vector<std::vector<PartRows>> parts_;  // per group, ascending by part
  int world_ = 1;
  int64_t activation_host_chunks_ = -1;
};

}  // namespace strata
