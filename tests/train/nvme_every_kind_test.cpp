// Every kind of state on nvme: a model whose compute copy and gradients together are four times
// memory.host trains through the engine `strata train` builds (PagedEngine) with the planner
// homing compute copies and gradients on nvme beside the optimizer state, bit for bit as the same
// run with room for everything, in the fp32 and the bf16 recipes; and the plan's traffic and
// tier peaks are the engine's counters (the planner replays the step on the same store).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "model/param_access.h"
#include "offload/state_store.h"
#include "train/paged_engine.h"
#include "train/planning.h"
#include "train/train_test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

model::ModelConfig model_config() {
  model::ModelConfig mc = model::ModelConfig::preset("tiny").value();
  mc.hidden_size = 64;
  mc.intermediate_size = 176;
  mc.num_hidden_layers = 24;  // many groups: a host of a quarter of them still holds one in each kind
  mc.num_attention_heads = 4;
  mc.num_key_value_heads = 2;
  mc.head_dim = 16;
  mc.vocab_size = 256;
  mc.tie_word_embeddings = false;
  return mc;
}

constexpr int64_t kNvmeMicroBatch = 2, kNvmeSeqLen = 16, kNvmeAccum = 2;
constexpr int kNvmeSteps = 4;

struct TrainedRun {
  std::vector<double> losses;
  std::vector<float> params;
  Plan plan;
  ChunkSpaceStats first, last;  // after the first step, after the last
};

Result<TrainedRun> train(const model::ModelConfig& mc, const TrainConfig& t, float grad_clip = 1.0f) {
  ASSIGN_OR_RETURN(std::unique_ptr<PagedEngine> engine, PagedEngine::create(mc, t, optimizer_config(grad_clip)));
  // The same start for every run: weights drawn from a fixed seed, tensor by tensor.
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  RETURN_IF_ERROR(engine->state().fill_kind(StateKind::kParam, [&](const model::TensorSpec& spec, float* dst) {
    for (int64_t i = 0; i < spec.numel; ++i) dst[i] = spec.name.find("norm") != std::string::npos ? 1.0f : normal(rng);
    return Status::OK();
  }));
  TrainedRun run;
  run.plan = engine->plan();
  const int64_t tokens = t.micro_batch * t.seq_len;
  const std::vector<Batch> batches = make_batches(static_cast<int>(kNvmeSteps * t.grad_accum), tokens, 5);
  for (int s = 0; s < kNvmeSteps; ++s) {
    RETURN_IF_ERROR(engine->zero_grads());
    double loss = 0;
    for (int64_t m = 0; m < t.grad_accum; ++m) {
      const Batch& b = batches[static_cast<size_t>(s * t.grad_accum + m)];
      ASSIGN_OR_RETURN(double l, engine->micro_batch(b.inputs.data(), b.targets.data(), t.micro_batch, t.seq_len,
                                                     1.0f / static_cast<float>(tokens * t.grad_accum),
                                                     m + 1 == t.grad_accum, 1e-3f));
      loss += l;
    }
    RETURN_IF_ERROR(engine->step(1e-3f).status());
    run.losses.push_back(loss);
    if (s == 0) run.first = engine->chunk_stats();
  }
  run.last = engine->chunk_stats();
  run.params.resize(static_cast<size_t>(engine->layout().total_size()));
  RETURN_IF_ERROR(
      engine->state().read_flat(StateKind::kParam, 0, run.params.size() * sizeof(float), run.params.data()));
  return run;
}

// The paged run's losses and weights are the reference's bits.
void expect_same_bits(const TrainedRun& paged, const TrainedRun& reference) {
  ASSERT_EQ(paged.losses.size(), reference.losses.size());
  for (size_t i = 0; i < paged.losses.size(); ++i) EXPECT_EQ(paged.losses[i], reference.losses[i]) << "step " << i;
  ASSERT_EQ(paged.params.size(), reference.params.size());
  size_t differ = 0;
  for (size_t i = 0; i < paged.params.size(); ++i)
    differ += std::memcmp(&paged.params[i], &reference.params[i], sizeof(float)) != 0;
  EXPECT_EQ(differ, 0u) << "parameters differ from the roomy run's bits";
}

