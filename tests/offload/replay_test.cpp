#include "offload/replay.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>

#include "model/config.h"
#include "model/recording_access.h"

namespace strata {
namespace {

constexpr uint64_t kReplayChunk = 64 * 1024;

// The step program of a dense model of `layers` layers, as the decoder and the optimizer run it:
// AdamW on each group where `home` puts its moments.
std::vector<ProgramEvent> program(int64_t layers, int64_t grad_accum, const StateLayout& layout,
                                  const std::function<Tier(int, StateKind, int)>& home) {
  model::ModelConfig mc = model::ModelConfig::preset("tiny").value();
  mc.num_hidden_layers = layers;
  mc.tie_word_embeddings = false;
  OptimizerProgram optimizer;
  optimizer.num_groups = static_cast<int>(layers) + 2;
  optimizer.kinds = layout.kinds();
  optimizer.where = [home](int g) { return update_tier(home(g, StateKind::kAdamM, kDensePart)); };
  return make_step_program(model::record_micro_batch(mc, false), optimizer).events(grad_accum);
}

// Three layers of one chunk per kind (fp32: param, grad, adam_m, adam_v; the compute copy is the
// master) homed on the host, `device_chunks` device slots for them, one micro-batch, no
// prefetch. The embedding and the head (a chunk per kind each) live on the device, updated
// there: they never move, and their 8 slots are homes, never free. The step program (positions in brackets):
//   zero  G1 G2 G3 (write)                      [0-2]
//   fwd   P1 P2 P3                              [3-5]
//   bwd   P3+G3, P2+G2, P1+G1                   [6-11]
//   norm  G1 G2 G3                              [12-14]
//   adamw on the host: P1 G1 M1 V1, P2 .., P3 ..  [15-26]
// AdamW writes every P on the host and discards every G (the next zeroing would overwrite it),
// so each step starts with four stale device copies, and zeroing discards the Gs again without
// acquiring them. P1 P2 P3 reuse three stale slots (h2d each). In backward G3 takes the fourth,
// zero-filled in place; G2 evicts P3 (next use 23, in AdamW, clean: dropped), G1 evicts P2
// (19). The norm finds G1..G3 on the device, and AdamW copies them down (d2h each).
// Steady step: h2d 3 in forward, d2h 3 in AdamW.
constexpr uint64_t kEdgeChunks = 8;

// Homes: the embedding (group 0) and the head (4) on the device, the layers' kinds by `layers`.
std::function<Tier(int, StateKind, int)> homes(std::function<Tier(StateKind)> layers) {
  return [layers](int g, StateKind k, int) { return g == 0 || g == 4 ? Tier::kDevice : layers(k); };
}

ReplayInput three_layers(uint64_t device_chunks, uint64_t chunks_per_tensor = 1) {
  ReplayInput in;
  in.tensors.push_back({"embed", kReplayChunk / 4, 0});
  for (int g = 1; g <= 3; ++g)
    for (uint64_t i = 0; i < chunks_per_tensor; ++i)
      in.tensors.push_back({"layer" + std::to_string(g) + "." + std::to_string(i), kReplayChunk / 4, g});
  in.store.layout = StateLayout::of(Precision::kFp32);
  in.store.lookahead = 0;
  in.store.space.chunk_bytes = kReplayChunk;
  in.tensors.push_back({"head", kReplayChunk / 4, 4});
  in.store.space.device_bytes = (device_chunks + kEdgeChunks) * kReplayChunk;
  in.store.space.host_bytes = 100 * kReplayChunk;
  in.store.home = homes([](StateKind) { return Tier::kHost; });
  return in;
}

Result<ReplayResult> replay(ReplayInput in, int64_t grad_accum = 1) {
  in.program = program(3, grad_accum, in.store.layout, in.store.home);
  return replay_step(in);
}

TEST(Replay, BeladyKeepsTheCopiesNeededSoonestInAFullDeviceTier) {
  const Result<ReplayResult> r = replay(three_layers(4));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->of(StepPhase::kZero).h2d + r->of(StepPhase::kZero).d2h, 0u);
  EXPECT_EQ(r->of(StepPhase::kForward).h2d, 3 * kReplayChunk);
  EXPECT_EQ(r->of(StepPhase::kForward).d2h, 0u);
  EXPECT_EQ(r->of(StepPhase::kBackward).h2d, 0u);
  EXPECT_EQ(r->of(StepPhase::kBackward).d2h, 0u);
  EXPECT_EQ(r->of(StepPhase::kNorm).h2d + r->of(StepPhase::kNorm).d2h, 0u);
  EXPECT_EQ(r->of(StepPhase::kOptimizer).h2d, 0u);
  EXPECT_EQ(r->of(StepPhase::kOptimizer).d2h, 3 * kReplayChunk);
  EXPECT_EQ(r->total().disk_read + r->total().disk_write, 0u);
  EXPECT_EQ(r->peak_bytes[static_cast<size_t>(Tier::kDevice)], (4 + kEdgeChunks) * kReplayChunk);
}

// With a slot for every parameter and gradient the device keeps them all: per step only
// AdamW's writes on the host cost anything, the three parameters read back in forward and the
// three gradients copied down for AdamW (zeroing discards them; backward zero-fills the stale
// device copies in place).
TEST(Replay, ARoomyDeviceTierMovesOnlyWhatTheHostOptimizerChanges) {
  const Result<ReplayResult> r = replay(three_layers(6));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->total().h2d, 3 * kReplayChunk);
  EXPECT_EQ(r->of(StepPhase::kForward).h2d, 3 * kReplayChunk);
  EXPECT_EQ(r->total().d2h, 3 * kReplayChunk);
  EXPECT_EQ(r->of(StepPhase::kOptimizer).d2h, 3 * kReplayChunk);
}

