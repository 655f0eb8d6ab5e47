#include "offload/placement.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "offload/state_store.h"

namespace strata {
namespace {

// Every rank's range of a tensor, in rank order.
std::vector<ElementRange> ranges(const StateLayout& layout, const StateShape& shape, size_t index, int world) {
  std::vector<ElementRange> out;
  for (int r = 0; r < world; ++r) out.push_back(tensor_shard(layout, shape, index, r, world));
  return out;
}

// The ranges of the ranks partition the tensor, in order and without holes, for sizes around
// the shard unit and worlds up to 8.
TEST(TensorShard, TheRanksRangesPartitionEveryTensor) {
  const StateLayout layout = StateLayout::of(Precision::kBf16);
  for (uint64_t n : {1ull, 255ull, 256ull, 257ull, 1000ull, 4096ull, 65537ull}) {
    for (int world = 1; world <= 8; ++world) {
      uint64_t next = 0;
      for (const ElementRange& r : ranges(layout, {n, 0}, 3, world)) {
        EXPECT_EQ(r.first, next) << "n " << n << " world " << world;
        // Every range but those at the end of the tensor starts and ends on a whole shard unit.
        if (r.first != n) EXPECT_EQ(r.first % kShardUnit, 0u);
        if (r.end() != n) EXPECT_EQ(r.end() % kShardUnit, 0u);
        next = r.end();
      }
      EXPECT_EQ(next, n) << "n " << n << " world " << world;
    }
  }
}

// The shares are even: they differ by less than two shard units (one left over after the even
// split, and the tensor's last, partial one), and the last rank's is the largest.
TEST(TensorShard, SharesDifferByAtMostOneUnit) {
  const StateLayout layout = StateLayout::of(Precision::kFp32);
  const uint64_t n = 4096 * 11 + 100;
  for (int world : {2, 3, 4, 7}) {
    uint64_t lo = UINT64_MAX, hi = 0;
    const std::vector<ElementRange> rs = ranges(layout, {n, 0}, 0, world);
    for (const ElementRange& r : rs) lo = std::min(lo, r.count), hi = std::max(hi, r.count);
    EXPECT_LT(hi - lo, 2 * kShardUnit) << "world " << world;
    if (n % kShardUnit == 0) EXPECT_EQ(rs.back().count, hi) << "world " << world;
  }
  // A tensor of one unit goes to one rank, the index % world-th; the others' ranges are empty.
  for (size_t index = 0; index < 8; ++index) {
    const std::vector<ElementRange> small = ranges(layout, {64, 0}, index, 4);
    for (size_t r = 0; r < small.size(); ++r) EXPECT_EQ(small[r].count, r == index % 4 ? 64u : 0u) << index;
  }
}

// Tensors of fewer shard units than ranks spread over the ranks: 48 layers of two 64-element
// norms and matrices of whole multiples of 4 units give each of 4 ranks the same elements (all
// on the last rank, it held 6144 more).
TEST(TensorShard, TensorsSmallerThanTheWorldSpreadOverTheRanks) {
  const StateLayout layout = StateLayout::of(Precision::kFp32);
  const std::vector<uint64_t> layer = {64, 8 * kShardUnit, 12 * kShardUnit, 64, 16 * kShardUnit};
  std::vector<uint64_t> held(4, 0);
  size_t index = 0;
  for (int l = 0; l < 48; ++l)
    for (uint64_t n : layer) {
      const std::vector<ElementRange> rs = ranges(layout, {n, 0}, index++, 4);
      for (size_t r = 0; r < 4; ++r) held[r] += rs[r].count;
    }
  EXPECT_EQ(held, std::vector<uint64_t>(4, held[0]));
  // A tensor of 2 units over 4 ranks: ranks index % 4 and the next, the last one at most.
  EXPECT_EQ(ranges(layout, {2 * kShardUnit, 0}, 1, 4),
            (std::vector<ElementRange>{{0, 0}, {0, kShardUnit}, {kShardUnit, kShardUnit}, {2 * kShardUnit, 0}}));
  EXPECT_EQ(ranges(layout, {2 * kShardUnit, 0}, 3, 4),
            (std::vector<ElementRange>{{0, 0}, {0, 0}, {0, kShardUnit}, {kShardUnit, kShardUnit}}));
}

// The fp8 recipe's quantised matrices are owned whole, by tensor index modulo the world; other
// tensors of that recipe are split as in any other.
TEST(TensorShard, QuantisedMatricesAreOwnedWhole) {
  const StateLayout layout = StateLayout::of(Precision::kFp8);
  const StateShape matrix{256 * 128, 256};
  for (size_t index = 0; index < 6; ++index) {
    for (int r = 0; r < 3; ++r) {
      const ElementRange got = tensor_shard(layout, matrix, index, r, 3);
      if (static_cast<int>(index % 3) == r) EXPECT_EQ(got, (ElementRange{0, matrix.elements}));
      else EXPECT_EQ(got.count, 0u);
    }
  }
  // A matrix in the bf16 recipe is not quantised: it is split.
  EXPECT_EQ(tensor_shard(StateLayout::of(Precision::kBf16), matrix, 0, 1, 2), (ElementRange{16384, 16384}));
}

TEST(Placement, ShardingTheOptimizerSlicesItsKindsOnly) {
  Placement placement(3);
  placement.place(1, StateKind::kAdamM, Tier::kNvme, 4096);
  placement.shard_over(4, /*zero=*/1);
  EXPECT_EQ(placement.world(), 4);
  EXPECT_TRUE(placement.sharded());
  for (int g = 0; g < 3; ++g) {
    EXPECT_FALSE(placement.sliced(g, StateKind::kParam));  // the compute copy is everyone's
    EXPECT_FALSE(placement.sliced(g, StateKind::kGrad));
    EXPECT_TRUE(placement.sliced(g, StateKind::kMaster));
    EXPECT_TRUE(placement.sliced(g, StateKind::kAdamM));
    EXPECT_TRUE(placement.sliced(g, StateKind::kAdamV));
  }
  EXPECT_EQ(placement.home(1, StateKind::kAdamM), Tier::kNvme);
}

TEST(Placement, ZeroTwoSlicesTheGradientsAndZeroThreeTheComputeCopyToo) {
  Placement placement(3);
  placement.shard_over(2, /*zero=*/2);
  for (int g = 0; g < 3; ++g) {
    EXPECT_FALSE(placement.sliced(g, StateKind::kParam));
    for (StateKind k : {StateKind::kGrad, StateKind::kMaster, StateKind::kAdamM, StateKind::kAdamV})
      EXPECT_TRUE(placement.sliced(g, k)) << g << " " << state_kind_name(k);
  }
  Placement one(3);
  one.shard_over(1, /*zero=*/2);
  EXPECT_FALSE(one.sliced(0, StateKind::kGrad));
  Placement three(3);
  three.shard_over(4, /*zero=*/3);
  for (int g = 0; g < 3; ++g)
    for (StateKind k : {StateKind::kParam, StateKind::kGrad, StateKind::kMaster, StateKind::kAdamM, StateKind::kAdamV})
      EXPECT_TRUE(three.sliced(g, k)) << g << " " << state_kind_name(k);
}

// A part follows its group's row for every kind until it is placed itself; its rows are shared
// out as the group's.
TEST(Placement, PartRowsFollowTheirGroupUntilPlaced) {
  Placement placement(3);
  placement.place(1, StateKind::kAdamM, Tier::kHost, 8192);
  EXPECT_TRUE(placement.parts(1).empty());
  EXPECT_EQ(placement.home(1, StateKind::kAdamM, 5), Tier::kHost);
  placement.place_part(1, 5, StateKind::kAdamM, Tier::kNvme, 1024);
  placement.place_part(1, 2, StateKind::kParam, Tier::kDevice, 512);
  EXPECT_EQ(placement.parts(1), (std::vector<int>{2, 5}));
  EXPECT_EQ(placement.home(1, StateKind::kAdamM, 5), Tier::kNvme);
  EXPECT_EQ(placement.part_row(1, 5, StateKind::kAdamM).bytes, 1024u);
  EXPECT_EQ(placement.home(1, StateKind::kAdamV, 5), Tier::kHost);  // not placed: the group's
  EXPECT_EQ(placement.home(1, StateKind::kAdamM, kDensePart), Tier::kHost);
  EXPECT_EQ(placement.home(1, StateKind::kAdamM), Tier::kHost);
  EXPECT_EQ(placement.home(1, StateKind::kParam, 2), Tier::kDevice);
  EXPECT_TRUE(placement.parts(0).empty());
  placement.shard_over(2, /*zero=*/1);
  EXPECT_TRUE(placement.part_row(1, 5, StateKind::kAdamM).sliced);
  EXPECT_FALSE(placement.part_row(1, 2, StateKind::kParam).sliced);
}

TEST(Placement, UnshardedRanksAndOneRankSliceNothing) {
  Placement zero0(3);
  zero0.shard_over(3, /*zero=*/0);
  EXPECT_EQ(zero0.world(), 3);
  EXPECT_FALSE(zero0.sharded());
  Placement one(3);
  one.shard_over(1, /*zero=*/1);  // one rank has nothing to shard
  EXPECT_FALSE(one.sharded());
  const Placement fresh(4);
  EXPECT_EQ(fresh.world(), 1);
  EXPECT_FALSE(fresh.sharded());
}

}  // namespace
}  // namespace strata