// The run's plan against its engine's counters over the steps after the first: host-device
// traffic within `tol`, every tier's peak exactly, and the disk's bytes to within one chunk
// over those steps: the replay steps from its own first step, the engine from the cache the
// weights' loading left, and where the host has a few slots to spare that start can move one
// chunk more or less once (the steady step is the same).
// activation_copies: bytes of saved activations the plan counts copied each way per step between
// the compute's buffers and their chunks, which the chunk space's counters do not see.
void expect_plan_is_the_engines(const TrainedRun& run, double tol, uint64_t chunk_bytes, uint64_t activation_copies = 0) {
  const Plan& plan = run.plan;
  const double steps = kNvmeSteps - 1;
  const ChunkSpaceStats& a = run.first;
  const ChunkSpaceStats& b = run.last;
  const double h2d = static_cast<double>(b.host_to_device_bytes - a.host_to_device_bytes) / steps;
  const double d2h = static_cast<double>(b.device_to_host_bytes - a.device_to_host_bytes) / steps;
  auto within = [tol](double planned, double measured) {
    return std::fabs(planned - measured) <= tol * std::max(std::fabs(planned), std::fabs(measured));
  };
  const double h2d_planned = static_cast<double>(plan.h2d_bytes - activation_copies);
  const double d2h_planned = static_cast<double>(plan.d2h_bytes - activation_copies);
  EXPECT_TRUE(within(h2d_planned, h2d)) << h2d_planned << " planned, " << h2d << " measured";
  EXPECT_TRUE(within(d2h_planned, d2h)) << d2h_planned << " planned, " << d2h << " measured";
  const double read = static_cast<double>(b.nvme_to_host_bytes - a.nvme_to_host_bytes);
  const double written = static_cast<double>(b.host_to_nvme_bytes - a.host_to_nvme_bytes);
  // (The plan's bytes a step are its steps' average rounded to a byte.)
  const double bound = static_cast<double>(chunk_bytes) + steps;
  EXPECT_LE(std::fabs(static_cast<double>(plan.disk_read_bytes) * steps - read), bound)
      << plan.disk_read_bytes << " planned a step, " << read / steps << " read";
  EXPECT_LE(std::fabs(static_cast<double>(plan.disk_write_bytes) * steps - written), bound)
      << plan.disk_write_bytes << " planned a step, " << written / steps << " written";
  for (int t = 0; t < kNumTiers; ++t)
    EXPECT_EQ(plan.chunk_peak_bytes[static_cast<size_t>(t)], b.tiers[static_cast<size_t>(t)].peak_bytes)
        << tier_name(static_cast<Tier>(t));
}

class NvmeEveryKindTest : public ::testing::TestWithParam<Precision> {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("nvme_every_kind_" + std::to_string(::getpid()) + "_" + std::to_string(static_cast<int>(GetParam())));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  TrainConfig config() const {
    TrainConfig t;
    t.micro_batch = kNvmeMicroBatch;
    t.seq_len = kNvmeSeqLen;
    t.grad_accum = kNvmeAccum;
    t.precision = GetParam();
    t.keep_activations = "false";
    t.offload_activations = "false";
    t.memory_device = 1ull << 30;
    t.memory_host = 1ull << 30;
    t.chunk_size = PagedState::auto_chunk_bytes(model::ParamLayout(model_config()), t.precision);
    return t;
  }
  // Tight: the device holds the working set and little else, the host a quarter of the compute
  // copy and gradients, nvme the rest.
  TrainConfig tight_config(const model::ModelConfig& mc, const TrainConfig& roomy) const {
    TrainConfig tight = roomy;
    const Plan all_on_device = make_plan(make_plan_input(mc, roomy, DeviceKind::kCpu));
    tight.memory_device = all_on_device.min_device_budget + 2 * tight.chunk_size;
    const model::ParamLayout layout(mc);
    const StateLayout state = StateLayout::of(tight.precision);
    tight.memory_host = (PagedState::state_bytes(layout, state, StateKind::kParam) +
                         PagedState::state_bytes(layout, state, StateKind::kGrad)) / 4;
    tight.nvme_path = (dir_ / "nvme").string();
    tight.nvme_size = 1ull << 30;
    return tight;
  }
  fs::path dir_;
};

