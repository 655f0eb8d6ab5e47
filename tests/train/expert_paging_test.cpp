// Expert-aware fetching in the paged training path: each expert of an MoE layer has chunks of
// its own and only the experts the router gave tokens in a micro-batch are fetched (with their
// gradients in backward). The result stays bitwise that of the flat buffers, and the bytes
// moved host -> device drop by exactly the experts that were skipped.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <span>

#include <nlohmann/json.hpp>

#include "core/cpu_device.h"
#include "core/io_engine.h"
#include "model/decoder.h"
#include "reference_adamw.h"
#include "train/paged_state.h"
#include "train_test_util.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

// 4 tokens per micro-batch, 2 experts each, 8 experts: most micro-batches leave experts idle.
constexpr int64_t kExpertB = 1, kExpertT = 4, kExpertSteps = 4, kExpertAccum = 2;
constexpr uint64_t kExpertChunk = 16 * kKiB;  // one expert (3 x 4 KiB) per chunk, a layer's rest in 2
constexpr float kLr = 1e-2f;

// A small Qwen2-MoE: layers 0 and 2 have 8 experts (top-2) and a shared expert, layer 1 is dense.
model::ModelConfig moe_config() {
  nlohmann::json j = {
      {"architectures", {"Qwen2MoeForCausalLM"}}, {"vocab_size", 64}, {"hidden_size", 32},
      {"intermediate_size", 48}, {"num_hidden_layers", 3}, {"num_attention_heads", 4},
      {"num_key_value_heads", 2}, {"max_position_embeddings", 64}, {"num_experts", 8},
      {"num_experts_per_tok", 2}, {"moe_intermediate_size", 32},
      {"shared_expert_intermediate_size", 24}, {"mlp_only_layers", {1}},
      {"router_aux_loss_coef", 0.01}, {"output_router_logits", true}, {"tie_word_embeddings", false}};
  Result<model::ModelConfig> c = model::ModelConfig::from_json(j, "expert_paging_test");
  CHECK_MSG(c.ok(), c.status().to_string());
  return *c;
}

std::vector<Batch> moe_batches(const model::ModelConfig& mc) {
  std::vector<Batch> batches = make_batches(kExpertSteps * kExpertAccum, kExpertB * kExpertT, 17);
  for (Batch& b : batches) {
    for (int32_t& t : b.inputs) t %= static_cast<int32_t>(mc.vocab_size);
    for (int32_t& t : b.targets) t %= static_cast<int32_t>(mc.vocab_size);
  }
  return batches;
}

// Forwards to a PagedState, counting the experts the model asks for; with `all`, it begins every
// expert of the layer instead, as a store without expert chunks would fetch them.
class CountingAccess : public model::ParamAccess {
 public:
  CountingAccess(PagedState& ps, int64_t num_experts, bool all) : ps_(ps), all_(all) {
    every_.resize(static_cast<size_t>(num_experts));
    std::iota(every_.begin(), every_.end(), 0);
  }
  Status begin(int group, bool params, bool grads) override { return ps_.begin(group, params, grads); }
  void end(int group, bool params, bool grads) override { ps_.end(group, params, grads); }
  const void* param(int64_t offset) override { return ps_.param(offset); }
  DType param_dtype() const override { return ps_.param_dtype(); }
  bool stream_ordered() const override { return ps_.stream_ordered(); }
  void set_compute_stream(Stream* stream) override { ps_.set_compute_stream(stream); }
  float* grad(int64_t offset) override { return ps_.grad(offset); }
  Status begin_experts(int group, std::span<const int> experts, bool params, bool grads) override {
    requested += static_cast<int64_t>(experts.size());
    offered += static_cast<int64_t>(every_.size());
    return ps_.begin_experts(group, all_ ? std::span<const int>(every_) : experts, params, grads);
  }
  void end_experts(int group, std::span<const int> experts, bool params, bool grads) override {
    ps_.end_experts(group, all_ ? std::span<const int>(every_) : experts, params, grads);
  }
  int64_t requested = 0;  // experts the model began, over every begin_experts call
  int64_t offered = 0;    // experts those layers have

 private:
  PagedState& ps_;
  const bool all_;
  std::vector<int> every_;
};

