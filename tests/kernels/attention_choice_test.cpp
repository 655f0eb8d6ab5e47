// Which attention implementation serves a case, over a fake table of machines; and the block
// order of the causal attention kernels.
#include "kernels/attention_choice.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kernels/attention_schedule.h"

namespace strata::kernels {
namespace {

constexpr AttentionCapability kHopperCudnn919{9, 0, 91900};
constexpr AttentionCapability kHopperCudnn911{9, 0, 91100};
constexpr AttentionCapability kHopperNoCudnn{9, 0, 0};
constexpr AttentionCapability kAmpereCudnn{8, 0, 91900};
constexpr AttentionCapability kAdaCudnn{8, 9, 90500};
constexpr AttentionCapability kBlackwellCudnn{10, 0, 91900};
constexpr AttentionCapability kHopperCudnn910{9, 0, 91000};
constexpr AttentionCapability kTuring{7, 5, 91900};

AttentionCase llama(int64_t d, int64_t hq = 32, int64_t hkv = 8, int64_t T = 2048) {
  AttentionCase c;
  c.d_qk = d;
  c.d_v = d;
  c.hq = hq;
  c.hkv = hkv;
  c.seq_len = T;
  return c;
}

AttentionCase split_192_128() {
  AttentionCase c = llama(192, 16, 16);
  c.d_v = 128;
  return c;
}

bool mentions(const AttentionChoice& choice, const std::string& text) {
  return choice.reason.find(text) != std::string::npos;
}

TEST(AttentionChoice, HopperWithCudnnTakesCudnnForHeadDims64And128) {
  for (int64_t d : {64, 128}) {
    const AttentionChoice c = choose_attention(kHopperCudnn919, llama(d), AttentionForce::kAuto);
    EXPECT_EQ(c.impl, AttentionImpl::kCudnn) << d << ": " << c.reason;
    EXPECT_TRUE(mentions(c, "9.19.0")) << c.reason;
    EXPECT_TRUE(mentions(c, "sm_90")) << c.reason;
  }
}

TEST(AttentionChoice, AmpereWithCudnnTakesCudnnUpTo128) {
  EXPECT_EQ(choose_attention(kAmpereCudnn, llama(128), AttentionForce::kAuto).impl,
            AttentionImpl::kCudnn);
  EXPECT_EQ(choose_attention(kAdaCudnn, llama(64, 8, 1), AttentionForce::kAuto).impl,
            AttentionImpl::kCudnn);
}

TEST(AttentionChoice, WithoutCudnnTheFallbackServesAndSaysWhy) {
  for (int64_t d : {64, 128}) {
    const AttentionChoice c = choose_attention(kHopperNoCudnn, llama(d), AttentionForce::kAuto);
    EXPECT_EQ(c.impl, AttentionImpl::kFallback);
    EXPECT_TRUE(mentions(c, "cuDNN is absent")) << c.reason;
  }
}

TEST(AttentionChoice, The192By128SplitIsCudnnOnHopperOnly) {
  const AttentionChoice hopper =
      choose_attention(kHopperCudnn919, split_192_128(), AttentionForce::kAuto);
  EXPECT_EQ(hopper.impl, AttentionImpl::kCudnn) << hopper.reason;
  EXPECT_EQ(choose_attention(kHopperCudnn911, split_192_128(), AttentionForce::kAuto).impl,
            AttentionImpl::kCudnn);
  EXPECT_EQ(choose_attention(kBlackwellCudnn, split_192_128(), AttentionForce::kAuto).impl,
            AttentionImpl::kCudnn);
  // Ampere's backward stops at 128, and the fallback takes d_qk = d_v only: nobody serves it.
  const AttentionChoice ampere =
      choose_attention(kAmpereCudnn, split_192_128(), AttentionForce::kAuto);
  EXPECT_EQ(ampere.impl, AttentionImpl::kNone);
  EXPECT_TRUE(mentions(ampere, "exceed 128")) << ampere.reason;
  EXPECT_TRUE(mentions(ampere, "fallback kernel takes d_qk = d_v")) << ampere.reason;
  // Without cuDNN the split has no implementation on Hopper either.
  EXPECT_EQ(choose_attention(kHopperNoCudnn, split_192_128(), AttentionForce::kAuto).impl,
            AttentionImpl::kNone);
}

TEST(AttentionChoice, CudnnVersionsThatOnlyTakeTheExactSplit) {
  AttentionCase c = split_192_128();
  c.d_qk = 160;  // between 128 and 192 but not the split
  EXPECT_EQ(choose_attention(kHopperCudnn911, c, AttentionForce::kAuto).impl, AttentionImpl::kNone);
  EXPECT_EQ(choose_attention(kHopperCudnn919, c, AttentionForce::kAuto).impl, AttentionImpl::kCudnn);
}

TEST(AttentionChoice, UnsupportedHeadDims) {
  // 96: cuDNN takes it, the fallback does not.
  const AttentionChoice d96 = choose_attention(kHopperCudnn919, llama(96), AttentionForce::kAuto);
  EXPECT_EQ(d96.impl, AttentionImpl::kCudnn);
  EXPECT_EQ(choose_attention(kHopperNoCudnn, llama(96), AttentionForce::kAuto).impl,
            AttentionImpl::kNone);
  // 100 is not a multiple of 8; 512 is over every limit.
  for (int64_t d : {100, 512}) {
    const AttentionChoice c = choose_attention(kHopperCudnn919, llama(d), AttentionForce::kAuto);
    EXPECT_EQ(c.impl, AttentionImpl::kNone) << d;
    EXPECT_FALSE(c.reason.empty());
  }
  // 256 is Hopper-only for cuDNN.
  EXPECT_EQ(choose_attention(kHopperCudnn919, llama(256), AttentionForce::kAuto).impl,
            AttentionImpl::kCudnn);
  EXPECT_EQ(choose_attention(kAmpereCudnn, llama(256), AttentionForce::kAuto).impl,
            AttentionImpl::kNone);
}

TEST(AttentionChoice, GqaRatioMustDivide) {
  EXPECT_EQ(choose_attention(kHopperCudnn919, llama(128, 32, 1), AttentionForce::kAuto).impl,
            AttentionImpl::kCudnn);
  const AttentionChoice bad = choose_attention(kHopperCudnn919, llama(128, 12, 8), AttentionForce::kAuto);
  EXPECT_EQ(bad.impl, AttentionImpl::kNone);
  EXPECT_TRUE(mentions(bad, "not a multiple of Hkv")) << bad.reason;
}

TEST(AttentionChoice, NotBf16OrTooOldIsServedByNobody) {
  AttentionCase f32 = llama(128);
  f32.dtype = DType::kF32;
  EXPECT_EQ(choose_attention(kHopperCudnn919, f32, AttentionForce::kAuto).impl, AttentionImpl::kNone);
  const AttentionChoice turing = choose_attention(kTuring, llama(128), AttentionForce::kAuto);
  EXPECT_EQ(turing.impl, AttentionImpl::kNone);
  EXPECT_TRUE(mentions(turing, "sm_75")) << turing.reason;
}

TEST(AttentionChoice, NonCausalIsServedByNobody) {
  AttentionCase c = llama(64);
  c.causal = false;
  const AttentionChoice choice = choose_attention(kHopperCudnn919, c, AttentionForce::kAuto);
  EXPECT_EQ(choice.impl, AttentionImpl::kNone);
  EXPECT_TRUE(mentions(choice, "causal only")) << choice.reason;
  EXPECT_EQ(choose_attention(kHopperNoCudnn, c, AttentionForce::kAuto).impl, AttentionImpl::kNone);
}

TEST(AttentionChoice, SequenceOfOneAndBrokenVersionsFallBack) {
  const AttentionChoice one =
      choose_attention(kHopperCudnn919, llama(64, 8, 8, 1), AttentionForce::kAuto);
  EXPECT_EQ(one.impl, AttentionImpl::kFallback);
  EXPECT_TRUE(mentions(one, "T=1")) << one.reason;
  // Lengths that are not multiples of any tile are cuDNN's.
  EXPECT_EQ(choose_attention(kHopperCudnn919, llama(64, 8, 8, 1000), AttentionForce::kAuto).impl,
            AttentionImpl::kCudnn);
  // Up to 9.15.0, a length that is not a multiple of 128 is the fallback's; 2048 stays cuDNN's.
  const AttentionChoice ragged = choose_attention(kHopperCudnn911, llama(64, 8, 8, 1000), AttentionForce::kAuto);
  EXPECT_EQ(ragged.impl, AttentionImpl::kFallback);
  EXPECT_TRUE(mentions(ragged, "multiple of 128")) << ragged.reason;
  EXPECT_EQ(choose_attention(kHopperCudnn911, llama(64, 8, 8, 2048), AttentionForce::kAuto).impl,
            AttentionImpl::kCudnn);
  const AttentionChoice broken = choose_attention(kHopperCudnn910, llama(128), AttentionForce::kAuto);
  EXPECT_EQ(broken.impl, AttentionImpl::kFallback);
  EXPECT_TRUE(mentions(broken, "9.10.0")) << broken.reason;
}

TEST(AttentionChoice, ForcedFallbackWinsWhereItCanServe) {
  const AttentionChoice c = choose_attention(kHopperCudnn919, llama(128), AttentionForce::kFallback);
  EXPECT_EQ(c.impl, AttentionImpl::kFallback);
  EXPECT_TRUE(mentions(c, "STRATA_ATTENTION=fallback")) << c.reason;
  const AttentionChoice split =
      choose_attention(kHopperCudnn919, split_192_128(), AttentionForce::kFallback);
  EXPECT_EQ(split.impl, AttentionImpl::kNone);
}

TEST(AttentionChoice, ForcedCudnnFallsBackAndSaysItWasNotHonoured) {
  EXPECT_EQ(choose_attention(kHopperCudnn919, llama(64), AttentionForce::kCudnn).impl,
            AttentionImpl::kCudnn);
  const AttentionChoice c = choose_attention(kHopperNoCudnn, llama(64), AttentionForce::kCudnn);
  EXPECT_EQ(c.impl, AttentionImpl::kFallback);
  EXPECT_TRUE(mentions(c, "not honoured")) << c.reason;
}

TEST(AttentionChoice, AGraphCudnnCannotBuildFallsBackWithItsStatus) {
  const AttentionChoice c = attention_after_cudnn_failure(
      kHopperCudnn919, llama(128), "finalizing SDPA forward operation graph: CUDNN_STATUS_NOT_SUPPORTED");
  EXPECT_EQ(c.impl, AttentionImpl::kFallback);
  EXPECT_TRUE(mentions(c, "CUDNN_STATUS_NOT_SUPPORTED")) << c.reason;
  const AttentionChoice split =
      attention_after_cudnn_failure(kHopperCudnn919, split_192_128(), "CUDNN_STATUS_NOT_SUPPORTED");
  EXPECT_EQ(split.impl, AttentionImpl::kNone);
  EXPECT_TRUE(mentions(split, "CUDNN_STATUS_NOT_SUPPORTED")) << split.reason;
}

TEST(AttentionChoice, ParsesTheOverride) {
  EXPECT_EQ(parse_attention_force("").value(), AttentionForce::kAuto);
  EXPECT_EQ(parse_attention_force("auto").value(), AttentionForce::kAuto);
  EXPECT_EQ(parse_attention_force("cudnn").value(), AttentionForce::kCudnn);
  EXPECT_EQ(parse_attention_force("fallback").value(), AttentionForce::kFallback);
  const Result<AttentionForce> bad = parse_attention_force("flash");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("auto, cudnn, fallback"), std::string::npos);
}

// Blocks are launched roughly in index order: the block with the most work must come first,
// for query tiles (forward, dq) and key tiles (dk/dv) alike.
TEST(AttentionSchedule, BlocksRunLongestFirst) {
  for (int64_t tiles : {1, 2, 7, 64}) {
    for (int64_t block = 0; block + 1 < tiles; ++block) {
      EXPECT_GE(attention_query_tile_work(attention_query_tile(block, tiles), tiles),
                attention_query_tile_work(attention_query_tile(block + 1, tiles), tiles));
      EXPECT_GE(attention_key_tile_work(attention_key_tile(block, tiles), tiles),
                attention_key_tile_work(attention_key_tile(block + 1, tiles), tiles));
    }
    // Each mapping is a permutation of the tiles.
    std::vector<int> seen_q(tiles, 0), seen_k(tiles, 0);
    for (int64_t block = 0; block < tiles; ++block) {
      ++seen_q[attention_query_tile(block, tiles)];
      ++seen_k[attention_key_tile(block, tiles)];
    }
    for (int64_t t = 0; t < tiles; ++t) EXPECT_TRUE(seen_q[t] == 1 && seen_k[t] == 1) << t;
  }
  EXPECT_EQ(attention_key_tile_work(attention_key_tile(0, 8), 8), 8);
  EXPECT_EQ(attention_query_tile_work(attention_query_tile(0, 8), 8), 8);
}

}  // namespace
}  // namespace strata::kernels