TEST_P(NvmeEveryKindTest, ParametersAndGradientsFourTimesTheHostTrainThroughNvmeBitwise) {
  const model::ModelConfig mc = model_config();
  const TrainConfig roomy = config();
  Result<TrainedRun> reference = train(mc, roomy);
  ASSERT_TRUE(reference.ok()) << reference.status().to_string();

  const TrainConfig tight = tight_config(mc, roomy);
  Result<TrainedRun> paged = train(mc, tight);
  ASSERT_TRUE(paged.ok()) << paged.status().to_string();

  const Plan& plan = paged->plan;
  EXPECT_GT(plan.nvme.param, 0u) << "no compute copy was placed on nvme";
  EXPECT_GT(plan.nvme.grad, 0u) << "no gradient was placed on nvme";
  int nvme_params = 0, nvme_grads = 0;
  for (int g = 0; g < plan.placement.num_groups(); ++g) {
    nvme_params += plan.placement.home(g, StateKind::kParam) == Tier::kNvme;
    nvme_grads += plan.placement.home(g, StateKind::kGrad) == Tier::kNvme;
  }
  EXPECT_GT(nvme_params, 0);
  EXPECT_GT(nvme_grads, 0);
  EXPECT_GT(paged->last.nvme_to_host_bytes, paged->first.nvme_to_host_bytes) << "nothing was read from nvme";

  ASSERT_NO_FATAL_FAILURE(expect_same_bits(*paged, *reference));
  // The plan's traffic per step and tier peaks are the engine's, byte for byte: no choice of
  // the engine's depends on how far a copy or a disk request has got.
  expect_plan_is_the_engines(*paged, 0.0, tight.chunk_size);
  // Each version of a chunk reaches the disk at most once (a written copy stays valid until the
  // chunk is written again). A step makes kNvmeAccum versions of each gradient that count, one per
  // micro-batch: AdamW's and the zeroing's are discarded, not written. Over the steps counted,
  // one version from before them may be written within them.
  const size_t grad = static_cast<size_t>(ChunkKind::kGrad);
  const uint64_t grads_written = paged->last.written_by_kind[grad] - paged->first.written_by_kind[grad];
  EXPECT_GT(grads_written, 0u);
  EXPECT_LE(grads_written, ((kNvmeSteps - 1) * kNvmeAccum + 1) * plan.nvme.grad);
}

// AdamW overlapping backward (optim.overlap_backward, no clipping) updates each group on a
// thread of its own as the last micro-batch hands the group over, and discards its gradients
// there, while the compute thread goes on paging other groups' through nvme: bit for bit as the
// roomy overlapped run. The compute thread acquires each update at its handover and releases it
// at the next, so the traffic and tier peaks are the plan's to the byte, however long the
// updates take beside backward. Also with the head tied to the embedding, whose batch holds the
// embedding's chunks when it hands the head over: the update waits for the batch to end.
TEST_P(NvmeEveryKindTest, OverlappedAdamWPagesThroughNvmeAsPlannedBitwise) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied embeddings" : "untied");
    model::ModelConfig mc = model_config();
    mc.tie_word_embeddings = tied;
    TrainConfig roomy = config();
    roomy.chunk_size = PagedState::auto_chunk_bytes(model::ParamLayout(mc), roomy.precision);
    roomy.overlap_backward = true;
    Result<TrainedRun> reference = train(mc, roomy, 0.0f);
    ASSERT_TRUE(reference.ok()) << reference.status().to_string();
    fs::remove_all(dir_ / "nvme");
    Result<TrainedRun> paged = train(mc, tight_config(mc, roomy), 0.0f);
    ASSERT_TRUE(paged.ok()) << paged.status().to_string();
    EXPECT_GT(paged->plan.nvme.grad, 0u) << "no gradient was placed on nvme";
    EXPECT_GT(paged->last.written_by_kind[static_cast<size_t>(ChunkKind::kGrad)], 0u) << "no gradient went to disk";
    ASSERT_NO_FATAL_FAILURE(expect_same_bits(*paged, *reference));
    expect_plan_is_the_engines(*paged, 0.0, roomy.chunk_size);
  }
}

