// A diverged state never becomes a checkpoint: the writer counts NaN/Inf as it hashes and fails
// the save, so `latest` and keep-last-K keep the last finite one; the reader reports the
// non-finite tensors of a checkpoint written without that check.
#include <cmath>
#include <limits>

#include "ckpt/finite.h"
#include "ckpt_test_util.h"

namespace strata::ckpt::testing {
namespace {

TEST(FiniteScanTest, CountsElementsSplitAcrossAnyPieces) {
  // Header bytes, an F32 tensor, a BF16 tensor and an F32 one starting at an odd-by-2 offset.
  std::vector<unsigned char> file(16 + 4 * 5 + 2 * 3 + 4 * 3, 0);
  const float f32[5] = {1.f, NAN, 2.f, INFINITY, -INFINITY};
  std::memcpy(file.data() + 16, f32, sizeof f32);
  const uint16_t bf16[3] = {0x3f80, 0x7fc0, 0xff80};  // 1, NaN, -Inf
  std::memcpy(file.data() + 36, bf16, sizeof bf16);
  const float tail[3] = {NAN, 0.f, 3.f};
  std::memcpy(file.data() + 42, tail, sizeof tail);
  // The header's bytes are all ones: they must not count.
  std::memset(file.data(), 0xff, 16);
  for (uint64_t piece : {uint64_t{1}, uint64_t{3}, uint64_t{7}, uint64_t{64}}) {
    FiniteScan scan({{"a", DType::kF32, 16, 36, 0}, {"b", DType::kBF16, 36, 42, 0}, {"c", DType::kF32, 42, 54, 0}});
    for (uint64_t off = 0; off < file.size(); off += piece)
      scan.feed(off, file.data() + off, std::min<uint64_t>(piece, file.size() - off));
    EXPECT_EQ(scan.tensors()[0].non_finite, 3u) << "pieces of " << piece;
    EXPECT_EQ(scan.tensors()[1].non_finite, 2u) << "pieces of " << piece;
    EXPECT_EQ(scan.tensors()[2].non_finite, 1u) << "pieces of " << piece;
  }
  EXPECT_EQ(count_non_finite(DType::kF32, f32, 5), 3u);
}

class NonFiniteSaveTest : public CkptTest {};

TEST_F(NonFiniteSaveTest, IsNeverCommittedAndRetentionKeepsTheLastFiniteOne) {
  TrainState state;
  CheckpointWriterOptions opt;
  opt.keep_last = 1;
  opt.staging_bytes = 256 * kKiB;  // several pieces, some staged
  CheckpointWriter w(opt);
  ASSERT_TRUE(w.begin_save(state.request(dir(), 2)).ok());
  ASSERT_TRUE(w.wait().ok());
  // The run diverges: a NaN in the parameters and an Inf in Adam v.
  state.buffers[0]->f32()[70000] = NAN;
  state.buffers[2]->f32()[5] = INFINITY;
  state.buffers[2]->f32()[6] = INFINITY;
  for (int64_t step : {3, 4}) {
    ASSERT_TRUE(w.begin_save(state.request(dir(), step)).ok());
    Status st = w.wait();
    ASSERT_FALSE(st.ok()) << "step " << step << " was committed";
    EXPECT_NE(st.message().find("not finite"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("'model.layers.0.self_attn.q_proj.weight' holds 1 non-finite value"), std::string::npos)
        << st.message();
    EXPECT_NE(st.message().find("'adam_v/model.embed_tokens.weight' holds 2 non-finite values"), std::string::npos)
        << st.message();
    EXPECT_FALSE(fs::exists(dir_ / ("step-" + std::to_string(step))));
    EXPECT_FALSE(fs::exists(dir_ / ("step-" + std::to_string(step) + ".tmp")));
  }
  EXPECT_EQ(read_text(dir_ / "latest"), "step-2\n");
  EXPECT_TRUE(fs::exists(dir_ / "step-2")) << "keep_last=1 deleted the last finite checkpoint";
  auto r = CheckpointReader::open(dir(), ReaderOpenOptions{true});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  std::vector<ScannedTensor> bad;
  ASSERT_TRUE((*r)->verify(&bad).ok());
  EXPECT_TRUE(bad.empty());
}

TEST_F(NonFiniteSaveTest, VerifyNamesEachNonFiniteTensorWithItsCount) {
  TrainState state;
  state.buffers[1]->f32()[3] = NAN;  // adam_m of the embedding
  state.buffers[0]->f32()[64 * 1024 + 2] = -INFINITY;  // the first norm weight
  CheckpointWriterOptions opt;
  opt.refuse_non_finite = false;  // as an older strata wrote it
  CheckpointWriter w(opt);
  ASSERT_TRUE(w.begin_save(state.request(dir(), 5)).ok());
  ASSERT_TRUE(w.wait().ok());
  auto r = CheckpointReader::open(dir(), ReaderOpenOptions{true});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  std::vector<ScannedTensor> bad;
  ASSERT_TRUE((*r)->verify(&bad).ok());
  ASSERT_EQ(bad.size(), 2u);
  EXPECT_EQ(bad[0].name, "model.layers.0.input_layernorm.weight");
  EXPECT_EQ(bad[0].non_finite, 1u);
  EXPECT_EQ(bad[1].name, "adam_m/model.embed_tokens.weight");
  EXPECT_EQ(bad[1].non_finite, 1u);
}

}  // namespace
}  // namespace strata::ckpt::testing
