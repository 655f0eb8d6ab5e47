#include "core/arena.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "core/units.h"

namespace strata {
namespace {

// Host backing store for arenas under test; 4 KiB aligned so offsets are predictable.
struct Backing {
  explicit Backing(uint64_t bytes) : storage(bytes + 4096) {
    auto addr = reinterpret_cast<uintptr_t>(storage.data());
    base = storage.data() + ((4096 - addr % 4096) % 4096);
  }
  std::vector<unsigned char> storage;
  unsigned char* base;
};

ArenaOptions options(std::string tier = "device (cpu:0)", uint64_t alignment = 256) {
  ArenaOptions o;
  o.tier = std::move(tier);
  o.alignment = alignment;
  return o;
}

TEST(Arena, BlocksAreAlignedAndSizesRoundUp) {
  Backing backing(64 * kKiB);
  for (uint64_t alignment : {uint64_t{64}, uint64_t{256}, uint64_t{4096}}) {
    Arena arena(backing.base, 64 * kKiB, options("device", alignment));
    std::vector<void*> blocks;
    for (uint64_t bytes : {1, 7, 100, 255, 256, 257, 1000}) {
      Result<void*> p = arena.allocate(bytes);
      ASSERT_TRUE(p.ok()) << p.status().to_string();
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p.value()) % alignment, 0u) << bytes;
      blocks.push_back(p.value());
    }
    uint64_t expected = 0;
    for (uint64_t bytes : {1, 7, 100, 255, 256, 257, 1000}) {
      expected += (bytes + alignment - 1) / alignment * alignment;
    }
    EXPECT_EQ(arena.in_use(), expected);
    for (void* p : blocks) arena.free(p);
    EXPECT_EQ(arena.in_use(), 0u);
  }
}

TEST(Arena, UnalignedRegionStartIsSkipped) {
  Backing backing(8 * kKiB);
  Arena arena(backing.base + 3, 4 * kKiB, options("device", 256));
  // 3 bytes in, the first 256-aligned address is base + 256; the end rounds down too.
  EXPECT_EQ(arena.capacity(), 4 * kKiB - 256);
  Result<void*> p = arena.allocate(1);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p.value(), backing.base + 256);
  arena.free(p.value());
}

TEST(Arena, FreedNeighboursCoalesceIntoOneBlock) {
  Backing backing(4 * kKiB);
  Arena arena(backing.base, 4 * kKiB, options());
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) {
    Result<void*> p = arena.allocate(256);
    ASSERT_TRUE(p.ok());
    blocks.push_back(p.value());
  }
  EXPECT_EQ(arena.largest_free_block(), 0u);
  EXPECT_FALSE(arena.allocate(1).ok());
  // Free every other block: 8 holes of 256 bytes, none adjacent.
  for (int i = 0; i < 16; i += 2) arena.free(blocks[i]);
  EXPECT_EQ(arena.largest_free_block(), 256u);
  Result<void*> too_big = arena.allocate(512);
  ASSERT_FALSE(too_big.ok());
  EXPECT_NE(too_big.status().message().find("fragmented"), std::string::npos)
      << too_big.status().message();
  // Freeing the rest, in an order that merges left, right and both sides, leaves one block.
  for (int i : {1, 15, 7, 5, 3, 9, 13, 11}) arena.free(blocks[i]);
  EXPECT_EQ(arena.in_use(), 0u);
  EXPECT_EQ(arena.largest_free_block(), 4 * kKiB);
  Result<void*> whole = arena.allocate(4 * kKiB);
  ASSERT_TRUE(whole.ok()) << whole.status().to_string();
  EXPECT_EQ(whole.value(), backing.base);
  arena.free(whole.value());
}

TEST(Arena, BestFitPicksTheSmallestHoleThatFits) {
  Backing backing(8 * kKiB);
  Arena arena(backing.base, 8 * kKiB, options());
  void* a = arena.allocate(1024).value();  // [0, 1024)
  void* b = arena.allocate(256).value();   // [1024, 1280) keeps a and c apart
  void* c = arena.allocate(512).value();   // [1280, 1792)
  void* d = arena.allocate(256).value();   // [1792, 2048) keeps c apart from the tail
  arena.free(a);
  arena.free(c);
  // Holes: 1024 at 0, 512 at 1280, the tail at 2048. A 512 request takes the exact fit.
  void* e = arena.allocate(512).value();
  EXPECT_EQ(e, c);
  arena.free(b);
  arena.free(d);
  arena.free(e);
  EXPECT_EQ(arena.largest_free_block(), 8 * kKiB);
}

