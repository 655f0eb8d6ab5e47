#include "memory/chunk.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "test_util.h"

namespace strata {
namespace {

TEST(ChunkLayoutTest, RejectsChunkSizesThatAreNotMultiplesOf4KiB) {
  EXPECT_FALSE(ChunkLayout::create(0).ok());
  EXPECT_FALSE(ChunkLayout::create(4096 + 256).ok());
  EXPECT_TRUE(ChunkLayout::create(64 * kKiB).ok());
}

TEST(ChunkLayoutTest, PacksInOrderAtAlignedOffsetsWithoutSplitting) {
  ChunkLayout layout = ChunkLayout::create(16 * kKiB).value();
  const TensorId a = layout.add("a", ChunkKind::kParam, 1000).value();
  const TensorId b = layout.add("b", ChunkKind::kParam, 3000).value();
  const TensorId c = layout.add("c", ChunkKind::kParam, 13 * kKiB).value();  // does not fit
  const TensorId d = layout.add("d", ChunkKind::kParam, 100).value();
  EXPECT_EQ(layout.tensor(a).chunk, 0u);
  EXPECT_EQ(layout.tensor(a).offset, 0u);
  EXPECT_EQ(layout.tensor(b).chunk, 0u);
  EXPECT_EQ(layout.tensor(b).offset, 1024u);  // 1000 rounded up to 256
  EXPECT_EQ(layout.tensor(c).chunk, 1u);
  EXPECT_EQ(layout.tensor(c).offset, 0u);
  EXPECT_EQ(layout.tensor(d).chunk, 1u);
  EXPECT_EQ(layout.tensor(d).offset, 13 * kKiB);
  for (TensorId t = 0; t < layout.num_tensors(); ++t) {
    const TensorPlacement& p = layout.tensor(t);
    EXPECT_EQ(p.offset % kTensorAlignment, 0u) << p.name;
    EXPECT_LE(p.offset + p.bytes, layout.chunk_bytes()) << p.name;
  }
  EXPECT_EQ(layout.num_chunks(), 2u);
  EXPECT_EQ(layout.padding_bytes(), 2 * 16 * kKiB - (1000 + 3000 + 13 * kKiB + 100));
  EXPECT_EQ(layout.find("c"), c);
  EXPECT_FALSE(layout.find("nope").has_value());
}

TEST(ChunkLayoutTest, KindsGetTheirOwnChunks) {
  ChunkLayout layout = ChunkLayout::create(16 * kKiB).value();
  const TensorId p0 = layout.add("p0", ChunkKind::kParam, 1000).value();
  const TensorId g0 = layout.add("g0", ChunkKind::kGrad, 1000).value();
  const TensorId p1 = layout.add("p1", ChunkKind::kParam, 1000).value();
  const TensorId m0 = layout.add("m0", ChunkKind::kAdamM, 1000).value();
  EXPECT_EQ(layout.tensor(p0).chunk, layout.tensor(p1).chunk);
  EXPECT_NE(layout.tensor(p0).chunk, layout.tensor(g0).chunk);
  EXPECT_NE(layout.tensor(g0).chunk, layout.tensor(m0).chunk);
  EXPECT_EQ(layout.chunk(layout.tensor(g0).chunk).kind, ChunkKind::kGrad);
  EXPECT_EQ(layout.chunk(layout.tensor(m0).chunk).kind, ChunkKind::kAdamM);
  EXPECT_EQ(layout.num_chunks(), 3u);
  EXPECT_STREQ(chunk_kind_name(ChunkKind::kAdamV), "adam_v");
}

TEST(ChunkLayoutTest, TensorLargerThanAChunkIsAnErrorNamingTheSizeNeeded) {
  ChunkLayout layout = ChunkLayout::create(64 * kKiB).value();
  Result<TensorId> r = layout.add("model.embed_tokens.weight", ChunkKind::kParam, 100 * kKiB + 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("model.embed_tokens.weight"), std::string::npos);
  EXPECT_NE(r.status().message().find("104.00 KiB"), std::string::npos)  // 100 KiB + 1, to 4 KiB
      << r.status().message();
  EXPECT_EQ(layout.num_chunks(), 0u);
}

TEST(ChunkLayoutTest, DuplicateNamesAreRejected) {
  ChunkLayout layout = ChunkLayout::create(64 * kKiB).value();
  ASSERT_TRUE(layout.add("w", ChunkKind::kParam, 10).ok());
  EXPECT_FALSE(layout.add("w", ChunkKind::kGrad, 10).ok());
}

TEST(OwnedRangeTest, RanksPartitionTheChunk) {
  for (uint64_t chunk : {uint64_t{4096}, uint64_t{64 * kKiB}, uint64_t{12 * kKiB}}) {
    for (int world : {1, 2, 3, 4, 7, 8, 64}) {
      uint64_t expected_begin = 0;
      for (int rank = 0; rank < world; ++rank) {
        const ByteRange r = owned_range(chunk, rank, world);
        EXPECT_EQ(r.begin, expected_begin) << chunk << " " << world << " " << rank;
        EXPECT_LE(r.begin, r.end);
        if (r.end < chunk) {
          EXPECT_EQ(r.size() % kTensorAlignment, 0u);
        }
        expected_begin = r.end;
      }
      EXPECT_EQ(expected_begin, chunk) << chunk << " " << world;
    }
  }
  EXPECT_EQ(owned_range(64 * kKiB, 0, 1), (ByteRange{0, 64 * kKiB}));
  EXPECT_EQ(owned_range(64 * kKiB, 1, 4), (ByteRange{16 * kKiB, 32 * kKiB}));
}

// Padding of packing `sizes` into chunks of `chunk`, written independently of pack_tensors.
uint64_t brute_force_padding(const std::vector<uint64_t>& sizes, uint64_t chunk) {
  std::vector<uint64_t> fill;  // bytes used per chunk
  uint64_t total = 0;
  for (uint64_t s : sizes) {
    const uint64_t aligned = fill.empty() ? 0 : (fill.back() + 255) / 256 * 256;
    if (fill.empty() || aligned + s > chunk) {
      fill.push_back(s);
    } else {
      fill.back() = aligned + s;
    }
    total += s;
  }
  return fill.size() * chunk - total;
}

TEST(ChooseChunkSizeTest, PicksTheLeastPaddingLikeABruteForceSearch) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<uint64_t> sizes(20 + rng() % 40);
    for (uint64_t& s : sizes) s = 1 + rng() % (200 * kKiB);
    const std::vector<uint64_t> candidates = chunk_size_candidates(sizes, 1 * kMiB);
    ASSERT_FALSE(candidates.empty());
    const ChunkSizeChoice choice = choose_chunk_size(sizes, candidates).value();

