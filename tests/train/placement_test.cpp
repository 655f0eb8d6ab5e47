// The planner's placement is the state store's: for plans made from a model's real layout, the
// bytes each tier holds of each kind of state, as the store homes its chunks, are the bytes the
// plan counts there.
//
// Of the plan's per-tier bytes, these are homes and nothing else:
//   device  everything but the working set (Plan::device_working_set): with the activations
//           offloaded, the parameters, gradients and optimizer state of the groups it keeps there;
//   host, nvme  the optimizer kinds (master, adam_m, adam_v) of the groups whose AdamW runs
//           there. The host's parameters and gradients are not homes: a group updated on the CPU
//           keeps copies of them in host memory whether its home is the device or the host.
// The store is made with roomy budgets, so that every chunk lands in the home it was given
// rather than falling back to a tier below a full one.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <filesystem>
#include <memory>
#include <string>

#include "core/cpu_device.h"
#include "core/io_engine.h"
#include "model/params.h"
#include "offload/plan.h"
#include "train/paged_state.h"
#include "train/planning.h"
#include "train_test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

// Bytes of state chunks homed in each tier, by kind ([tier][kind]).
using TierKindBytes = std::array<std::array<uint64_t, kNumStateKinds>, kNumTiers>;

TierKindBytes homed_bytes(ChunkSpace& space) {
  TierKindBytes out{};
  for (ChunkId id = 0; id < space.num_chunks(); ++id) {
    const ChunkKind kind = space.chunk_kind(id);
    if (kind == ChunkKind::kAct) continue;
    out[static_cast<int>(space.home(id))][static_cast<int>(kind)] += space.chunk_bytes();
  }
  return out;
}

uint64_t optimizer_kind(const KindBytes& k, StateKind kind) {
  switch (kind) {
    case StateKind::kMaster:
      return k.master;
    case StateKind::kAdamM:
      return k.adam_m;
    case StateKind::kAdamV:
      return k.adam_v;
    default:
      break;
  }
  ADD_FAILURE() << "not an optimizer kind: " << state_kind_name(kind);
  return 0;
}

TrainConfig base_config(const model::ModelConfig& mc) {
  TrainConfig t;
  t.micro_batch = 2;
  t.seq_len = 16;
  t.grad_accum = 1;
  t.offload_activations = "true";  // the device's activations are then all working set
  t.keep_activations = "false";
  t.memory_host = 1ull << 30;
  t.chunk_size = PagedState::auto_chunk_bytes(model::ParamLayout(mc), t.precision);
  return t;
}

// The smallest device budget, in steps of a chunk from the least the plan can run in, whose plan
// `wanted` accepts; 0 when none up to 1 GiB does.
template <class Want>
uint64_t first_device_budget(const model::ModelConfig& mc, TrainConfig t, Want wanted) {
  t.memory_device = 1ull << 30;
  const uint64_t least = make_plan(make_plan_input(mc, t, DeviceKind::kCpu)).min_device_budget;
  for (uint64_t budget = least; budget <= (1ull << 30); budget += t.chunk_size) {
    t.memory_device = budget;
    const Plan p = make_plan(make_plan_input(mc, t, DeviceKind::kCpu));
    if (p.fits && wanted(p)) return budget;
  }
  return 0;
}

// Makes the state store for `plan` with roomy budgets and compares what it homes where with
// the plan's bytes (see the top of the file).
void expect_store_matches_plan(const model::ModelConfig& mc, const TrainConfig& t, const Plan& plan,
                               const std::string& nvme_dir) {
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  auto io = make_io_engine({.kind = "threads"});
  ASSERT_TRUE(io.ok());
  const model::ParamLayout layout(mc);
  PagedStateOptions po;
  po.precision = t.precision;
  po.device_bytes = 256ull << 20;
  po.host_bytes = 256ull << 20;
  po.nvme_bytes = nvme_dir.empty() ? 0 : 256ull << 20;
  po.nvme_dir = nvme_dir;
  po.chunk_bytes = t.chunk_size;
  po.optimizer = optimizer_config(0.0f);
  po.placement = plan.placement;
  auto ps = PagedState::create(**device, io->get(), layout, po);
  ASSERT_TRUE(ps.ok()) << ps.status().to_string();
  const TierKindBytes store = homed_bytes((*ps)->store().space());

  uint64_t device_homes = 0;
  for (uint64_t b : store[static_cast<int>(Tier::kDevice)]) device_homes += b;
  EXPECT_EQ(device_homes, plan.device.total() - plan.device_working_set)
      << "device: the store homes " << device_homes << " bytes of state, the plan "
      << plan.device.total() - plan.device_working_set;
  const struct {
    Tier tier;
    const KindBytes& planned;
  } tiers[] = {{Tier::kDevice, plan.device}, {Tier::kHost, plan.host}, {Tier::kNvme, plan.nvme}};
  for (const auto& [tier, planned] : tiers)
    for (StateKind kind : {StateKind::kMaster, StateKind::kAdamM, StateKind::kAdamV})
      EXPECT_EQ(store[static_cast<int>(tier)][static_cast<int>(kind)], optimizer_kind(planned, kind))
          << tier_name(tier) << " " << state_kind_name(kind);
}

