// Chunk sizes of the CUDA LM head (kernels/lm_head_chunks.h): the weight-gradient GEMM runs on
// thousands of tokens, or once per micro-batch when the micro-batch is smaller, and a chunk
// never outgrows the scratch it is given.
#include "kernels/lm_head_chunks.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace strata::kernels {
namespace {

int64_t chunks_of(int64_t N, int64_t chunk) { return (N + chunk - 1) / chunk; }

// The most tokens whose chunk fits `scratch`, by counting up (small shapes only).
int64_t most_tokens_that_fit(int64_t C, int64_t V, uint64_t scratch) {
  int64_t t = 0;
  while (lm_head_chunk_bytes(C, V, t + 1, true) <= scratch) ++t;
  return t;
}

TEST(LmHeadChunks, BytesAreTheAlignedLogitsAndGradientAndTheBlockedDxSum) {
  // 3 x 1000 cells: 12000 fp32 bytes (47 x 256 = 12032) and 6000 bf16 bytes (24 x 256 = 6144).
  EXPECT_EQ(lm_head_chunk_bytes(64, 1000, 3, false), 12032u + 6144u);
  EXPECT_EQ(lm_head_chunk_bytes(64, 1000, 3, true), 12032u + 6144u + 3u * 64u * 4u);
  EXPECT_EQ(lm_head_chunk_bytes(64, 1000, 0, true), 0u);
}

TEST(LmHeadChunks, AMicroBatchThatFitsIsOneChunk) {
  EXPECT_EQ(lm_head_chunk_tokens(1000, 4096, 32000, lm_head_device_scratch_bytes(1000, 4096, 32000)), 1000);
  EXPECT_EQ(lm_head_chunk_tokens(1, 64, 100, lm_head_chunk_bytes(64, 100, 1, true)), 1);
}

TEST(LmHeadChunks, LargeVocabulariesGetThousandsOfTokensWithinTheScratchCap) {
  struct Case {
    int64_t C, V;
  };
  // Llama 2 (32K), Llama 3 (128K), Qwen 2.5 (152K), Gemma-sized (256K) vocabularies.
  for (const Case& c : {Case{4096, 32000}, Case{4096, 128256}, Case{3584, 152064}, Case{2304, 256000}}) {
    const int64_t N = 16384;
    const uint64_t scratch = lm_head_device_scratch_bytes(N, c.C, c.V);
    EXPECT_LE(scratch, kLmHeadMaxScratchBytes) << "V=" << c.V;
    const int64_t chunk = lm_head_chunk_tokens(N, c.C, c.V, scratch);
    EXPECT_LE(lm_head_chunk_bytes(c.C, c.V, chunk, true), scratch) << "V=" << c.V;
    EXPECT_LE(chunk, kLmHeadTargetChunkTokens) << "V=" << c.V;
    // 2 GiB holds 1365 tokens of a 256K vocabulary; every smaller one gets 2K or more.
    EXPECT_GE(chunk, c.V <= 152064 ? 2048 : 1024) << "V=" << c.V;
  }
  // A 32K vocabulary gets the whole target: 4 chunks of 4096 tokens.
  EXPECT_EQ(lm_head_chunk_tokens(16384, 4096, 32000, lm_head_device_scratch_bytes(16384, 4096, 32000)), 4096);
}

TEST(LmHeadChunks, TheFewestChunksThatFitEvenedOut) {
  const int64_t C = 16, V = 100;
  for (uint64_t scratch : {uint64_t{5000}, uint64_t{60000}, uint64_t{200000}, uint64_t{1} << 20}) {
    const int64_t cap = most_tokens_that_fit(C, V, scratch);
    ASSERT_GE(cap, 1);
    for (int64_t N : {int64_t{1}, int64_t{7}, int64_t{64}, int64_t{65}, int64_t{300}, int64_t{1000}, int64_t{4097}}) {
      const int64_t chunk = lm_head_chunk_tokens(N, C, V, scratch);
      const std::string what = "N=" + std::to_string(N) + " scratch=" + std::to_string(scratch);
      EXPECT_GE(chunk, 1) << what;
      EXPECT_LE(chunk, N) << what;
      EXPECT_LE(chunk, cap) << what;
      EXPECT_EQ(chunks_of(N, chunk), chunks_of(N, cap)) << what;  // no more chunks than needed
    }
  }
  // 4000 tokens where 3000 fit: two chunks of 2048 and 1952, not 3000 and 1000.
  const uint64_t scratch = lm_head_chunk_bytes(C, V, 3000, true);
  EXPECT_EQ(lm_head_chunk_tokens(4000, C, V, scratch), 2048);
}

TEST(LmHeadChunks, AScratchTooSmallForOneTokenStillAsksForOne) {
  // The op then refuses with the scratch's message; the sizing never returns 0.
  EXPECT_EQ(lm_head_chunk_tokens(100, 64, 1000, 100), 1);
}

}  // namespace
}  // namespace strata::kernels
