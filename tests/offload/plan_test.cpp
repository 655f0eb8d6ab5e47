#include "offload/plan.h"

#include <gtest/gtest.h>

#include "core/units.h"

namespace strata {
namespace {

constexpr uint64_t kGiB = 1ull << 30;

// A 1B-parameter-ish GPU layout: 16 layers of 50M, a 200M edge group.
PlanInput base_input() {
  PlanInput in;
  in.num_layers = 16;
  in.layer_elements = 50'000'000;
  in.edge_elements = 200'000'000;
  in.param_bytes = 2;
  in.grad_bytes = 2;
  in.separate_master = true;
  in.checkpoint_bytes_per_layer = 32ull << 20;
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
  EXPECT_EQ(on.host.act, 17 * in.checkpoint_bytes_per_layer);
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

}  // namespace
}  // namespace strata