// An MoE model (every token to each of 8 experts, so every expert moves as the plan's uniform
// routing says) whose host has room for all its optimizer state but a few experts' worth: the
// planner spills those experts of the last host layer to nvme one at a time (placement part
// rows) rather than the whole layer, the store homes each expert's chunks where its row says,
// and the run trains bit for bit as with room for everything, its traffic and peaks the plan's.
TEST_P(NvmeEveryKindTest, AnMoELayersExpertsSpillToNvmeOneAtATime) {
  model::ModelConfig mc = model_config();
  mc.num_hidden_layers = 4;
  mc.num_experts = 8;
  mc.num_experts_per_tok = 8;
  mc.moe_intermediate_size = 64;
  TrainConfig roomy = config();
  roomy.chunk_size = PagedState::auto_chunk_bytes(model::ParamLayout(mc), roomy.precision);
  Result<TrainedRun> reference = train(mc, roomy);
  ASSERT_TRUE(reference.ok()) << reference.status().to_string();

  TrainConfig tight = roomy;
  const Plan all_on_device = make_plan(make_plan_input(mc, roomy, DeviceKind::kCpu));
  tight.memory_device = all_on_device.min_device_budget + 2 * tight.chunk_size;
  const uint64_t host_needed = make_plan(make_plan_input(mc, tight, DeviceKind::kCpu)).host.total();
  tight.nvme_path = (dir_ / "nvme").string();
  tight.nvme_size = 1ull << 30;
  // The largest host budget, in steps of a chunk below what the plan needs with nothing on nvme,
  // whose plan spills experts without their whole layer.
  Plan spilled;
  for (uint64_t host = host_needed; host > tight.chunk_size && !(spilled.fits && spilled.nvme_optimizer_experts > 0);
       host -= tight.chunk_size) {
    tight.memory_host = host;
    spilled = make_plan(make_plan_input(mc, tight, DeviceKind::kCpu));
  }
  ASSERT_TRUE(spilled.fits) << spilled.problem;
  ASSERT_GT(spilled.nvme_optimizer_experts, 0) << "no host budget spills experts alone";
  // (All of them, the dense part left, is counted so too.)
  ASSERT_LE(spilled.nvme_optimizer_experts, mc.num_experts);
  std::printf("%lld of the layer's %lld experts spilled\n", static_cast<long long>(spilled.nvme_optimizer_experts),
              static_cast<long long>(mc.num_experts));
  // The rows: one layer keeps its dense part's optimizer state on the host and has its last
  // experts' on nvme, the first ones' on the host; the compute copy stays with its group.
  int partial = -1;
  for (int g = 0; g < spilled.placement.num_groups(); ++g) {
    if (spilled.placement.home(g, StateKind::kAdamM) != Tier::kHost) continue;
    for (int e : spilled.placement.parts(g))
      if (spilled.placement.home(g, StateKind::kAdamM, e) == Tier::kNvme) partial = g;
  }
  ASSERT_GE(partial, 1) << "no layer has experts on nvme and the rest on the host";
  ASSERT_EQ(spilled.placement.parts(partial).size(), static_cast<size_t>(mc.num_experts));
  for (int e = 0; e < mc.num_experts; ++e) {
    const bool nvme = e >= mc.num_experts - spilled.nvme_optimizer_experts;
    for (StateKind k : {StateKind::kAdamM, StateKind::kAdamV})
      EXPECT_EQ(spilled.placement.home(partial, k, e), nvme ? Tier::kNvme : Tier::kHost) << e;
    EXPECT_EQ(spilled.placement.home(partial, StateKind::kParam, e), spilled.placement.home(partial, StateKind::kParam))
        << e;
  }

  Result<TrainedRun> paged = train(mc, tight);
  ASSERT_TRUE(paged.ok()) << paged.status().to_string();
  const Plan& plan = paged->plan;
  EXPECT_EQ(plan.nvme_optimizer_experts, spilled.nvme_optimizer_experts);
  EXPECT_GT(paged->last.nvme_to_host_bytes, paged->first.nvme_to_host_bytes) << "nothing was read from nvme";
  ASSERT_NO_FATAL_FAILURE(expect_same_bits(*paged, *reference));
  expect_plan_is_the_engines(*paged, GetParam() == Precision::kFp32 ? 0.0 : 0.05, tight.chunk_size);
  // nvme holds homes only: the groups and the experts the plan spilled, chunk for chunk.
  EXPECT_EQ(plan.nvme.total(), paged->last.tiers[static_cast<size_t>(Tier::kNvme)].peak_bytes);
}