// An embedding and head larger than the device's room for homes: the plan skips the edge group
// and makes layers resident instead, so residency is not a prefix starting at the edge.
TEST(PlacementTest, AnOversizedEmbeddingLeavesTheEdgeOffTheDeviceAndTheLayersOn) {
  model::ModelConfig mc = tiny_config(false);
  mc.vocab_size = 4096;
  const TrainConfig roomy = base_config(mc);
  TrainConfig t = roomy;
  t.memory_device = first_device_budget(mc, t, [](const Plan& p) { return p.device_optimizer_groups > 0; });
  ASSERT_GT(t.memory_device, 0u) << "no device budget puts any group's optimizer on the device";
  const PlanInput in = make_plan_input(mc, t, DeviceKind::kCpu);
  const Plan plan = make_plan(in);
  ASSERT_TRUE(plan.fits) << plan.problem;
  // The edge's parameters alone exceed every byte the plan homes on the device: the groups it
  // made resident are layers.
  ASSERT_GT(in.edge_param_chunks * in.chunk_size, plan.device.total() - plan.device_working_set);
  ASSERT_GT(plan.resident_param_groups, 0);
  const int head = static_cast<int>(mc.num_hidden_layers) + 1;
  EXPECT_EQ(plan.placement.home(0, StateKind::kParam), Tier::kHost);
  EXPECT_EQ(plan.placement.home(head, StateKind::kParam), Tier::kHost);
  EXPECT_EQ(plan.placement.home(head - 1, StateKind::kParam), Tier::kDevice);
  expect_store_matches_plan(mc, t, plan, "");
}

// Some groups' optimizer on the device (the edge first), the last layers' on nvme, the rest in
// host memory.
TEST(PlacementTest, DeviceAndNvmeOptimizerGroupsAreWhereThePlanCountsThem) {
  model::ModelConfig mc = tiny_config(false);
  mc.num_hidden_layers = 6;
  const int64_t groups = mc.num_hidden_layers + 1;
  TrainConfig t = base_config(mc);
  const PlanInput sizes = make_plan_input(mc, t, DeviceKind::kCpu);
  // The edge's Adam moments are among the device's (it is larger than a layer's, so a plan that
  // skipped it would count k layers' moments there, not the edge's and k - 1 layers').
  auto edge_and_layers = [&](const Plan& p) {
    const int64_t k = p.device_optimizer_groups;
    return k > 0 && k < groups - 1 &&
           p.device.adam_m ==
               (sizes.edge_moment_chunks + static_cast<uint64_t>(k - 1) * sizes.layer_moment_chunks) * sizes.chunk_size;
  };
  ASSERT_NE(sizes.edge_moment_chunks, sizes.layer_moment_chunks);
  t.memory_device = first_device_budget(mc, t, edge_and_layers);
  ASSERT_GT(t.memory_device, 0u) << "no device budget keeps the edge's and some, not all, layers' optimizer there";
  const fs::path nvme = fs::path(::testing::TempDir()) / ("placement_test_nvme_" + std::to_string(::getpid()));
  fs::remove_all(nvme);
  fs::create_directories(nvme);
  t.nvme_path = nvme.string();
  t.nvme_size = 256ull << 20;
  // Host room for about half the optimizer state the device leaves there; the rest spills.
  const Plan through_host = make_plan(make_plan_input(mc, t, DeviceKind::kCpu));
  const uint64_t host_optimizer = through_host.host.master + through_host.host.adam_m + through_host.host.adam_v;
  t.memory_host = through_host.host.total() - host_optimizer / 2;
  const Plan plan = make_plan(make_plan_input(mc, t, DeviceKind::kCpu));
  ASSERT_TRUE(plan.fits) << plan.problem;
  ASSERT_GT(plan.device_optimizer_groups, 0);
  ASSERT_GT(plan.nvme_optimizer_groups, 0);
  ASSERT_LT(plan.device_optimizer_groups + plan.nvme_optimizer_groups, groups);
  expect_store_matches_plan(mc, t, plan, nvme.string());
  fs::remove_all(nvme);
}

}  // namespace
}  // namespace strata
