#include "offload/traffic_sim.h"

#include <gtest/gtest.h>

#include <cstdio>

#include <chrono>

#include "model/config.h"
#include "model/recording_access.h"

namespace strata {
namespace {

constexpr size_t kAdamM = static_cast<size_t>(StateKind::kAdamM), kAdamV = static_cast<size_t>(StateKind::kAdamV);

// The step program of a dense model of `layers` layers whose groups are in.groups, as the decoder
// and the optimizer run it: AdamW on each group where its moments live.
std::vector<ProgramEvent> program(const TrafficInput& in, int64_t layers, int64_t grad_accum) {
  model::ModelConfig mc = model::ModelConfig::preset("tiny").value();
  mc.num_hidden_layers = layers;
  mc.tie_word_embeddings = false;
  OptimizerProgram optimizer;
  optimizer.num_groups = static_cast<int>(in.groups.size());
  optimizer.kinds = {StateKind::kParam, StateKind::kGrad, StateKind::kMaster, StateKind::kAdamM, StateKind::kAdamV};
  optimizer.where = [&in](int g) { return update_tier(in.groups[static_cast<size_t>(g)].home[kAdamM]); };
  return make_step_program(model::record_micro_batch(mc, false), optimizer).events(grad_accum);
}

TrafficResult simulate(TrafficInput in, int64_t layers, int64_t grad_accum = 1) {
  in.program = program(in, layers, grad_accum);
  return simulate_traffic(in);
}

// Three layers of one chunk per kind (param, grad, adam_m, adam_v; no separate master), an
// embedding and a head without state, everything homed on the host, four device slots, one
// micro-batch, no prefetch. The step program (positions in brackets):
//   zero  G1 G2 G3 (write)                      [0-2]
//   fwd   P1 P2 P3                              [3-5]
//   bwd   P3+G3, P2+G2, P1+G1                   [6-11]
//   norm  G1 G2 G3                              [12-14]
//   adamw on the host: P1 G1 M1 V1, P2 .., P3 ..  [15-26]
// AdamW writes every P and G on the host, so each step starts with four stale device copies:
// zeroing reuses the gradients' slots without a move, P1 reuses the fourth (h2d). P2 evicts
// the copy needed farthest ahead, G1 (next use 11), which is the only valid one: d2h. P3
// evicts P1 (10, clean). In backward P3 and P2 are still there; P1 evicts P3 (next use 23, in
// AdamW), G1 evicts P2 (19) and is read back (h2d). AdamW copies G1..G3 down (d2h each).
// Steady step: h2d 3 in forward + 2 in backward, d2h 1 in forward + 3 in AdamW.
TrafficInput three_layers(uint64_t device_slots) {
  TrafficInput in;
  TrafficGroup none;
  none.home.fill(Tier::kHost);
  TrafficGroup layer;
  layer.chunks = {1, 1, 0, 1, 1};
  layer.home.fill(Tier::kHost);
  in.groups = {none, layer, layer, layer, none};
  in.device_slots = device_slots;
  in.host_slots = 100;
  in.lookahead = 0;
  return in;
}

TEST(TrafficSim, BeladyKeepsTheCopiesNeededSoonestInAFullDeviceTier) {
  const TrafficResult r = simulate(three_layers(4), 3);
  ASSERT_TRUE(r.ok);
  EXPECT_EQ(r.zero.h2d, 0u);
  EXPECT_EQ(r.zero.d2h, 0u);
  EXPECT_EQ(r.forward.h2d, 3u);
  EXPECT_EQ(r.forward.d2h, 1u);
  EXPECT_EQ(r.backward.h2d, 2u);
  EXPECT_EQ(r.backward.d2h, 0u);
  EXPECT_EQ(r.norm.h2d + r.norm.d2h, 0u);
  EXPECT_EQ(r.optimizer.h2d, 0u);
  EXPECT_EQ(r.optimizer.d2h, 3u);
  EXPECT_EQ(r.total().disk_read + r.total().disk_write, 0u);
}

// With a slot for every parameter and gradient the device keeps them all: per step only
// AdamW's writes on the host cost anything, the three parameters read back in forward and the
// three gradients copied down for AdamW (zeroing overwrites the stale device copies in place).
TEST(TrafficSim, ARoomyDeviceTierMovesOnlyWhatTheHostOptimizerChanges) {
  const TrafficResult r = simulate(three_layers(6), 3);
  ASSERT_TRUE(r.ok);
  EXPECT_EQ(r.total().h2d, 3u);
  EXPECT_EQ(r.forward.h2d, 3u);
  EXPECT_EQ(r.total().d2h, 3u);
  EXPECT_EQ(r.optimizer.d2h, 3u);
}

// Adam moments homed on nvme stay cached in free host slots from one step to the next: once
// the host holds all six, the steady step reads and writes nothing on disk.
TEST(TrafficSim, NvmeStateThatFitsInFreeHostSlotsStaysCached) {
  TrafficInput in = three_layers(6);
  for (int g = 1; g <= 3; ++g) in.groups[g].home[kAdamM] = in.groups[g].home[kAdamV] = Tier::kNvme;
  in.host_slots = 6 + 6 + 1;  // the homes, a slot per moment, the staging slot
  TrafficResult r = simulate(in, 3);
  ASSERT_TRUE(r.ok);
  EXPECT_EQ(r.total().disk_read, 0u);
  EXPECT_EQ(r.total().disk_write, 0u);
  // Two slots short: every step some moments go back to disk and are read again.
  in.host_slots = 6 + 4 + 1;
  r = simulate(in, 3);
  ASSERT_TRUE(r.ok);
  EXPECT_GT(r.total().disk_read, 0u);
  EXPECT_GT(r.total().disk_write, 0u);
}

// Three device slots cannot hold a layer's two parameter and two gradient chunks, which
// backward pins together: the replay says so instead of guessing.
TEST(TrafficSim, ATierTooSmallForOneAcquisitionIsReported) {
  TrafficInput in = three_layers(3);
  in.groups[1].chunks = {2, 2, 0, 1, 1};
  EXPECT_FALSE(simulate(in, 3).ok);
}

// An 8B-sized schedule (33 groups of ~14 chunks per kind, 8 micro-batches, prefetch on) replays
// (in milliseconds in a release build; the time is printed, not asserted: it depends on the
// machine and its load).
TEST(TrafficSim, ALargeModelsScheduleReplays) {
  TrafficInput in;
  TrafficGroup layer;
  layer.chunks = {7, 14, 14, 14, 14};
  layer.home = {Tier::kHost, Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kNvme};
  in.groups.assign(34, layer);
  in.device_slots = 200;
  in.host_slots = 34 * 21 + 300;
  in.program = program(in, 32, 8);
  const auto start = std::chrono::steady_clock::now();
  const TrafficResult r = simulate_traffic(in);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(r.ok);
  EXPECT_GT(r.total().h2d, 0u);
  std::printf("replayed in %.3f s\n", s);
}

}  // namespace
}  // namespace strata