// Adam moments homed on nvme stay cached in free host slots from one step to the next: once
// the host holds all six, the steady step reads and writes nothing on disk. No file is made.
TEST(Replay, NvmeStateThatFitsInFreeHostSlotsStaysCached) {
  ReplayInput in = three_layers(6);
  in.store.home = homes([](StateKind k) {
    return k == StateKind::kAdamM || k == StateKind::kAdamV ? Tier::kNvme : Tier::kHost;
  });
  in.store.space.nvme_bytes = 1ull << 30;  // address space only: no file, no byte written
  in.store.space.nvme_dir = "/nonexistent";
  in.store.space.host_bytes = (6 + 6 + 1) * kReplayChunk;  // the homes, a slot per moment, the staging slot
  Result<ReplayResult> r = replay(in);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->total().disk_read, 0u);
  EXPECT_EQ(r->total().disk_write, 0u);
  // Two slots short: every step some moments go back to disk and are read again.
  in.store.space.host_bytes = (6 + 4 + 1) * kReplayChunk;
  r = replay(in);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_GT(r->total().disk_read, 0u);
  EXPECT_GT(r->total().disk_write, 0u);
}

// Three device slots cannot hold a layer's two parameter and two gradient chunks, which
// backward pins together: the replay says so, as the engine would.
TEST(Replay, ATierTooSmallForOneAcquisitionIsReported) {
  const Result<ReplayResult> r = replay(three_layers(3, 2));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfMemory) << r.status().to_string();
}

// An 8B-sized step (32 layers of ~14 chunks per fp32 kind, bf16 compute copies, moments on nvme,
// 8 micro-batches, prefetch on) replays; the time is printed, not asserted: it depends on the
// machine and its load.
TEST(Replay, ALargeModelsStepReplays) {
  ReplayInput in;
  for (int g = 1; g <= 32; ++g)
    for (int i = 0; i < 14; ++i) in.tensors.push_back({"l" + std::to_string(g) + "." + std::to_string(i), kReplayChunk / 4, g});
  in.tensors.push_back({"head", kReplayChunk / 4, 33});
  in.store.layout = StateLayout::of(Precision::kBf16);
  in.store.space.chunk_bytes = kReplayChunk;
  in.store.space.device_bytes = 200 * kReplayChunk;
  in.store.space.host_bytes = (34 * 21 + 300) * kReplayChunk;
  in.store.space.nvme_bytes = 34 * 50 * kReplayChunk;
  in.store.home = [](int, StateKind k, int) {
    return k == StateKind::kParam || k == StateKind::kGrad ? Tier::kHost : Tier::kNvme;
  };
  in.program = program(32, 8, in.store.layout, in.store.home);
  const auto start = std::chrono::steady_clock::now();
  const Result<ReplayResult> r = replay_step(in);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_GT(r->total().h2d, 0u);
  std::printf("replayed in %.3f s\n", s);
}

}  // namespace
}  // namespace strata