TEST(Arena, ExhaustionNamesTierRequestBudgetAndUse) {
  Backing backing(4 * kMiB);
  ArenaOptions o = options("device (cpu:0)");
  o.advice = "raise memory.device or lower the micro-batch";
  Arena arena(backing.base, 4 * kMiB, o);
  void* p = arena.allocate(3 * kMiB).value();
  Result<void*> r = arena.allocate(3 * kMiB / 2);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(r.status().message(),
            "tier 'device (cpu:0)' cannot allocate 1.50 MiB: 3.00 MiB of its 4.00 MiB budget in "
            "use; raise memory.device or lower the micro-batch");
  arena.free(p);
}

TEST(Arena, TracksPeakUse) {
  Backing backing(64 * kKiB);
  Arena arena(backing.base, 64 * kKiB, options());
  void* a = arena.allocate(10 * kKiB).value();
  void* b = arena.allocate(20 * kKiB).value();
  arena.free(a);
  EXPECT_EQ(arena.in_use(), 20 * kKiB);
  EXPECT_EQ(arena.peak(), 30 * kKiB);
  arena.reset_peak();
  EXPECT_EQ(arena.peak(), 20 * kKiB);
  arena.free(b);
  EXPECT_EQ(arena.live_blocks(), 0u);
}

TEST(ArenaDeathTest, DoubleFreeAborts) {
  Backing backing(4 * kKiB);
  EXPECT_DEATH(
      {
        Arena arena(backing.base, 4 * kKiB, options());
        void* p = arena.allocate(10).value();
        arena.free(p);
        arena.free(p);
      },
      "not live");
}

// Randomized: every live block is filled with its own pattern; after each step all live
// blocks must still hold theirs, which fails if any two blocks ever overlap.
void stress(Arena& arena, unsigned char* lo, unsigned char* hi, uint64_t seed, int steps) {
  struct Live {
    unsigned char* p;
    uint64_t size;
    unsigned char tag;
  };
  std::mt19937_64 rng(seed);
  std::vector<Live> live;
  int failures = 0;
  for (int step = 0; step < steps; ++step) {
    const bool do_alloc = live.empty() || rng() % 100 < 55;
    if (do_alloc) {
      const uint64_t size = 1 + rng() % (rng() % 8 == 0 ? 16 * kKiB : 1024);
      Result<void*> r = arena.allocate(size);
      if (!r.ok()) {
        ASSERT_EQ(r.status().code(), StatusCode::kOutOfMemory);
        continue;
      }
      auto* p = static_cast<unsigned char*>(r.value());
      ASSERT_GE(p, lo);
      ASSERT_LE(p + size, hi);
      ASSERT_EQ(reinterpret_cast<uintptr_t>(p) % arena.alignment(), 0u);
      const auto tag = static_cast<unsigned char>(rng());
      std::memset(p, tag, size);
      live.push_back({p, size, tag});
    } else {
      const size_t i = rng() % live.size();
      arena.free(live[i].p);
      live[i] = live.back();
      live.pop_back();
    }
    if (step % 64 == 0 || step == steps - 1) {
      for (const Live& l : live) {
        for (uint64_t k = 0; k < l.size; ++k) {
          if (l.p[k] != l.tag) {
            ++failures;
            break;
          }
        }
      }
      ASSERT_EQ(failures, 0) << "blocks overlap by step " << step;
    }
  }
  for (const Live& l : live) arena.free(l.p);
}

TEST(Arena, RandomizedAllocFreeNeverOverlaps) {
  Backing backing(256 * kKiB);
  Arena arena(backing.base, 256 * kKiB, options());
  stress(arena, backing.base, backing.base + 256 * kKiB, 12345, 20000);
  EXPECT_EQ(arena.in_use(), 0u);
  // With everything freed, the region must have coalesced back into one block.
  EXPECT_EQ(arena.largest_free_block(), arena.capacity());
}

TEST(Arena, ConcurrentAllocFreeNeverOverlaps) {
  Backing backing(1 * kMiB);
  Arena arena(backing.base, 1 * kMiB, options());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back(
        [&, t] { stress(arena, backing.base, backing.base + 1 * kMiB, 1000 + t, 5000); });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(arena.in_use(), 0u);
  EXPECT_EQ(arena.largest_free_block(), arena.capacity());
}

}  // namespace
}  // namespace strata