struct RunResult {
  std::vector<double> losses;
  std::vector<float> params;
  ChunkSpaceStats stats;
  int64_t requested = 0, offered = 0;
  int64_t idle_expert_steps = 0;    // (step, MoE layer, expert) without a token in the whole step
  int64_t expert_param_chunks = 0;  // chunks of one expert's parameters
  int64_t overlapped_updates = 0;
  size_t chunks = 0;                // chunks of the whole state
  std::vector<size_t> cursors;      // the store's schedule cursor after each step
};

// Net: model::LlamaModel (the fp32 recipe) or model::LlamaModelBf16 (the bf16 recipe).
template <class Net>
RunResult run_flat_with(const model::ModelConfig& mc, const std::vector<Batch>& batches, float grad_clip = 0.5f) {
  model::FlatModel<Net> net(mc);
  net.init_weights(7);
  RunResult r;
  r.losses = train_flat(net, batches, kExpertSteps, kExpertAccum, kExpertB, kExpertT, grad_clip, kLr);
  r.params.assign(net.params(), net.params() + net.layout().total_size());
  return r;
}

template <class Net>
RunResult run_paged_with(Precision precision, const model::ModelConfig& mc, const std::vector<Batch>& batches,
                         bool all_experts, uint64_t device_bytes, uint64_t host_bytes, uint64_t nvme_bytes,
                         const std::string& nvme_dir, size_t lookahead, bool overlap_optimizer = false,
                         uint64_t chunk_bytes = kExpertChunk) {
  auto device = CpuDevice::create(0, 0);
  CHECK(device.ok());
  auto io = make_io_engine({.kind = "threads"});
  CHECK(io.ok());
  // Made on the device: its ops are queued on a compute stream, and paging is stream-ordered.
  Net net(mc, typename Net::OpSet(device->get()));
  PagedStateOptions po;
  po.precision = precision;
  po.device_bytes = device_bytes;
  po.host_bytes = host_bytes;
  po.nvme_bytes = nvme_bytes;
  po.nvme_dir = nvme_dir;
  po.chunk_bytes = chunk_bytes;
  po.lookahead = lookahead;
  po.grad_accum = kExpertAccum;
  po.optimizer = optimizer_config(overlap_optimizer ? 0.0f : 0.5f);
  po.overlap_optimizer = overlap_optimizer;
  auto paged = PagedState::create(**device, io->get(), net.layout(), po);
  EXPECT_TRUE(paged.ok()) << paged.status().to_string();
  RunResult r;
  if (!paged.ok()) return r;
  PagedState& ps = **paged;
  EXPECT_TRUE(ps.load_params(initial_params(net.layout(), 7).data()).ok());
  r.expert_param_chunks = static_cast<int64_t>(ps.store().part_chunk_count(1, 0, StateKind::kParam));
  r.chunks = ps.store().space().num_chunks();
  CountingAccess access(ps, mc.num_experts, all_experts);
  net.set_access(&access);
  for (int s = 0; s < kExpertSteps; ++s) {
    EXPECT_TRUE(ps.zero_grads().ok());
    net.reset_expert_token_counts();
    double loss = 0;
    for (int m = 0; m < kExpertAccum; ++m) {
      const Batch& b = batches[s * kExpertAccum + m];
      if (m == kExpertAccum - 1) ps.begin_last_micro_batch(kLr);
      Result<double> l = net.compute(b.inputs.data(), b.targets.data(), kExpertB, kExpertT, 1.0f / (kExpertAccum * kExpertB * kExpertT), true);
      EXPECT_TRUE(l.ok()) << l.status().to_string();
      if (l.ok()) loss += *l;
    }
    for (int64_t l = 0; l < mc.num_hidden_layers; ++l) {
      if (!mc.is_moe_layer(l)) continue;
      for (int64_t e = 0; e < mc.num_experts; ++e)
        r.idle_expert_steps += net.expert_token_counts()[l * mc.num_experts + e] == 0 ? 1 : 0;
    }
    Result<double> norm = ps.clip_and_step(kLr);
    EXPECT_TRUE(norm.ok()) << norm.status().to_string();
    r.losses.push_back(loss);
    r.cursors.push_back(ps.store().schedule_cursor());
  }
  net.set_access(nullptr);
  r.params.assign(static_cast<size_t>(net.layout().total_size()), 0.0f);
  EXPECT_TRUE(ps.store_params(r.params.data()).ok());
  r.stats = ps.stats();
  r.requested = access.requested;
  r.offered = access.offered;
  r.overlapped_updates = ps.overlapped_updates();
  return r;
}

