// The planner's byte counts against what the CPU backend really allocates.
#include "train/planning.h"

#include <cmath>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "kernels/cpu/backend.h"
#include "kernels/lm_head_chunks.h"
#include "model/activations.h"
#include "model/params.h"
#include "offload/plan.h"
#include "core/cpu_device.h"
#include "train/paged_state.h"
#include "train/trainer.h"

namespace strata {
namespace {

TEST(Planning, PredictedBytesMatchTheRealAllocationWithin5Percent) {
  struct Case {
    const char* preset;
    int64_t B, T;
  };
  for (const Case& c : {Case{"tiny", 8, 128}, Case{"tiny", 2, 512}, Case{"llama3.2-1b", 1, 64}}) {
    auto mc = model::ModelConfig::preset(c.preset);
    ASSERT_TRUE(mc.ok()) << mc.status().to_string();
    TrainConfig t;
    t.micro_batch = c.B;
    t.seq_len = c.T;
    t.grad_accum = 1;
    t.memory_device = 1ull << 40;  // roomy: everything stays on the "device"
    t.memory_host = 1ull << 40;
    t.offload_activations = "false";
    t.gpu_flops = t.h2d_bytes_per_s = t.d2h_bytes_per_s = 1e9;
    t.disk_read_bytes_per_s = t.disk_write_bytes_per_s = t.cpu_adam_params_per_s = 1e9;
    Plan plan = make_plan(make_plan_input(*mc, t, DeviceKind::kCpu));
    ASSERT_TRUE(plan.fits) << plan.problem;

    // What a CPU run holds: params, grads, Adam m and v (flat buffers of the layout), the
    // activation table, and the LM head's logits chunk.
    model::ParamLayout layout(*mc);
    kernels::CpuF32Ops ops;
    model::ActivationTable<kernels::CpuF32Ops> acts;
    ASSERT_TRUE(acts.reserve(ops, *mc, c.B, c.T).ok());
    const double real_state = 4.0 * 4.0 * static_cast<double>(layout.total_size());
    const double real_act = static_cast<double>(acts.bytes()) +
                            4.0 * static_cast<double>(std::min<int64_t>(c.B * c.T, 256) * mc->vocab_size);
    const double planned_state = static_cast<double>(plan.device.total() - plan.device.act);
    const double planned_act = static_cast<double>(plan.device.act);
    const double state_err = std::abs(planned_state - real_state) / real_state;
    const double act_err = std::abs(planned_act - real_act) / real_act;
    EXPECT_TRUE(state_err <= 0.05) << c.preset << ": state planned " << planned_state << " real " << real_state;
    EXPECT_TRUE(act_err <= 0.05) << c.preset << " B=" << c.B << " T=" << c.T << ": activations planned "
                                 << planned_act << " real " << real_act;
  }
}

TEST(Planning, LargestMicroBatchIsTheEdgeOfFitting) {
  auto mc = model::ModelConfig::preset("llama3.2-1b");
  ASSERT_TRUE(mc.ok()) << mc.status().to_string();
  TrainConfig t;
  t.seq_len = 2048;
  t.grad_accum = 1;
  t.memory_device = 24ull << 30;
  t.memory_host = 100ull << 30;
  t.offload_activations = "auto";
  t.gpu_flops = t.h2d_bytes_per_s = t.d2h_bytes_per_s = 1e12;
  t.disk_read_bytes_per_s = t.disk_write_bytes_per_s = t.cpu_adam_params_per_s = 1e9;
  const int64_t best = largest_micro_batch(*mc, t, DeviceKind::kCuda);
  ASSERT_GT(best, 0);
  t.micro_batch = best;
  EXPECT_TRUE(make_plan(make_plan_input(*mc, t, DeviceKind::kCuda)).fits);
  t.micro_batch = best + 1;
  EXPECT_FALSE(make_plan(make_plan_input(*mc, t, DeviceKind::kCuda)).fits);
}

// The longest sequence is the edge too, at one sequence per micro-batch and at several, and
// shorter sequences all fit below it (activations are what grows with T).
TEST(Planning, LongestSequenceIsTheEdgeOfFitting) {
  auto mc = model::ModelConfig::preset("llama3.2-1b");
  ASSERT_TRUE(mc.ok()) << mc.status().to_string();
  TrainConfig t;
  t.grad_accum = 1;
  t.memory_device = 8ull << 30;
  t.memory_host = 100ull << 30;
  t.offload_activations = "auto";
  t.gpu_flops = t.h2d_bytes_per_s = t.d2h_bytes_per_s = 1e12;
  t.disk_read_bytes_per_s = t.disk_write_bytes_per_s = t.cpu_adam_params_per_s = 1e9;
  for (const int64_t micro_batch : {1, 3}) {
    SCOPED_TRACE(micro_batch);
    t.micro_batch = micro_batch;
    const int64_t longest = longest_sequence(*mc, t, DeviceKind::kCuda);
    ASSERT_GT(longest, 1024);
    for (const int64_t seq_len : {longest / 4, longest / 2, longest}) {
      t.seq_len = seq_len;
      EXPECT_TRUE(make_plan(make_plan_input(*mc, t, DeviceKind::kCuda)).fits) << seq_len;
    }
    t.seq_len = longest + 1;
    EXPECT_FALSE(make_plan(make_plan_input(*mc, t, DeviceKind::kCuda)).fits);
  }
}

// Context parallelism: a rank's activations are its 1/N share of every sequence (plus the ring's
// buffers), so the longest sequence that fits grows with N, is a multiple of 2N (each rank takes
// two equal chunks), and is the edge of fitting at that granularity. The activation table's ring
// buffers are counted: the per-rank workspace at N is more than the one-process workspace of the
// same local tokens.
TEST(Planning, ContextParallelismLengthensTheLongestSequence) {
  auto mc = model::ModelConfig::preset("llama3.2-1b");
  ASSERT_TRUE(mc.ok()) << mc.status().to_string();
  TrainConfig t;
  t.grad_accum = 1;
  t.micro_batch = 1;
  t.memory_device = 8ull << 30;
  t.memory_host = 100ull << 30;
  t.offload_activations = "auto";
  t.gpu_flops = t.h2d_bytes_per_s = t.d2h_bytes_per_s = 1e12;
  t.disk_read_bytes_per_s = t.disk_write_bytes_per_s = t.cpu_adam_params_per_s = 1e9;
  const int64_t alone = longest_sequence(*mc, t, DeviceKind::kCpu);
  ASSERT_GT(alone, 1024);
  int64_t previous = alone;
  for (const int64_t N : {2, 4}) {
    SCOPED_TRACE(N);
    t.parallel_context = N;
    t.plan_world_size = N;
    const int64_t longest = longest_sequence(*mc, t, DeviceKind::kCpu);
    EXPECT_EQ(longest % (2 * N), 0);
    EXPECT_GT(longest, previous + previous / 2);  // activations are most of what grows
    t.seq_len = longest;
    EXPECT_TRUE(make_plan(make_plan_input(*mc, t, DeviceKind::kCpu)).fits);
    t.seq_len = longest + 2 * N;
    EXPECT_FALSE(make_plan(make_plan_input(*mc, t, DeviceKind::kCpu)).fits);
    previous = longest;
  }
  // The ring's buffers: the same local tokens cost more workspace with a context group.
  t.parallel_context = 2;
  t.plan_world_size = 2;
  t.seq_len = 4096;
  const uint64_t with_ring = make_plan_input(*mc, t, DeviceKind::kCpu).layer_workspace_bytes;
  t.parallel_context = 1;
  t.seq_len = 2048;
  EXPECT_GT(with_ring, make_plan_input(*mc, t, DeviceKind::kCpu).layer_workspace_bytes);
}

// The ring's bytes in the plan are what the decoder's ring sends (tests/model/context_parallel_test
// counts those on the wire): per layer the keys and values of the rank's tokens N - 1 times in
// forward, recompute (all layers but the last) and backward, their fp32 sums N times; per
// micro-batch, and on the step's collectives line.
TEST(Planning, TheRingsBytesAreWhatTheDecodersRingSends) {
  auto mc = model::ModelConfig::preset("tiny");
  ASSERT_TRUE(mc.ok()) << mc.status().to_string();
  TrainConfig t;
  t.micro_batch = 2;
  t.seq_len = 64;
  t.grad_accum = 3;
  t.parallel_context = 4;
  t.plan_world_size = 4;
  t.memory_device = 1ull << 30;
  t.memory_host = 1ull << 30;
  const PlanInput in = make_plan_input(*mc, t, DeviceKind::kCpu);
  const uint64_t L = static_cast<uint64_t>(mc->num_hidden_layers), N = 4;
  const uint64_t kv = static_cast<uint64_t>(t.micro_batch * t.seq_len / 4 * mc->kv_dim());
  ASSERT_TRUE(in.recompute);
  EXPECT_EQ(in.ring_exchange_bytes, (3 * L - 1) * 2 * (N - 1) * kv * sizeof(float) + L * 2 * N * kv * sizeof(float));
  const Plan plan = make_plan(in);
  ASSERT_TRUE(plan.fits) << plan.problem;
  EXPECT_EQ(plan.comm.ring_exchange, 3 * in.ring_exchange_bytes);
  EXPECT_NE(format_plan(in, plan).find("ring attention"), std::string::npos);
  t.parallel_context = 1;
  EXPECT_EQ(make_plan(make_plan_input(*mc, t, DeviceKind::kCpu)).comm.ring_exchange, 0u);
}

// On a GPU the head's workspace is the LM-head buffer the CUDA backend reserves beside the
// activation table (chunks of thousands of tokens), on the CPU the 256-token logits vector.
TEST(Planning, TheHeadWorkspaceIsTheBackendsLmHeadBuffer) {
  auto mc = model::ModelConfig::preset("llama3.2-1b");
  ASSERT_TRUE(mc.ok()) << mc.status().to_string();
  TrainConfig t;
  t.micro_batch = 4;
  t.seq_len = 2048;
  t.grad_accum = 1;
  const int64_t N = t.micro_batch * t.seq_len;
  EXPECT_EQ(make_plan_input(*mc, t, DeviceKind::kCuda).head_workspace_bytes,
            kernels::lm_head_device_scratch_bytes(N, mc->hidden_size, mc->vocab_size));
  EXPECT_GE(make_plan_input(*mc, t, DeviceKind::kCuda).head_workspace_bytes,
            kernels::lm_head_chunk_bytes(mc->hidden_size, mc->vocab_size, 2048, true));
  EXPECT_EQ(make_plan_input(*mc, t, DeviceKind::kCpu).head_workspace_bytes,
            static_cast<uint64_t>(256 * mc->vocab_size) * 4);
}

// parallel.* and the interconnect rates reach the planner; with memory.host unset a rank plans
// with its share of the node's default, as strata train's ranks do.
TEST(Planning, DataParallelKeysReachThePlannerAndShareTheNodesHost) {
  auto mc = model::ModelConfig::preset("tiny");
  ASSERT_TRUE(mc.ok()) << mc.status().to_string();
  TrainConfig t;
  t.plan_world_size = 16;
  t.plan_ranks_per_node = 4;
  t.plan_zero = 2;
  t.intra_node_bytes_per_s = 1e9;
  t.inter_node_bytes_per_s = 2e9;
  const PlanInput in = make_plan_input(*mc, t, DeviceKind::kCuda);
  EXPECT_EQ(in.world_size, 16);
  EXPECT_EQ(in.ranks_per_node, 4);
  EXPECT_EQ(in.zero, 2);
  EXPECT_EQ(in.rates.intra_node_bytes_per_s, 1e9);
  EXPECT_EQ(in.rates.inter_node_bytes_per_s, 2e9);
  // The default is read from the machine twice: allow for what it did in between.
  const double whole = static_cast<double>(default_host_budget());
  const double share = static_cast<double>(in.host_budget);
  EXPECT_LE(std::abs(4 * share - whole), 0.05 * whole) << share << " of " << whole;
  t.plan_world_size = 2;  // ranks per node are capped at the world
  EXPECT_LE(std::abs(2 * static_cast<double>(make_plan_input(*mc, t, DeviceKind::kCuda).host_budget) - whole),
            0.05 * whole);
  t.memory_host = 1ull << 30;  // a given budget is each rank's as given
  EXPECT_EQ(make_plan_input(*mc, t, DeviceKind::kCuda).host_budget, 1ull << 30);
}

// Expert groups at ZeRO-1 sum their gradients after backward whatever parallel.overlap_comm says
// (PagedState has no handover for them): the plan replays the same step and hides nothing either
// way. At ZeRO-3 the dense parts' collectives overlap and hide.
TEST(Planning, ExpertGroupsAtZeroOnePlanTheSameStepWithOrWithoutOverlap) {
  // Layer 1 dense: its collectives hide (an MoE layer's wait for both streams at its experts).
  nlohmann::json j = {{"architectures", {"Qwen2MoeForCausalLM"}}, {"vocab_size", 64}, {"hidden_size", 32},
                      {"intermediate_size", 16}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                      {"num_key_value_heads", 2}, {"max_position_embeddings", 4096}, {"num_experts", 4},
                      {"num_experts_per_tok", 2}, {"moe_intermediate_size", 16},
                      {"shared_expert_intermediate_size", 16}, {"mlp_only_layers", {1}}};
  auto mc = model::ModelConfig::from_json(j, "planning_test");
  ASSERT_TRUE(mc.ok()) << mc.status().to_string();
  TrainConfig t;
  t.micro_batch = 2;
  t.seq_len = 16;
  t.grad_accum = 2;
  // The state pages through the host tier and nvme.
  t.memory_host = 256ull << 10;
  t.nvme_path = "/nonexistent-planned-only";
  t.nvme_size = 64ull << 20;
  t.plan_world_size = 4;
  t.parallel_expert = 2;
  // Rates (a bare TrainConfig has none; the config's defaults are an H200 box's).
  t.gpu_flops = 100e12;
  t.h2d_bytes_per_s = t.d2h_bytes_per_s = 50e9;
  t.disk_read_bytes_per_s = t.disk_write_bytes_per_s = 5e9;
  t.cpu_adam_params_per_s = 1e9;
  t.intra_node_bytes_per_s = t.inter_node_bytes_per_s = 1e9;
  for (int zero : {1, 3}) {
    t.plan_zero = zero;
    t.memory_device = zero == 1 ? 420ull << 10 : 640ull << 10;
    Plan with[2];
    for (int overlap = 0; overlap < 2; ++overlap) {
      t.parallel_overlap_comm = overlap == 1;
      with[overlap] = make_plan(make_plan_input(*mc, t, DeviceKind::kCpu));
      ASSERT_TRUE(with[overlap].fits) << with[overlap].problem;
    }
    if (zero == 1) {
      EXPECT_EQ(with[0].h2d_bytes, with[1].h2d_bytes);
      EXPECT_EQ(with[0].d2h_bytes, with[1].d2h_bytes);
      EXPECT_EQ(with[0].step_s, with[1].step_s);
      EXPECT_EQ(with[1].comm_hidden_s, 0);
    } else {
      EXPECT_EQ(with[0].comm_hidden_s, 0);
      EXPECT_GT(with[1].comm_hidden_s, 0);
    }
  }
}

// The expected share of experts a micro-batch reaches (uniform routing): few tokens leave most
// experts idle, a training-sized micro-batch reaches them all.
TEST(Planning, ExpertFetchFractionFollowsTheTokensPerMicroBatch) {
  nlohmann::json j = {{"architectures", {"MixtralForCausalLM"}}, {"vocab_size", 64}, {"hidden_size", 32},
                      {"intermediate_size", 16}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                      {"num_key_value_heads", 2}, {"max_position_embeddings", 4096}, {"num_local_experts", 8},
                      {"num_experts_per_tok", 2}};
  auto mc = model::ModelConfig::from_json(j, "planning_test");
  ASSERT_TRUE(mc.ok()) << mc.status().to_string();
  TrainConfig t;
  t.micro_batch = 1;
  t.seq_len = 2;
  PlanInput in = make_plan_input(*mc, t, DeviceKind::kCpu);
  EXPECT_EQ(in.expert_elements, 8u * 3 * 16 * 32);  // every layer is MoE
  EXPECT_DOUBLE_EQ(in.expert_fetch_fraction, 1.0 - 0.75 * 0.75);
  t.seq_len = 2048;
  EXPECT_DOUBLE_EQ(make_plan_input(*mc, t, DeviceKind::kCpu).expert_fetch_fraction, 1.0);
  EXPECT_EQ(make_plan_input(model::ModelConfig::preset("tiny").value(), t, DeviceKind::kCpu).expert_elements, 0u);
  // LoRA of rank 4 on the experts (and the queries): the experts stay frozen, their adapters
  // are planned as theirs, A (4, 32) and B (16, 4) or A (4, 16) and B (32, 4) for each of the
  // three projections of 8 experts, per layer.
  mc->lora.rank = 4;
  mc->lora.targets = model::kLoraQ | model::kLoraExperts;
  in = make_plan_input(*mc, t, DeviceKind::kCpu);
  EXPECT_FALSE(in.experts_trained);
  EXPECT_EQ(in.expert_adapter_elements, 8u * 3 * (4 * 32 + 16 * 4));
}

// AdamW in host memory goes update slice by slice (a chunk of each kind at a time), so state
// streamed from nvme needs two host slots of each optimizer kind homed there (the slice's and the
// next one's), not the largest group's chunks of each: budgets that once fitted only with the
// compute copies or gradients on nvme too (the head's 22 chunks of each kind as staging) now keep
// them on the host, and the smallest host budget is a few chunks. The replay of a step on the
// store (which fails as the engine would) runs within the host budget.
TEST(Planning, NvmeStagingIsAFewChunksWhateverTheLargestGroup) {
  model::ModelConfig mc = model::ModelConfig::preset("tiny").value();
  mc.num_hidden_layers = 2;
  mc.hidden_size = 64;
  mc.intermediate_size = 96;
  mc.num_attention_heads = 4;
  mc.num_key_value_heads = 2;
  mc.head_dim = 16;
  mc.vocab_size = 2000;
  TrainConfig t;
  t.micro_batch = 2;
  t.seq_len = 32;
  t.grad_accum = 1;
  t.memory_device = 3400 << 10;
  t.memory_host = 2800 << 10;
  t.nvme_path = "/nvme";
  t.nvme_size = 64ull << 20;
  t.offload_activations = "auto";
  t.gpu_flops = t.h2d_bytes_per_s = t.d2h_bytes_per_s = 1e9;
  t.disk_read_bytes_per_s = t.disk_write_bytes_per_s = t.cpu_adam_params_per_s = 1e9;
  t.chunk_size = PagedState::auto_chunk_bytes(model::ParamLayout(mc));
  const PlanInput in = make_plan_input(mc, t, DeviceKind::kCpu);
  // The head: the final norm, then 21 row blocks of lm_head (2000 x 64 fp32), one chunk each.
  const std::vector<uint64_t> head_chunks = StateStore::group_chunks(in.state_tensors, t.chunk_size);
  EXPECT_EQ(head_chunks.back(), 22u);
  // With the optimizer state spilled first (the planner's choice where its step is faster),
  // the head's 22 chunks of it go to nvme and pass through a few host slots.
  const Plan plan = make_plan(in, SpillOrder::kOptimizerFirst);
  ASSERT_TRUE(plan.fits) << plan.problem;
  const Plan chosen = make_plan(in);
  ASSERT_TRUE(chosen.fits) << chosen.problem;
  EXPECT_LE(chosen.step_s, plan.step_s);
  EXPECT_LE(chosen.chunk_peak_bytes[static_cast<size_t>(Tier::kHost)], t.memory_host);
  EXPECT_GT(plan.nvme_optimizer_groups, 0);
  EXPECT_EQ(plan.nvme.param + plan.nvme.grad, 0u);
  EXPECT_LT(plan.host.act, 22u * t.chunk_size);
  EXPECT_GT(plan.chunk_peak_bytes[static_cast<size_t>(Tier::kHost)], 0u);
  EXPECT_LE(plan.chunk_peak_bytes[static_cast<size_t>(Tier::kHost)], t.memory_host);
  // The smallest host budget: every kind of state on nvme, a few chunks of host.
  const uint64_t least = smallest_host_budget(mc, t, DeviceKind::kCpu);
  ASSERT_GT(least, 0u);
  EXPECT_LE(least, 12 * t.chunk_size);
  t.memory_host = least;
  const Plan tight = make_plan(make_plan_input(mc, t, DeviceKind::kCpu));
  ASSERT_TRUE(tight.fits) << tight.problem;
  EXPECT_LE(tight.chunk_peak_bytes[static_cast<size_t>(Tier::kHost)], least);
  t.memory_host = least - t.chunk_size;
  EXPECT_FALSE(make_plan(make_plan_input(mc, t, DeviceKind::kCpu)).fits);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// For every recipe, the planner's bytes of each kind (over all tiers) are the bytes of the
// chunks the paged state makes for that kind: the same layout, the same packing.
TEST(Planning, PlannedBytesPerKindAreTheStoresForEveryRecipe) {
  auto mc = model::ModelConfig::preset("tiny");
  ASSERT_TRUE(mc.ok()) << mc.status().to_string();
  for (Precision precision : {Precision::kFp32, Precision::kBf16}) {
    const model::ParamLayout layout(*mc);
    TrainConfig t;
    t.precision = precision;
    t.micro_batch = 2;
    t.seq_len = 64;
    t.grad_accum = 1;
    t.memory_device = 1ull << 30;
    t.memory_host = 1ull << 30;
    t.offload_activations = "false";
    t.gpu_flops = t.h2d_bytes_per_s = t.d2h_bytes_per_s = 1e9;
    t.disk_read_bytes_per_s = t.disk_write_bytes_per_s = t.cpu_adam_params_per_s = 1e9;
    t.chunk_size = PagedState::auto_chunk_bytes(layout, precision);
    const Plan plan = make_plan(make_plan_input(*mc, t, DeviceKind::kCpu));
    ASSERT_TRUE(plan.fits) << plan.problem;

    auto device = CpuDevice::create(0, 0);
    ASSERT_TRUE(device.ok());
    PagedStateOptions po;
    po.chunk_bytes = t.chunk_size;
    po.device_bytes = t.memory_device;
    po.host_bytes = t.memory_host;
    po.precision = precision;
    auto ps = PagedState::create(**device, nullptr, layout, po);
    ASSERT_TRUE(ps.ok()) << ps.status().to_string();
    uint64_t store[kNumStateKinds] = {};
    ChunkSpace& space = (*ps)->store().space();
    for (ChunkId c = 0; c < space.num_chunks(); ++c) store[static_cast<int>(space.chunk_kind(c))] += t.chunk_size;
    auto planned = [&](uint64_t KindBytes::*kind) { return plan.device.*kind + plan.host.*kind + plan.nvme.*kind; };
    const char* name = precision_name(precision);
    EXPECT_EQ(planned(&KindBytes::param), store[static_cast<int>(StateKind::kParam)]) << name;
    EXPECT_EQ(planned(&KindBytes::grad), store[static_cast<int>(StateKind::kGrad)]) << name;
    EXPECT_EQ(planned(&KindBytes::master), store[static_cast<int>(StateKind::kMaster)]) << name;
    EXPECT_EQ(planned(&KindBytes::adam_m), store[static_cast<int>(StateKind::kAdamM)]) << name;
    EXPECT_EQ(planned(&KindBytes::adam_v), store[static_cast<int>(StateKind::kAdamV)]) << name;
    if (precision == Precision::kBf16) {
      EXPECT_GT(store[static_cast<int>(StateKind::kMaster)], 0u);
      EXPECT_LT(store[static_cast<int>(StateKind::kParam)], store[static_cast<int>(StateKind::kGrad)]);
    }
  }
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// A cpu plan takes its compute rate from hardware.cpu_tflops_by_width at its model's width:
// a measured width's own rate, log-linear between two, the nearest's beyond them; a cuda plan,
// and a cpu plan without the table, hardware.gpu_tflops. Bad tables are refused naming the key.
TEST(Planning, TheCpuComputeRateIsTheTablesAtTheModelsWidth) {
  Result<Config> config =
      load_train_config("", {"hardware.cpu_tflops_by_width=[128:0.05, 512:0.1, 2048:0.2]", "hardware.gpu_tflops=3"});
  ASSERT_TRUE(config.ok()) << config.status().message();
  Result<TrainConfig> t = make_train_config(*config);
  ASSERT_TRUE(t.ok()) << t.status().message();
  model::ModelConfig mc = model::ModelConfig::preset("tiny").value();
  auto rate = [&](int64_t width, DeviceKind device) {
    mc.hidden_size = width;
    return planned_compute_flops(mc, *t, device);
  };
  // The table's TFLOP/s times 10^12, to the last bits of a double.
  auto near = [](double a, double b) { return std::abs(a - b) <= 1e-12 * std::abs(b); };
  EXPECT_PRED2(near, rate(512, DeviceKind::kCpu), 0.1e12);
  EXPECT_PRED2(near, rate(64, DeviceKind::kCpu), 0.05e12);
  EXPECT_PRED2(near, rate(8192, DeviceKind::kCpu), 0.2e12);
  // 1024 is halfway from 512 to 2048 in log width: the rates' geometric mean.
  const double mid = rate(1024, DeviceKind::kCpu);
  if (!(std::abs(mid - std::sqrt(0.1e12 * 0.2e12)) <= 1e-9 * mid)) ADD_FAILURE() << mid;
  EXPECT_PRED2(near, rate(1024, DeviceKind::kCuda), 3e12);
  mc.hidden_size = 1024;
  EXPECT_PRED2(near, make_plan_input(mc, *t, DeviceKind::kCpu).rates.compute_flops, mid);

  for (const char* bad : {"[512:0.1, 128:0.05]", "[512]", "[x:0.1]", "[512:0]", "[512:nan]", "[512:0.1x]"}) {
    Result<Config> c = load_train_config("", {std::string("hardware.cpu_tflops_by_width=") + bad});
    ASSERT_TRUE(c.ok()) << c.status().message();
    Result<TrainConfig> refused = make_train_config(*c);
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.status().message().find("hardware.cpu_tflops_by_width"), std::string::npos)
        << refused.status().message();
  }
}

}  // namespace
}  // namespace strata