    uint64_t best_size = 0, best_padding = UINT64_MAX;
    uint64_t largest = 0;
    for (uint64_t s : sizes) largest = std::max(largest, s);
    for (uint64_t size = 4096; size <= 1 * kMiB; size += 4096) {
      if (size < largest) continue;
      const uint64_t padding = brute_force_padding(sizes, size);
      if (padding < best_padding) {
        best_padding = padding;
        best_size = size;
      }
    }
    EXPECT_EQ(choice.chunk_bytes, best_size) << "trial " << trial;
    EXPECT_EQ(choice.padding_bytes, best_padding) << "trial " << trial;
    EXPECT_EQ(choice.chunk_bytes % kChunkAlignment, 0u);
    EXPECT_EQ(choice.num_chunks * choice.chunk_bytes - choice.padding_bytes,
              [&] { uint64_t t = 0; for (uint64_t s : sizes) t += s; return t; }());
  }
}

TEST(ChooseChunkSizeTest, ExactFitWinsOverLargerChunks) {
  // Eight tensors of 60 KiB: a 120 KiB chunk holds two with no padding (60 KiB is a multiple
  // of 256, so the second starts right after the first).
  const std::vector<uint64_t> sizes(8, 60 * kKiB);
  const std::vector<uint64_t> candidates = {64 * kKiB, 120 * kKiB, 128 * kKiB, 256 * kKiB};
  const ChunkSizeChoice choice = choose_chunk_size(sizes, candidates).value();
  EXPECT_EQ(choice.chunk_bytes, 120 * kKiB);
  EXPECT_EQ(choice.padding_bytes, 0u);
  EXPECT_EQ(choice.num_chunks, 4u);
}

TEST(ChooseChunkSizeTest, RejectsBadCandidatesAndTensorsLargerThanAll) {
  const std::vector<uint64_t> sizes = {10 * kKiB, 300 * kKiB};
  const std::vector<uint64_t> small = {64 * kKiB, 128 * kKiB};
  Result<ChunkSizeChoice> r = choose_chunk_size(sizes, small);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("300.00 KiB"), std::string::npos) << r.status().message();
  const std::vector<uint64_t> unaligned = {512 * kKiB + 100};
  EXPECT_FALSE(choose_chunk_size(sizes, unaligned).ok());
  EXPECT_EQ(chunk_size_candidates(sizes, 256 * kKiB).size(), 0u);
  EXPECT_EQ(chunk_size_candidates(sizes, 312 * kKiB).front(), 300 * kKiB);
}

}  // namespace
}  // namespace strata
