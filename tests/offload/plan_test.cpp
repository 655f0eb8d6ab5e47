#include "offload/plan.h"

#include <cmath>
#include <string>

#include <gtest/gtest.h>

#include "core/units.h"

namespace strata {
namespace {

// A 1B-parameter-ish GPU layout: 16 layers of 50M, a 200M edge group.
PlanInput base_input() {
  PlanInput in;
  in.num_layers = 16;
  in.layer_elements = 50'000'000;
  in.edge_elements = 200'000'000;
  in.param_bytes = 2;
  in.grad_bytes = 2;
  in.separate_master = true;
  in.saved_activation_bytes_per_layer = 32ull << 20;
  in.layer_workspace_bytes = 512ull << 20;
  in.head_workspace_bytes = 64ull << 20;
  in.grad_accum = 4;
  in.tokens_per_step = 4 * 8192;
  in.flops_per_step = 8.0 * 1e9 * 32768;
  in.device_budget = 80 * kGiB;
  in.host_budget = 100 * kGiB;
  in.chunk_size = 0;
  return in;
}

TEST(Plan, EverythingOnTheDeviceMovesNothing) {
  Plan p = make_plan(base_input());
  ASSERT_TRUE(p.fits) << p.problem;
  EXPECT_EQ(p.resident_param_groups, 17);
  EXPECT_EQ(p.device_optimizer_groups, 17);
  EXPECT_EQ(p.h2d_bytes, 0u);
  EXPECT_EQ(p.d2h_bytes, 0u);
  EXPECT_EQ(p.cpu_adam_elements, 0u);
  EXPECT_EQ(p.host.total(), 0u);
  EXPECT_EQ(p.bottleneck, "compute");
  // 1B parameters x (2 + 2 + 4 + 4 + 4) bytes.
  const uint64_t state = 1'000'000'000ull * 16;
  EXPECT_EQ(p.device.param + p.device.grad + p.device.master + p.device.adam_m + p.device.adam_v, state);
}

TEST(Plan, SmallerDeviceMovesMoreBytesButStillFits) {
  uint64_t last_traffic = 0;
  for (uint64_t gib : {40, 16, 8, 4}) {
    PlanInput in = base_input();
    in.device_budget = gib * kGiB;
    Plan p = make_plan(in);
    ASSERT_TRUE(p.fits) << gib << " GiB: " << p.problem;
    EXPECT_LE(p.device.total(), in.device_budget);
    EXPECT_LE(p.host.total(), in.host_budget);
    const uint64_t traffic = p.h2d_bytes + p.d2h_bytes;
    EXPECT_GE(traffic, last_traffic) << gib << " GiB moved less than a larger budget";
    last_traffic = traffic;
  }
  EXPECT_GT(last_traffic, 0u);
}

TEST(Plan, TooSmallADeviceNamesTheMinimum) {
  PlanInput in = base_input();
  in.device_budget = 512ull << 20;
  Plan p = make_plan(in);
  ASSERT_FALSE(p.fits);
  ASSERT_FALSE(p.suggestions.empty());
  EXPECT_NE(p.suggestions[0].find("memory.device to at least"), std::string::npos) << p.suggestions[0];
  // The minimum it names is enough.
  EXPECT_NE(p.suggestions[0].find(format_bytes(p.min_device_budget)), std::string::npos);
  in.device_budget = p.min_device_budget;
  EXPECT_TRUE(make_plan(in).fits);
  in.device_budget = p.min_device_budget - 1;
  EXPECT_FALSE(make_plan(in).fits);
}

TEST(Plan, HostOverflowSpillsOptimizerStateToNvme) {
  PlanInput in = base_input();
  in.device_budget = 4 * kGiB;
  in.host_budget = 12 * kGiB;
  Plan without = make_plan(in);
  ASSERT_FALSE(without.fits);
  bool names_nvme = false;
  for (const auto& s : without.suggestions) names_nvme |= s.find("memory.nvme") != std::string::npos;
  EXPECT_TRUE(names_nvme);
  in.nvme_budget = 100 * kGiB;
  Plan with = make_plan(in);
  ASSERT_TRUE(with.fits) << with.problem;
  EXPECT_GT(with.nvme.total(), 0u);
  EXPECT_EQ(with.disk_read_bytes, with.nvme.total());
  EXPECT_LE(with.host.total(), in.host_budget);
  EXPECT_EQ(with.nvme.param + with.nvme.grad, 0u) << "only optimizer state goes to nvme";
}

TEST(Plan, NvmeTooSmallIsRefusedWithTheSizeNeeded) {
  PlanInput in = base_input();
  in.device_budget = 4 * kGiB;
  in.host_budget = 12 * kGiB;
  in.nvme_budget = 1 * kGiB;
  Plan p = make_plan(in);
  ASSERT_FALSE(p.fits);
  EXPECT_NE(p.problem.find("nvme"), std::string::npos) << p.problem;
}

TEST(Plan, ActivationOffloadFollowsTheSetting) {
  PlanInput in = base_input();
  in.device_budget = 6 * kGiB;
  in.offload_activations = "true";
  Plan on = make_plan(in);
  ASSERT_TRUE(on.fits);
  EXPECT_TRUE(on.offload_activations);
  EXPECT_EQ(on.host.act, 17 * in.saved_activation_bytes_per_layer);
  in.offload_activations = "false";
  Plan off = make_plan(in);
  ASSERT_TRUE(off.fits);
  EXPECT_FALSE(off.offload_activations);
  EXPECT_LT(off.h2d_bytes, on.h2d_bytes);
}

TEST(Plan, ChunkPaddingIsCounted) {
  PlanInput in = base_input();
  in.chunk_size = 64ull << 20;
  Plan p = make_plan(in);
  ASSERT_TRUE(p.fits);
  // 50M bf16 = 100,000,000 bytes -> 2 chunks of 64 MiB per layer.
  EXPECT_EQ(p.device.param % in.chunk_size, 0u);
  EXPECT_GT(p.device.param, 1'000'000'000ull * 2);
}

// MoE layers fetch only the experts a micro-batch reaches: a streamed layer moves its dense part
// plus that share of its experts, forward and backward.
TEST(Plan, StreamedExpertsCountOnlyTheShareAMicroBatchReaches) {
  PlanInput in = base_input();
  in.device_budget = make_plan(in).min_device_budget;  // every layer streams
  in.expert_elements = 40'000'000;                     // of the 50M per layer
  const Plan every = make_plan(in);
  in.expert_fetch_fraction = 0.25;
  const Plan quarter = make_plan(in);
  ASSERT_TRUE(every.fits && quarter.fits);
  ASSERT_EQ(every.resident_param_groups, 0);
  ASSERT_EQ(quarter.resident_param_groups, 0);
  ASSERT_EQ(every.resident_grad_groups, quarter.resident_grad_groups);
  // 30M idle expert elements per layer and micro-batch (the edge group has no experts): their
  // bf16 parameters twice (forward, recompute) and their gradients, which are read in to
  // accumulate, once.
  EXPECT_EQ(every.h2d_bytes - quarter.h2d_bytes, static_cast<uint64_t>(in.num_layers) * in.grad_accum * 30'000'000 *
                                                     (2 * in.param_bytes + in.grad_bytes));
  EXPECT_LT(quarter.d2h_bytes, every.d2h_bytes);
  EXPECT_NE(format_plan(in, quarter).find("25% of each MoE layer's experts"), std::string::npos);
}

TEST(Plan, StepTimesPrintInAUnitThatShowsThem) {
  const PlanInput in = base_input();
  Plan p = make_plan(in);
  ASSERT_TRUE(p.fits) << p.problem;
  p.step_s = 5.21e-5;
  p.compute_s = 3.2e-5;
  p.exposed_transfer_s = 0.0521;
  p.optimizer_tail_s = 1.2345;
  const std::string text = format_plan(in, p);
  EXPECT_NE(text.find("predicted step 52.1 us: compute 32 us, copies not hidden 52.1 ms, optimizer after backward "
                      "1.23 s"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("0.000"), std::string::npos) << text;
}

// Every layer streams its parameters and gradients: with a GPU's copy engines (copy_overlap 1)
// compute hides the copies but the first layer's; on the CPU backend (0) none of them, and the
// step is compute plus every copy.
TEST(Plan, CopiesHideBehindComputeOnlyWhereTheyRunBesideIt) {
  PlanInput in = base_input();
  in.device_budget = make_plan(in).min_device_budget;
  in.layer_forward_flops = 4e12;  // 5 ms per layer forward at 781 TFLOP/s: more than its copies
  in.head_forward_flops = 1e12;
  Plan gpu = make_plan(in);
  ASSERT_TRUE(gpu.fits) << gpu.problem;
  const PhaseTime& f = gpu.phases.forward;
  ASSERT_GT(f.copy_s, 0);
  ASSERT_GT(f.compute_s, f.copy_s);
  const double first_layer = 50'000'000.0 * in.param_bytes / in.rates.h2d_bytes_per_s;
  EXPECT_NEAR(f.exposed_s, first_layer, 1e-9);
  in.rates.copy_overlap = 0;
  const Plan cpu = make_plan(in);
  EXPECT_NEAR(cpu.phases.forward.exposed_s, cpu.phases.forward.copy_s, 1e-12);
  EXPECT_NEAR(cpu.phases.backward.exposed_s, cpu.phases.backward.copy_s, 1e-12);
  EXPECT_GT(cpu.step_s, gpu.step_s);
  // The step is the sum of its phases, and the busy times add up to the same compute.
  EXPECT_NEAR(cpu.step_s, cpu.phases.step_s(), 1e-12);
  EXPECT_NEAR(cpu.compute_s, 4 * (cpu.phases.forward.compute_s + cpu.phases.backward.compute_s), 1e-12);
}

// AdamW on the CPU overlapped with backward hides behind it with a GPU computing, and not on the
// CPU backend, whose AdamW takes the cores backward needs.
TEST(Plan, OverlappedOptimizerHidesOnlyBesideAGpu) {
  PlanInput in = base_input();
  in.device_budget = 8 * kGiB;  // the optimizer runs on the CPU for most groups
  in.layer_forward_flops = 1e12;
  in.overlap_optimizer = true;
  const Plan gpu = make_plan(in);
  ASSERT_TRUE(gpu.fits) << gpu.problem;
  ASSERT_GT(gpu.cpu_adam_elements, 0u);
  EXPECT_GT(gpu.phases.optimizer_hidden_s, 0);
  EXPECT_LT(gpu.optimizer_tail_s, gpu.phases.optimizer_s);
  in.rates.copy_overlap = 0;
  const Plan cpu = make_plan(in);
  EXPECT_EQ(cpu.phases.optimizer_hidden_s, 0);
  EXPECT_EQ(cpu.optimizer_tail_s, cpu.phases.optimizer_s);
}

// Data parallelism. base_input() holds 1e9 parameters: 2e9 bytes of compute copy (bf16), 2e9 of
// gradients (grad_bytes 2) and 4e9 of each optimizer kind; 16 layers of 50M, an edge of 200M.
PlanInput ranks(PlanInput in, int64_t world, int zero) {
  in.world_size = world;
  in.zero = zero;
  return in;
}

TEST(PlanDataParallel, ShardedKindsCountOneWorldthOnEachRank) {
  const uint64_t full_param = 2'000'000'000, full_grad = 2'000'000'000, full_opt = 4'000'000'000;
  // The working set, whole-layer sized at every level: the edge group and one layer.
  const uint64_t ws = (200'000'000 + 50'000'000) * 2;
  for (int zero = 0; zero < kZeroLevels; ++zero) {
    const Plan p = make_plan(ranks(base_input(), 8, zero));
    ASSERT_TRUE(p.fits) << "ZeRO-" << zero << ": " << p.problem;
    EXPECT_EQ(p.zero, zero);
    EXPECT_EQ(p.device_optimizer_groups, 17) << zero;  // 80 GiB holds everything, sharded or not
    EXPECT_EQ(p.device.master, zero >= 1 ? full_opt / 8 : full_opt) << zero;
    EXPECT_EQ(p.device.adam_m, zero >= 1 ? full_opt / 8 : full_opt) << zero;
    EXPECT_EQ(p.device.adam_v, zero >= 1 ? full_opt / 8 : full_opt) << zero;
    // Sharded gradients are produced whole into a workspace beside the chunks, and sharded
    // parameters gathered whole into another (both counted with the activations, a layer's and
    // the edge's each); their slices, all resident here, need no working set among the chunks.
    EXPECT_EQ(p.device.grad, zero >= 2 ? full_grad / 8 : full_grad) << zero;
    EXPECT_EQ(p.device.param, zero >= 3 ? full_param / 8 : full_param) << zero;
    const Plan one = make_plan(ranks(base_input(), 8, 1));
    const uint64_t workspaces = (zero >= 2 ? ws : 0) + (zero >= 3 ? ws : 0);
    EXPECT_EQ(p.device.act, one.device.act + workspaces) << zero;
    EXPECT_EQ(p.cpu_adam_elements, 0u);
  }
  // Shards round up: 3 ranks of 50M-element layers.
  PlanInput odd = ranks(base_input(), 3, 1);
  odd.num_layers = 1;
  odd.layer_elements = 1'000'001;
  odd.edge_elements = 0;
  const Plan p = make_plan(odd);
  ASSERT_TRUE(p.fits) << p.problem;
  EXPECT_EQ(p.device.master, (4'000'004 + 2) / 3);
}

TEST(PlanDataParallel, OneRankCommunicatesNothingAndPlansAsBefore) {
  const Plan single = make_plan(base_input());
  for (int zero : {kZeroAuto, 0, 1, 2, 3}) {
    const Plan p = make_plan(ranks(base_input(), 1, zero));
    EXPECT_EQ(p.zero, 0);
    EXPECT_EQ(p.comm.total(), 0u);
    EXPECT_EQ(p.comm_s, 0.0);
    EXPECT_EQ(p.device.total(), single.device.total());
    EXPECT_EQ(p.step_s, single.step_s);
  }
}

TEST(PlanDataParallel, RingCollectiveBytesPerLevel) {
  PlanInput in = base_input();  // grad_accum 4
  in.rates.intra_node_bytes_per_s = 100e9;
  const uint64_t G = 2'000'000'000, P = 2'000'000'000;
  const uint64_t g = G / 4 * 3, pp = P / 4 * 3;  // (W-1)/W of each at W = 4
  const Plan z0 = make_plan(ranks(in, 4, 0)), z1 = make_plan(ranks(in, 4, 1)), z2 = make_plan(ranks(in, 4, 2)),
             z3 = make_plan(ranks(in, 4, 3));
  for (const Plan* p : {&z0, &z1, &z2, &z3}) ASSERT_TRUE(p->fits) << p->problem;
  EXPECT_EQ(z0.comm.grad_all_reduce, 2 * g);
  EXPECT_EQ(z0.comm.total(), 2 * g);
  EXPECT_EQ(z1.comm.grad_all_reduce, 0u);
  EXPECT_EQ(z1.comm.grad_reduce_scatter, g);  // once per step, onto the owners
  EXPECT_EQ(z1.comm.update_all_gather, pp);
  EXPECT_EQ(z1.comm.total(), g + pp);
  EXPECT_EQ(z2.comm.grad_reduce_scatter, 4 * g);  // every micro-batch onto the shards
  EXPECT_EQ(z2.comm.update_all_gather, pp);
  EXPECT_EQ(z2.comm.total(), 4 * g + pp);
  EXPECT_EQ(z3.comm.param_all_gather, 2 * 4 * pp);  // forward and backward of 4 micro-batches
  EXPECT_EQ(z3.comm.grad_reduce_scatter, 4 * g);
  EXPECT_EQ(z3.comm.total(), 8 * pp + 4 * g);
  // Four ranks fit in a node of eight: the node's bus.
  const double tol = 1e-9;
  EXPECT_EQ(z0.comm_bytes_per_s, 100e9);
  EXPECT_LE(std::abs(z0.comm_s - 2.0 * g / 100e9), tol);
  // ZeRO-0 shards nothing: its step is one process's plus the all-reduce, in full.
  const Plan one = make_plan(base_input());
  EXPECT_LE(std::abs(z0.step_s - (one.step_s + z0.comm_s)), tol);
  EXPECT_EQ(z0.comm_exposed_s, z0.comm_s);
  // ZeRO-3's gathers run when a batch begins its layer, on the compute stream, as strata train
  // makes them: they add to the step in full, with the reduce-scatter, even when compute is longer.
  ASSERT_GT(z3.compute_s, static_cast<double>(z3.comm.param_all_gather) / 100e9);
  EXPECT_LE(std::abs(z3.comm_exposed_s - (4.0 * g + 8.0 * pp) / 100e9), tol);
  EXPECT_LE(std::abs(z3.comm_exposed_s - z3.comm_s), tol);
  // On a slow bus they bound the step.
  in.rates.intra_node_bytes_per_s = 1e9;
  const Plan slow = make_plan(ranks(in, 4, 3));
  EXPECT_LE(std::abs(slow.comm_exposed_s - (4.0 * g + 8.0 * pp) / 1e9), 1e-6);
  EXPECT_EQ(slow.bottleneck, "communication");
}

// The sums at handover (ZeRO-0 and 1 with overlap_comm): all but the embedding's share hide
// behind the last micro-batch's backward, as far as its compute reaches; ZeRO-2's sums behind
// each backward; the updated copy's gathers (ZeRO-1 and 2) behind the optimizer but the last
// group's.
TEST(PlanDataParallel, SumsAtHandoverAndQueuedCollectivesHideBehindCompute) {
  PlanInput in = base_input();
  in.rates.intra_node_bytes_per_s = 100e9;
  in.overlap_comm = true;
  const uint64_t g = 2'000'000'000ull / 4 * 3;  // (W-1)/W of the gradients at W = 4
  const Plan z0 = make_plan(ranks(in, 4, 0));
  ASSERT_TRUE(z0.fits) << z0.problem;
  const double sums_s = 2.0 * g / 100e9;
  // No chunk counts: the embedding is half the edge's 200M of the 1000M elements.
  const double want = std::min(sums_s * (1 - 0.5 * 200.0 / 1000.0), z0.phases.backward.compute_s);
  ASSERT_GT(want, 0);
  EXPECT_NEAR(z0.comm_hidden_s, want, 1e-12);
  EXPECT_NEAR(z0.comm_exposed_s, z0.comm_s - want, 1e-12);
  // The updated copy's gathers hidden behind the optimizer: all but the last group's, of those
  // updated where they can queue (every group on the CPU backend; on cuda those updated in
  // device memory).
  auto gathers_hidden = [&](const Plan& z) {
    const int groups = z.placement.num_groups();
    int queued = 0;
    for (int k = 0; k < groups; ++k)
      if (!in.copy_gathers_need_device || update_tier(z.placement.home(k, StateKind::kAdamM)) == Tier::kDevice) ++queued;
    return std::min(static_cast<double>(z.comm.update_all_gather) / 100e9 * std::max(queued - 1, 0) / groups,
                    z.phases.optimizer_s);
  };
  const Plan z1 = make_plan(ranks(in, 4, 1));
  const double z1_sums = std::min(static_cast<double>(z1.comm.grad_reduce_scatter) / 100e9 * (1 - 0.5 * 200.0 / 1000.0),
                                  z1.phases.backward.compute_s);
  ASSERT_GT(z1.comm.update_all_gather, 0u);
  ASSERT_GT(gathers_hidden(z1), 0);
  EXPECT_NEAR(z1.comm_hidden_s, z1_sums + gathers_hidden(z1), 1e-12);
  EXPECT_NEAR(z1.comm_exposed_s, z1.comm_s - z1.comm_hidden_s, 1e-12);
  // The last group's gather stays exposed.
  EXPECT_GE(z1.comm_exposed_s, static_cast<double>(z1.comm.update_all_gather) / 100e9 / z1.placement.num_groups() - 1e-12);
  // ZeRO-2 and 3 queue their sums (and ZeRO-3 its gathers) on the communication stream: all but
  // the embedding's sums in the last micro-batch and its forward gathers hide, as far as
  // backward's compute reaches (and forward's, for ZeRO-3's gathers); the updated copy's gather
  // after the optimizer (ZeRO-2) as above.
  for (int zero : {2, 3}) {
    const Plan z = make_plan(ranks(in, 4, zero));
    ASSERT_TRUE(z.fits) << z.problem;
    const double queued_s = static_cast<double>(z.comm.grad_reduce_scatter + z.comm.param_all_gather) / 100e9;
    const double compute_s = static_cast<double>(in.grad_accum) *
                             ((zero == 3 ? z.phases.forward.compute_s : 0.0) + z.phases.backward.compute_s);
    const double embed = 0.5 * 200.0 / 1000.0;
    const double exposed_s = (static_cast<double>(z.comm.grad_reduce_scatter) / in.grad_accum * embed +
                              static_cast<double>(z.comm.param_all_gather) * embed / 2) /
                             100e9;
    const double hidden = std::min(queued_s - exposed_s, compute_s) + (zero == 2 ? gathers_hidden(z) : 0.0);
    ASSERT_GT(hidden, 0) << zero;
    EXPECT_NEAR(z.comm_hidden_s, hidden, 1e-12) << zero;
    EXPECT_NEAR(z.comm_exposed_s, z.comm_s - hidden, 1e-12) << zero;
    if (zero == 2) {
      ASSERT_GT(gathers_hidden(z), 0);
      // On cuda only the groups updated in device memory queue their gathers.
      in.copy_gathers_need_device = true;
      const Plan cuda = make_plan(ranks(in, 4, zero));
      EXPECT_NEAR(cuda.comm_hidden_s, std::min(queued_s - exposed_s, compute_s) + gathers_hidden(cuda), 1e-12);
      in.copy_gathers_need_device = false;
    }
    in.overlap_comm = false;
    EXPECT_EQ(make_plan(ranks(in, 4, zero)).comm_hidden_s, 0) << zero;
    in.overlap_comm = true;
  }
  // Expert groups: their sums run after backward at ZeRO-0 and 1; at 2 and 3 the experts'
  // collectives go with their layers' as above.
  in.expert_ranks = 2;
  EXPECT_EQ(make_plan(ranks(in, 4, 1)).comm_hidden_s, 0);
  const Plan experts = make_plan(ranks(in, 4, 3));
  EXPECT_GT(experts.comm_hidden_s, 0);
  // A model of MoE layers only: the same share hides on the CPU backend, where the token
  // exchanges run apart from the communication stream. Where they settle it (expert groups on
  // cuda) nothing hides (the plan counts the edge's collectives with the layers').
  in.moe_layers = 1 << 20;  // (every layer)
  EXPECT_EQ(make_plan(ranks(in, 4, 3)).comm_hidden_s, experts.comm_hidden_s);
  in.exchanges_settle_comm = true;
  EXPECT_EQ(make_plan(ranks(in, 4, 3)).comm_hidden_s, 0);
  in.exchanges_settle_comm = false;
  in.moe_layers = 0;
  in.expert_ranks = 1;
  // The optimizer overlapped with backward takes the handover instead: nothing hides.
  in.overlap_optimizer = true;
  EXPECT_EQ(make_plan(ranks(in, 4, 0)).comm_hidden_s, 0);
  EXPECT_EQ(make_plan(ranks(in, 4, 3)).comm_hidden_s, 0);
}

// LoRA on the routed experts with expert groups: the adapters on the experts are summed and
// gathered over the ranks holding the same experts, as the experts' own weights would be; the
// other adapters over every rank.
TEST(PlanDataParallel, ExpertAdaptersAreSummedOverTheExpertsHolders) {
  PlanInput in = base_input();  // grad_accum 4, 16 layers
  in.expert_elements = 40'000'000;         // of the 50M per layer, frozen
  in.experts_trained = false;
  in.layer_trained_share = 0.0625;         // 3.125M adapter elements per layer,
  in.expert_adapter_elements = 1'250'000;  // 1.25M of them on the experts
  in.edge_trained_share = 0;
  in.expert_ranks = 2;
  // Gradient bytes (bf16): the dense adapters', and a rank's half of the experts' adapters.
  const uint64_t L = 16, dense = L * 1'875'000 * 2, experts = L * 1'250'000 / 2 * 2;
  for (int zero : {1, 2}) {
    const Plan p = make_plan(ranks(in, 4, zero));
    ASSERT_TRUE(p.fits) << p.problem;
    // Over 4 ranks (3/4 of the bytes) and over the 2 holders of a rank's experts (1/2).
    const uint64_t sums = dense / 4 * 3 + experts / 2;
    EXPECT_EQ(p.comm.grad_reduce_scatter, (zero == 1 ? 1 : 4) * sums) << zero;
    // The updated adapters (bf16 beside their fp32 master) gathered likewise.
    EXPECT_EQ(p.comm.update_all_gather, dense / 4 * 3 + experts / 2) << zero;
  }
  // Without expert groups every adapter goes over every rank.
  in.expert_ranks = 1;
  const Plan flat = make_plan(ranks(in, 4, 1));
  EXPECT_EQ(flat.comm.grad_reduce_scatter, (dense + L * 1'250'000 * 2) / 4 * 3);
}

// Overlapped ZeRO-3 gathers more groups ahead as the device has room left beside what the plan
// keeps there (counted with the activations), up to kMaxGatherAhead; one without overlap.
TEST(PlanDataParallel, RoomLeftOnTheDeviceGathersMoreGroupsAhead) {
  PlanInput in = base_input();
  in.overlap_comm = true;
  in.param_working_bytes = 64 << 20;
  in.param_ahead_bytes = 32 << 20;
  const Plan one = make_plan(ranks(in, 4, 3));
  ASSERT_TRUE(one.fits) << one.problem;
  const uint64_t left = in.device_budget - one.device.total() + (static_cast<uint64_t>(one.gather_ahead) - 1) * (32 << 20);
  const int expected = 1 + static_cast<int>(std::min<uint64_t>(kMaxGatherAhead - 1, left / (32 << 20)));
  EXPECT_EQ(one.gather_ahead, expected);
  EXPECT_LE(one.device.total(), in.device_budget);
  // A budget with room for exactly one more beside the same placement: two ahead.
  in.device_budget = one.device.total() - (static_cast<uint64_t>(one.gather_ahead) - 1) * (32 << 20) + (32 << 20);
  const Plan two = make_plan(ranks(in, 4, 3));
  ASSERT_TRUE(two.fits) << two.problem;
  EXPECT_EQ(two.gather_ahead, 2);
  EXPECT_LE(two.device.total(), in.device_budget);
  in.overlap_comm = false;
  EXPECT_EQ(make_plan(ranks(in, 4, 3)).gather_ahead, 1);
}

TEST(PlanDataParallel, AWorldBeyondOneNodeTalksAtTheNetworksRate) {
  PlanInput in = base_input();
  in.rates.intra_node_bytes_per_s = 150e9;
  in.rates.inter_node_bytes_per_s = 25e9;
  EXPECT_EQ(make_plan(ranks(in, 8, 0)).comm_bytes_per_s, 150e9);
  EXPECT_EQ(make_plan(ranks(in, 16, 0)).comm_bytes_per_s, 25e9);
  in.ranks_per_node = 4;
  EXPECT_EQ(make_plan(ranks(in, 8, 0)).comm_bytes_per_s, 25e9);
  in.ranks_per_node = 64;  // capped at the world: one node
  EXPECT_EQ(make_plan(ranks(in, 16, 0)).comm_bytes_per_s, 150e9);
  // More ranks send a little more each: 2(W-1)/W of the gradients.
  EXPECT_LT(make_plan(ranks(in, 2, 0)).comm.total(), make_plan(ranks(in, 16, 0)).comm.total());
}

TEST(PlanDataParallel, AutoPicksTheFastestLevelThatFits) {
  // 8 GiB of device and 1 GiB of host: the whole 16 GB state fits nowhere, its ZeRO-1 share
  // (master and moments / 8) fits on the device.
  PlanInput in = base_input();
  in.device_budget = 8 * kGiB;
  in.host_budget = 1 * kGiB;
  EXPECT_FALSE(make_plan(ranks(in, 8, 0)).fits);
  const Plan p = make_plan(ranks(in, 8, kZeroAuto));
  ASSERT_TRUE(p.fits) << p.problem;
  EXPECT_EQ(p.zero, 1);
  // Roomy budgets: every level fits; ZeRO-1 sends less than ZeRO-0 (the gradients reduced onto
  // their owners and the bf16 copy gathered, against fp32 gradients all-reduced) and each rank
  // updates an eighth of the state.
  const Plan roomy = make_plan(ranks(base_input(), 8, kZeroAuto));
  EXPECT_EQ(roomy.zero, 1);
  for (int zero = 0; zero < kZeroLevels; ++zero) {
    const Plan level = make_plan(ranks(base_input(), 8, zero));
    EXPECT_TRUE(level.fits) << zero;
    EXPECT_LE(roomy.step_s, level.step_s) << zero;
  }
}

// A Llama-3-70B-shaped model: 80 layers of 856M parameters, an untied 128256 x 8192 edge, bf16
// compute copy, fp32 gradients, master weights and moments; 4096 tokens per micro-batch.
PlanInput seventy_b() {
  PlanInput in;
  in.num_layers = 80;
  in.layer_elements = 856'000'000;
  in.edge_elements = 2ull * 128256 * 8192 + 8192;
  in.param_bytes = in.edge_param_bytes = 2;
  in.grad_bytes = 4;
  in.saved_activation_bytes_per_layer = 4096ull * 8192 * 2;
  in.layer_workspace_bytes = 4 * kGiB;
  in.head_workspace_bytes = 1 * kGiB;
  in.grad_accum = 8;
  in.tokens_per_step = 8 * 4096;
  in.layer_forward_flops = 4096 * 2.0 * 856e6;
  in.head_forward_flops = 4096 * 2.0 * 128256 * 8192;
  in.device_budget = 40 * kGiB;
  in.host_budget = 64 * kGiB;
  in.nvme_budget = 2048 * kGiB;
  return in;
}

// With nvme for every kind each level fits: the lower ones by streaming from disk the compute
// copies and gradients a higher level shards away, at a fraction of its speed. Auto takes the
// fastest, ZeRO-3.
TEST(PlanDataParallel, SeventyBOnEightRanksIsFastestAtZero3WithNvme) {
  PlanInput in = ranks(seventy_b(), 8, kZeroAuto);
  double slowest_lower = 0;
  for (int zero = 0; zero < 3; ++zero) {
    const Plan lower = make_plan(ranks(in, 8, zero));
    ASSERT_TRUE(lower.fits) << zero << ": " << lower.problem;
    EXPECT_GT(lower.nvme.param + lower.nvme.grad, 0u) << zero;  // compute copies or gradients on disk
    slowest_lower = std::max(slowest_lower, lower.step_s);
  }
  const Plan p = make_plan(in);
  ASSERT_TRUE(p.fits) << p.problem;
  EXPECT_EQ(p.zero, 3);
  EXPECT_LT(p.step_s, slowest_lower);
  for (int zero = 0; zero < 3; ++zero) EXPECT_LE(p.step_s, make_plan(ranks(in, 8, zero)).step_s) << zero;
  EXPECT_GT(p.nvme.total(), 0u);  // the optimizer states' shards spill to nvme
  EXPECT_LE(p.device.total(), in.device_budget);
  EXPECT_LE(p.host.total(), in.host_budget);
  EXPECT_GT(p.comm.param_all_gather, 0u);
  // Without the nvme tier not even ZeRO-3 fits; auto reports ZeRO-3's problem.
  in.nvme_budget = 0;
  const Plan none = make_plan(in);
  EXPECT_FALSE(none.fits);
  EXPECT_EQ(none.zero, 3);
  EXPECT_NE(none.problem.find("host budget"), std::string::npos) << none.problem;
  // 64 ranks hold a 70B ZeRO-3 shard without nvme.
  EXPECT_TRUE(make_plan(ranks(in, 64, 3)).fits);
}

TEST(PlanDataParallel, TheLevelTableHasARowPerLevelAndMarksTheChoice) {
  PlanInput in = ranks(seventy_b(), 8, kZeroAuto);
  std::string table = format_zero_levels(in, make_plan(in).zero);
  EXPECT_NE(table.find("8 ranks, 8 per node (1 node), ZeRO-3 (auto: the fastest level that fits"), std::string::npos)
      << table;
  EXPECT_NE(table.find("\n  3*"), std::string::npos) << table;
  for (const char* row : {"\n  0 ", "\n  1 ", "\n  2 "}) EXPECT_NE(table.find(row), std::string::npos) << row << table;
  // Without nvme no level fits, and the table says why.
  in.nvme_budget = 0;
  table = format_zero_levels(in, make_plan(in).zero);
  EXPECT_NE(table.find("host budget"), std::string::npos) << table;
}

// Placement by predicted step time: where state spills to NVMe, the plan is the fastest of the
// spill orders (optimizer state first; compute copies first; copies and gradients first). With
// little compute per step and much to spill the optimizer state goes first (its bytes move once
// a step, a streamed copy's at every use); with much compute, streamed copies and gradients
// hide behind it and go first.
TEST(PlanSpill, ThePlacementIsTheFastestOfTheSpillOrders) {
  int not_optimizer_first = 0, cases = 0;
  for (const double compute : {1.0, 200.0}) {
    for (const double host_gib : {6.0, 10.0, 14.0}) {
      PlanInput in = base_input();
      in.grad_accum = 1;
      in.grad_bytes = 4;
      in.tokens_per_step = 8192;
      in.flops_per_step = 8.0 * 1e9 * 8192 * compute;
      in.layer_forward_flops = in.flops_per_step / 3 / 17;
      in.device_budget = 4 * kGiB;
      in.host_budget = static_cast<uint64_t>(host_gib * static_cast<double>(kGiB));
      in.nvme_budget = 1ull << 40;
      in.rates.disk_read_bytes_per_s = 3e9;
      in.rates.disk_write_bytes_per_s = 2e9;
      const Plan chosen = make_plan(in);
      ASSERT_TRUE(chosen.fits) << chosen.problem;
      ASSERT_GT(chosen.nvme.total(), 0u);
      double fastest = INFINITY;
      SpillOrder best = SpillOrder::kOptimizerFirst;
      for (SpillOrder order : {SpillOrder::kOptimizerFirst, SpillOrder::kCopiesFirst, SpillOrder::kStreamsFirst}) {
        const Plan p = make_plan(in, order);
        if (p.fits && p.step_s < fastest) fastest = p.step_s, best = order;
      }
      EXPECT_EQ(chosen.step_s, fastest) << "compute x" << compute << ", host " << host_gib << " GiB";
      ++cases;
      if (best != SpillOrder::kOptimizerFirst) ++not_optimizer_first;
      // Much compute: the streams hide behind it, while AdamW's reads and writes do not.
      if (compute > 1.0) EXPECT_NE(best, SpillOrder::kOptimizerFirst) << host_gib;
    }
  }
  EXPECT_GT(not_optimizer_first, 0) << "no case where another order is faster";
  EXPECT_LT(not_optimizer_first, cases);
}

}  // namespace
}  // namespace strata