// A vocabulary far larger than any other tensor: the embedding and the head go in row blocks of
// about a chunk each, so each of those groups spans many chunks of every kind. AdamW and the
// weights' loading go update slice by slice (StateStore's update slices, a chunk of each kind at
// a time), so the smallest host budget the planner finds is a handful of chunks, fewer than one
// kind of the embedding alone. At that budget the run trains through nvme bit for bit as with
// room for everything, its traffic and peaks the plan's.
TEST_P(NvmeEveryKindTest, TheSmallestHostBudgetIsAHandfulOfChunksAndTrainsBitwise) {
  model::ModelConfig mc = model_config();
  mc.num_hidden_layers = 4;
  mc.vocab_size = 16384;
  TrainConfig roomy = config();
  const model::ParamLayout layout(mc);
  roomy.chunk_size = PagedState::auto_chunk_bytes(layout, roomy.precision);
  ASSERT_GT(layout.at(layout.embed_tokens()).num_blocks(), 8) << "the embedding is not in row blocks";
  Result<TrainedRun> reference = train(mc, roomy);
  ASSERT_TRUE(reference.ok()) << reference.status().to_string();

  TrainConfig tight = roomy;
  const Plan all_on_device = make_plan(make_plan_input(mc, roomy, DeviceKind::kCpu));
  tight.memory_device = all_on_device.min_device_budget + 2 * tight.chunk_size;
  tight.nvme_path = (dir_ / "nvme").string();
  tight.nvme_size = 1ull << 30;
  tight.memory_host = smallest_host_budget(mc, tight, DeviceKind::kCpu);
  ASSERT_GT(tight.memory_host, 0u);
  const StateLayout state = StateLayout::of(tight.precision);
  const uint64_t embedding = PagedState::state_bytes(layout, state, StateKind::kGrad) * layout.at(layout.embed_tokens()).numel /
                             layout.total_size();
  std::printf("smallest memory.host %llu chunks; the embedding's gradients alone %llu bytes (%.1f chunks)\n",
              static_cast<unsigned long long>(tight.memory_host / tight.chunk_size),
              static_cast<unsigned long long>(embedding), static_cast<double>(embedding) / static_cast<double>(tight.chunk_size));
  EXPECT_LE(tight.memory_host, 12 * tight.chunk_size);
  EXPECT_LT(tight.memory_host, embedding);
  Result<TrainedRun> paged = train(mc, tight);
  ASSERT_TRUE(paged.ok()) << paged.status().to_string();
  EXPECT_GT(paged->last.nvme_to_host_bytes, paged->first.nvme_to_host_bytes) << "nothing was read from nvme";
  EXPECT_LE(paged->last.tiers[static_cast<size_t>(Tier::kHost)].peak_bytes, tight.memory_host);
  ASSERT_NO_FATAL_FAILURE(expect_same_bits(*paged, *reference));
  // The tier peaks exactly, the disk's bytes as above; the copies between host and device within 10%:
  // with a host of a few chunks, whether a prefetch to the device finds its chunk's disk read
  // still running (and leaves the copy to the acquisition) depends on timing far more often than
  // above, and a copy made early that eviction then undoes is made twice. The replay, which
  // knows no timing, makes every prefetch (measured 3-8% more than the engine).
  expect_plan_is_the_engines(*paged, 0.10, tight.chunk_size);
}

// Saved activations beyond the host: with activation offload and the smallest host budget the
// planner finds (every kind of state already on nvme but a handful of chunks), the last layers'
// saved activations are homed on nvme too, written and read through host slots, and the run
// trains as with room for everything, its traffic within 10% and its peaks the plan's.
TEST_P(NvmeEveryKindTest, SavedActivationsTheHostCannotHoldPageThroughNvmeBitwise) {
  const model::ModelConfig mc = model_config();
  TrainConfig roomy = config();
  roomy.seq_len = 256;
  roomy.offload_activations = "true";
  Result<TrainedRun> reference = train(mc, roomy);
  ASSERT_TRUE(reference.ok()) << reference.status().to_string();

  TrainConfig tight = tight_config(mc, roomy);
  tight.memory_host = smallest_host_budget(mc, tight, DeviceKind::kCpu);
  ASSERT_GT(tight.memory_host, 0u);
  const StateLayout state = StateLayout::of(tight.precision);
  const uint64_t per_layer = static_cast<uint64_t>(tight.micro_batch * tight.seq_len * mc.hidden_size) *
                             dtype_size(state.activation_dtype());
  const uint64_t saved = StateStore::activation_chunks(model::saved_activation_count(static_cast<int>(mc.num_hidden_layers)),
                                                       per_layer, tight.chunk_size) * tight.chunk_size;
  EXPECT_LT(tight.memory_host, saved) << "the host could hold every saved activation";
  Result<TrainedRun> paged = train(mc, tight);
  ASSERT_TRUE(paged.ok()) << paged.status().to_string();
  EXPECT_GT(paged->plan.nvme_activation_chunks, 0);
  EXPECT_GT(paged->plan.nvme.act, 0u);
  EXPECT_LE(paged->last.tiers[static_cast<size_t>(Tier::kHost)].peak_bytes, tight.memory_host);
  ASSERT_NO_FATAL_FAILURE(expect_same_bits(*paged, *reference));
  // Every layer's input copied out in forward and back in for its backward, each micro-batch.
  const uint64_t copies = static_cast<uint64_t>(tight.grad_accum * mc.num_hidden_layers) * per_layer;
  expect_plan_is_the_engines(*paged, 0.10, tight.chunk_size, copies);
}

INSTANTIATE_TEST_SUITE_P(Recipes, NvmeEveryKindTest, ::testing::Values(Precision::kFp32, Precision::kBf16),
                         [](const ::testing::TestParamInfo<Precision>& p) { return std::string(precision_name(p.param)); });

}  // namespace
}  // namespace strata