void expect_bitwise_equal(const RunResult& a, const RunResult& b, const model::ModelConfig& mc) {
  expect_runs_bitwise_equal(a.losses, a.params, b.losses, b.params, mc);
}

// Every test runs on both recipes, fp32 and bf16.
class ExpertPagingTest : public ::testing::TestWithParam<Precision> {
 protected:
  // Host chunks for a budget of n in the fp32 recipe: AdamW holds a fifth kind (the master) of
  // a group in host memory at once in the bf16 recipe.
  uint64_t host_chunks(uint64_t n) const { return GetParam() == Precision::kBf16 ? n * 5 / 4 : n; }
  template <class... Args>
  RunResult run_flat(Args&&... args) {
    return GetParam() == Precision::kBf16 ? run_flat_with<model::LlamaModelBf16>(std::forward<Args>(args)...)
                                          : run_flat_with<model::LlamaModel>(std::forward<Args>(args)...);
  }
  template <class... Args>
  RunResult run_paged(Args&&... args) {
    return GetParam() == Precision::kBf16
               ? run_paged_with<model::LlamaModelBf16>(GetParam(), std::forward<Args>(args)...)
               : run_paged_with<model::LlamaModel>(GetParam(), std::forward<Args>(args)...);
  }

  void SetUp() override {
    dir_ = testing::fresh_test_dir("strata_experts");
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

// Budgets of a few chunks: the dense parts and the experts travel through host memory and
// NVMe, and every expert without tokens keeps its zero gradient and still gets its AdamW
// update (weight decay, moment decay) as in the flat run.
TEST_P(ExpertPagingTest, TightBudgetsThroughHostAndNvmeMatchFlatBitwise) {
  const model::ModelConfig mc = moe_config();
  const auto batches = moe_batches(mc);
  const RunResult flat = run_flat(mc, batches);
  // Device: backward of an MoE layer pins 2 + 2 dense chunks and up to 8 + 8 expert chunks (all
  // of them when fetching every expert). Host: AdamW pins a whole MoE layer, 4 kinds x 10 chunks.
  const std::string nvme = (dir_ / "nvme").string();
  fs::create_directories(nvme);
  const RunResult aware = run_paged(mc, batches, false, 24 * kExpertChunk, host_chunks(48) * kExpertChunk, 256 * kExpertChunk, nvme, 2);
  const RunResult all = run_paged(mc, batches, true, 24 * kExpertChunk, host_chunks(48) * kExpertChunk, 256 * kExpertChunk, nvme, 2);
  expect_bitwise_equal(flat, aware, mc);
  expect_bitwise_equal(flat, all, mc);
  // Some micro-batches left experts without tokens, and those were not fetched.
  EXPECT_LT(aware.requested, aware.offered);
  EXPECT_EQ(all.requested, aware.requested);
  EXPECT_GT(aware.idle_expert_steps, 0);
  EXPECT_GT(aware.stats.host_to_nvme_bytes, 0u) << "the nvme tier was never written";
  EXPECT_GT(aware.stats.nvme_to_host_bytes, 0u) << "the nvme tier was never read";
  EXPECT_LT(aware.stats.host_to_device_bytes, all.stats.host_to_device_bytes);
  std::printf("tight budgets: experts begun %lld of %lld; host->device %llu bytes with expert-aware fetching, "
              "%llu fetching every expert\n",
              static_cast<long long>(aware.requested), static_cast<long long>(aware.offered),
              static_cast<unsigned long long>(aware.stats.host_to_device_bytes),
              static_cast<unsigned long long>(all.stats.host_to_device_bytes));
}

// With room for everything on the device (and no prefetch), the only host -> device traffic is
// each step's parameter fetch (AdamW updates them in host memory): fetching every expert moves
// exactly one expert's chunks more per (step, MoE layer, expert without a token in the step).
TEST_P(ExpertPagingTest, IdleExpertsAreNeverFetched) {
  const model::ModelConfig mc = moe_config();
  const auto batches = moe_batches(mc);
  const RunResult flat = run_flat(mc, batches);
  const RunResult aware = run_paged(mc, batches, false, 256 * kExpertChunk, 256 * kExpertChunk, 0, "", 0);
  const RunResult all = run_paged(mc, batches, true, 256 * kExpertChunk, 256 * kExpertChunk, 0, "", 0);
  expect_bitwise_equal(flat, aware, mc);
  expect_bitwise_equal(flat, all, mc);
  ASSERT_EQ(aware.expert_param_chunks, 1);
  EXPECT_GT(aware.idle_expert_steps, 0);
  EXPECT_EQ(all.stats.host_to_device_bytes - aware.stats.host_to_device_bytes,
            static_cast<uint64_t>(aware.idle_expert_steps) * kExpertChunk);
  std::printf("roomy budgets: %lld idle (step, layer, expert) of %lld; host->device %llu bytes with expert-aware "
              "fetching, %llu fetching every expert\n",
              static_cast<long long>(aware.idle_expert_steps),
              static_cast<long long>(kExpertSteps * mc.num_moe_layers() * mc.num_experts),
              static_cast<unsigned long long>(aware.stats.host_to_device_bytes),
              static_cast<unsigned long long>(all.stats.host_to_device_bytes));
}

// AdamW overlapping backward starts on a layer once backward releases it, experts included:
// the model ends the experts before the layer, so the update sees their final gradients.
TEST_P(ExpertPagingTest, OptimizerOverlappingBackwardMatchesFlatBitwise) {
  const model::ModelConfig mc = moe_config();
  const auto batches = moe_batches(mc);
  const RunResult flat = run_flat(mc, batches, /*grad_clip=*/0.0f);
  const std::string nvme = (dir_ / "nvme").string();
  fs::create_directories(nvme);
  const RunResult overlapped =
      run_paged(mc, batches, false, 24 * kExpertChunk, host_chunks(48) * kExpertChunk, 256 * kExpertChunk, nvme, 2, /*overlap_optimizer=*/true);
  expect_bitwise_equal(flat, overlapped, mc);
  EXPECT_EQ(overlapped.overlapped_updates, kExpertSteps * (mc.num_hidden_layers + 2));
  // The compute thread acquires each update at its handover, along the schedule's cursor, and
  // the worker only applies it: every entry of the step is followed, the updates' included, and
  // after every step the cursor has wrapped to the next step's first, wherever the worker had
  // got to.
  ASSERT_EQ(overlapped.cursors.size(), static_cast<size_t>(kExpertSteps));
  for (size_t s = 0; s < overlapped.cursors.size(); ++s) EXPECT_EQ(overlapped.cursors[s], 0u) << "after step " << s;
}

// Chunks four times an expert's size (as when a large embedding sets the chunk size): the
// experts share chunks instead of each padding one, and the run still pages through host and
// NVMe to bitwise the flat result.
TEST_P(ExpertPagingTest, SmallExpertsShareChunksAndMatchFlatBitwise) {
  const model::ModelConfig mc = moe_config();
  const auto batches = moe_batches(mc);
  const RunResult flat = run_flat(mc, batches);
  const uint64_t chunk = 64 * kKiB;
  const std::string nvme = (dir_ / "nvme").string();
  fs::create_directories(nvme);
  const RunResult shared = run_paged(mc, batches, false, 8 * chunk, 12 * chunk, 64 * chunk, nvme, 2, false, chunk);
  expect_bitwise_equal(flat, shared, mc);
  EXPECT_GT(shared.stats.host_to_nvme_bytes, 0u) << "the nvme tier was never written";
  EXPECT_GT(shared.stats.nvme_to_host_bytes, 0u) << "the nvme tier was never read";
  std::printf("experts of 12 KiB in 64 KiB chunks: %zu chunks in all\n", shared.chunks);
  // One chunk per expert and kind would take 64 chunks for the experts alone.
  EXPECT_LT(shared.chunks, StateLayout().kinds().size() * static_cast<size_t>(mc.num_moe_layers() * mc.num_experts));
}

INSTANTIATE_TEST_SUITE_P(Recipes, ExpertPagingTest, ::testing::Values(Precision::kFp32, Precision::kBf16),
                         [](const ::testing::TestParamInfo<Precision>& info) { return precision_name(info.param); });

}  // namespace
}  // namespace strata
