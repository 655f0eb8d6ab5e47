#include "offload/placement.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace strata {
namespace {

TEST(PlacementOwners, LargestGroupsGoFirstToTheLeastLoadedRank) {
  Placement placement(5);
  const std::vector<uint64_t> elements = {40, 10, 10, 10, 40};
  placement.assign_owners(elements, 2, /*shard_optimizer=*/true);
  // 40 -> rank 0, 40 -> rank 1, then the 10s to the lower rank on each tie.
  EXPECT_EQ(placement.owners(), (std::vector<int>{0, 0, 1, 0, 1}));
  EXPECT_TRUE(placement.sharded());
  EXPECT_TRUE(placement.holds(1, 0, StateKind::kParam));  // the compute copy is everyone's
  EXPECT_TRUE(placement.holds(1, 0, StateKind::kGrad));
  EXPECT_FALSE(placement.holds(1, 0, StateKind::kAdamM));  // the moments only the owner's
  EXPECT_TRUE(placement.holds(0, 0, StateKind::kAdamV));
}

TEST(PlacementOwners, UnshardedOwnersOnlyNameTheWriterOfEachGroup) {
  Placement placement(3);
  placement.place(1, StateKind::kAdamM, Tier::kNvme, 4096);
  placement.assign_owners(std::vector<uint64_t>{1, 2, 3}, 3, /*shard_optimizer=*/false);
  EXPECT_EQ(placement.owners(), (std::vector<int>{2, 1, 0}));
  EXPECT_FALSE(placement.sharded());
  for (int rank = 0; rank < 3; ++rank) EXPECT_TRUE(placement.holds(rank, 1, StateKind::kAdamM));
  EXPECT_EQ(placement.home(1, StateKind::kAdamM), Tier::kNvme);
  EXPECT_EQ(placement.row(1, StateKind::kAdamM).owned, (ByteRange{0, 4096}));
}

TEST(PlacementOwners, OneRankOwnsNothingAndHoldsEverything) {
  const Placement placement(4);
  EXPECT_EQ(placement.owner(2), kNoOwner);
  EXPECT_FALSE(placement.sharded());
  EXPECT_TRUE(placement.holds(0, 2, StateKind::kMaster));
}

}  // namespace
}  // namespace strata
