// Paging invariance (DESIGN §3.2): training with budgets that force parameters, gradients and
// Adam moments through the device, host and nvme tiers gives bitwise the losses and parameters
// of a run whose state sits in flat buffers.
#include "train/paged_state.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>

#include "core/cpu_device.h"
#include "core/io_engine.h"
#include "kernels/bf16.h"
#include "model/decoder.h"
#include "offload/placement.h"
#include "idle_comm.h"
#include "reference_adamw.h"
#include "train_test_util.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

struct RunResult {
  std::vector<double> losses;
  std::vector<float> params;
  ChunkSpaceStats stats;
  int64_t overlapped_updates = 0;
  int64_t activation_bytes = 0;  // the model's activation table
  int64_t handover_sums = 0;     // groups summed over the ranks at handover
  std::vector<size_t> cursors;   // the store's schedule cursor after each step
  size_t after_followed = 0;     // the entry after the schedule's last one acquired on the cursor
};

constexpr int64_t kB = 2, kT = 16, kSteps = 4, kAccum = 2;

constexpr float kClip = 0.5f;

// The chaos suite's planted bug (the test at the end): a device in chaos mode with this seed,
// and a chunk space whose acquire orders nothing. Off (seed 0) for every other test.
struct PlantedBug {
  uint64_t chaos_seed = 0;
  bool skip_acquire_wait = false;
};
PlantedBug g_planted;

// About one layer's worth of bytes: budgets of a few such chunks force paging.
uint64_t tight_chunk_bytes(const model::ParamLayout& layout, const model::ModelConfig& mc) {
  uint64_t largest = 0;
  for (const auto& t : layout.tensors()) largest = std::max<uint64_t>(largest, t.block_numel(0) * 4);
  const uint64_t layer_bytes = static_cast<uint64_t>(layout.total_size()) * 4 / (mc.num_hidden_layers + 1);
  return std::max(largest, layer_bytes);
}

// Net: model::LlamaModel (the fp32 recipe) or model::LlamaModelBf16 (the bf16 recipe).
template <class Net>
RunResult run_flat_with(const model::ModelConfig& mc, const std::vector<Batch>& batches, float grad_clip = kClip) {
  model::FlatModel<Net> net(mc);
  net.init_weights(7);
  RunResult r;
  r.losses = train_flat(net, batches, kSteps, kAccum, kB, kT, grad_clip, 1e-2f);
  r.params.assign(net.params(), net.params() + net.layout().total_size());
  r.activation_bytes = net.activation_bytes();
  return r;
}

template <class Net>
RunResult run_paged_with(Precision precision, const model::ModelConfig& mc, const std::vector<Batch>& batches,
                         uint64_t device_bytes, uint64_t host_bytes, uint64_t nvme_bytes, const std::string& nvme_dir,
                         bool offload_activations = false, bool overlap_optimizer = false, float grad_clip = kClip,
                         bool handover_sums = false) {
  auto device = g_planted.chaos_seed != 0 ? CpuDevice::create(0, 0, g_planted.chaos_seed) : CpuDevice::create(0, 0);
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
  po.grad_accum = kAccum;
  po.optimizer = optimizer_config(grad_clip);
  po.offload_activations = offload_activations;
  po.activation_tokens = kB * kT;
  po.overlap_optimizer = overlap_optimizer;
  // Rank 0 of 2 with the state whole (ZeRO-0), summing each group's gradients at handover over
  // collectives that move nothing: the run is one process's, with the sums' acquisitions.
  testing::IdleComm comm(0, 2), handover(0, 2);
  if (handover_sums) {
    const int groups = static_cast<int>(model::ParamLayout(mc).num_layers()) + 2;
    Placement placement(groups);  // in host memory, the optimizer's kinds on nvme when there is one
    for (int g = 0; g < groups; ++g)
      for (StateKind k : StateLayout::of(precision).kinds())
        if (k != StateKind::kParam && k != StateKind::kGrad && nvme_bytes > 0) placement.place(g, k, Tier::kNvme, 0);
    placement.shard_over(2, /*zero=*/0);
    po.placement = placement;
    po.overlap_reduction = true;
  }
  auto paged = PagedState::create(**device, io->get(), net.layout(), po);
  EXPECT_TRUE(paged.ok()) << paged.status().to_string();
  RunResult r;
  if (!paged.ok()) return r;
  PagedState& ps = **paged;
  EXPECT_TRUE(ps.load_params(initial_params(net.layout(), 7).data()).ok());
  ps.store().space().set_test_skip_acquire_wait(g_planted.skip_acquire_wait);
  net.set_access(&ps);
  if (handover_sums) ps.set_comm(&comm, &handover);
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_TRUE(ps.zero_grads().ok());
    double loss = 0;
    for (int m = 0; m < kAccum; ++m) {
      const Batch& b = batches[s * kAccum + m];
      if (m == kAccum - 1) ps.begin_last_micro_batch(1e-2f);
      Result<double> l = net.compute(b.inputs.data(), b.targets.data(), kB, kT, 1.0f / (kAccum * kB * kT), true);
      // A planted bug may make numbers an op refuses: the run then is not the flat one either.
      if (!g_planted.skip_acquire_wait) EXPECT_TRUE(l.ok()) << l.status().to_string();
      loss += l.ok() ? *l : std::nan("");
    }
    Result<double> norm = ps.clip_and_step(1e-2f);
    if (!g_planted.skip_acquire_wait) EXPECT_TRUE(norm.ok()) << norm.status().to_string();
    r.losses.push_back(loss);
    r.cursors.push_back(ps.store().schedule_cursor());
  }
  const std::vector<GroupAccess> schedule = ps.step_program().schedule(kAccum);
  for (size_t i = 0; i < schedule.size(); ++i)
    if (schedule[i].cursor == ScheduleCursor::kFollow) r.after_followed = (i + 1) % schedule.size();
  net.set_access(nullptr);
  r.params.assign(static_cast<size_t>(net.layout().total_size()), 0.0f);
  EXPECT_TRUE(ps.store_params(r.params.data()).ok());
  r.stats = ps.stats();
  r.overlapped_updates = ps.overlapped_updates();
  r.handover_sums = ps.handover_sums();
  r.activation_bytes = net.activation_bytes();
  return r;
}

// The flat and paged runs of a recipe.
template <class... Args>
RunResult run_flat(Precision precision, Args&&... args) {
  return precision == Precision::kBf16 ? run_flat_with<model::LlamaModelBf16>(std::forward<Args>(args)...)
                                       : run_flat_with<model::LlamaModel>(std::forward<Args>(args)...);
}
template <class... Args>
RunResult run_paged(Precision precision, Args&&... args) {
  return precision == Precision::kBf16 ? run_paged_with<model::LlamaModelBf16>(precision, std::forward<Args>(args)...)
                                       : run_paged_with<model::LlamaModel>(precision, std::forward<Args>(args)...);
}

void expect_bitwise_equal(const RunResult& a, const RunResult& b, const model::ModelConfig& mc) {
  expect_runs_bitwise_equal(a.losses, a.params, b.losses, b.params, mc);
}

// Every invariance test runs on both recipes: tied or untied embeddings, fp32 or bf16.
struct Variant {
  bool tied = false;
  Precision precision = Precision::kFp32;
};

void PrintTo(const Variant& v, std::ostream* os) {
  *os << (v.tied ? "tied " : "untied ") << precision_name(v.precision);
}

class PagedStateTest : public ::testing::TestWithParam<Variant> {
 protected:
  // The recipe's flat and paged runs (the free functions above with this test's precision).
  template <class... Args>
  RunResult run_flat(Args&&... args) {
    return strata::run_flat(GetParam().precision, std::forward<Args>(args)...);
  }
  template <class... Args>
  RunResult run_paged(Args&&... args) {
    return strata::run_paged(GetParam().precision, std::forward<Args>(args)...);
  }
  StateLayout state_layout() const { return StateLayout::of(GetParam().precision); }

  void SetUp() override {
    // One directory per test and process: ctest runs tests of this suite in parallel.
    dir_ = testing::fresh_test_dir("strata_paged");
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_P(PagedStateTest, RoomyBudgetsMatchFlatBuffersBitwise) {
  const model::ModelConfig mc = tiny_config(GetParam().tied);
  const auto batches = make_batches(kSteps * kAccum, kB * kT, 11);
  RunResult flat = run_flat(mc, batches);
  RunResult paged = run_paged(mc, batches, 64ull << 20, 64ull << 20, 0, "");
  expect_bitwise_equal(flat, paged, mc);
  EXPECT_EQ(paged.stats.host_to_nvme_bytes, 0u);
}

TEST_P(PagedStateTest, TightBudgetsThroughHostAndNvmeMatchBitwise) {
  const model::ModelConfig mc = tiny_config(GetParam().tied);
  const auto batches = make_batches(kSteps * kAccum, kB * kT, 11);
  RunResult flat = run_flat(mc, batches);
  // A few chunks per tier: every kind of state has to move between all three.
  model::ParamLayout layout(mc);
  const uint64_t chunk = tight_chunk_bytes(layout, mc);
  fs::create_directories(dir_ / "nvme");
  RunResult paged = run_paged(mc, batches, 6 * chunk, 8 * chunk, 64 * chunk, (dir_ / "nvme").string());
  expect_bitwise_equal(flat, paged, mc);
  EXPECT_GT(paged.stats.device_to_host_bytes, 0u);
  EXPECT_GT(paged.stats.host_to_nvme_bytes, 0u) << "the nvme tier was never written";
  EXPECT_GT(paged.stats.nvme_to_host_bytes, 0u) << "the nvme tier was never read";
}

// A vocabulary far larger than any other tensor goes in row blocks, each a store tensor of its
// own, so chunks are sized by the layers instead of by the embedding; the model computes the
// embedding and the LM head block by block in flat and paged runs alike, which stay bitwise equal.
TEST_P(PagedStateTest, VocabularyInRowBlocksPagesBitwiseLikeFlat) {
  model::ModelConfig mc = tiny_config(GetParam().tied);
  mc.vocab_size = 2000;  // 2000 x 32 against 48 x 32 for the largest layer tensor
  model::ParamLayout layout(mc);
  const model::TensorSpec& embed = layout.at(layout.embed_tokens());
  ASSERT_GT(embed.block_rows, 0);
  EXPECT_EQ(embed.num_blocks(), (2000 + embed.block_rows - 1) / embed.block_rows);
  EXPECT_LT(PagedState::auto_chunk_bytes(layout), static_cast<uint64_t>(embed.numel) * sizeof(float));
  const auto batches = make_batches(kSteps * kAccum, kB * kT, 17);
  RunResult flat = run_flat(mc, batches);
  // The LM head pins every block of the vocabulary, parameters and gradients (with tied
  // embeddings, in the same group as the embedding), so the device holds that much plus a layer.
  const uint64_t chunk = tight_chunk_bytes(layout, mc);
  const uint64_t vocab_bytes = static_cast<uint64_t>(embed.numel) * sizeof(float);
  fs::create_directories(dir_ / "nvme");
  RunResult tight = run_paged(mc, batches, 2 * vocab_bytes + 4 * chunk, 2 * vocab_bytes + 8 * chunk, 256 * chunk,
                              (dir_ / "nvme").string());
  expect_bitwise_equal(flat, tight, mc);
  EXPECT_GT(tight.stats.host_to_nvme_bytes, 0u) << "the nvme tier was never written";
  RunResult roomy = run_paged(mc, batches, 64ull << 20, 64ull << 20, 0, "");
  expect_bitwise_equal(flat, roomy, mc);
}

// The planner counts chunks with PagedState::group_chunks; the store must make exactly those.
TEST_P(PagedStateTest, GroupChunksAreTheChunksTheStoreMakes) {
  for (int64_t vocab : {256, 2000}) {
    model::ModelConfig mc = tiny_config(GetParam().tied);
    mc.vocab_size = vocab;
    const model::ParamLayout layout(mc);
    const uint64_t layer_sized = (tight_chunk_bytes(layout, mc) + kChunkAlignment - 1) / kChunkAlignment * kChunkAlignment;
    for (uint64_t chunk : {PagedState::auto_chunk_bytes(layout, GetParam().precision), layer_sized}) {
      auto device = CpuDevice::create(0, 0);
      PagedStateOptions po;
      po.chunk_bytes = chunk;
      po.device_bytes = 64ull << 20;
      po.host_bytes = 64ull << 20;
      po.optimizer = optimizer_config(kClip);
      po.precision = GetParam().precision;
      auto ps = PagedState::create(**device, nullptr, layout, po);
      ASSERT_TRUE(ps.ok()) << ps.status().to_string();
      // Every kind of the recipe's layout, each packed in its own element size.
      uint64_t planned = 0;
      for (StateKind kind : state_layout().kinds())
        for (uint64_t c : PagedState::group_chunks(layout, chunk, state_layout(), kind)) planned += c;
      EXPECT_EQ((*ps)->store().space().num_chunks(), planned) << "vocab " << vocab << ", chunk " << chunk;
    }
  }
}

// Activation offload (DESIGN §3.3): the layer checkpoints (saved activations) travel through
// kAct chunks in host memory and the model keeps 3 layer checkpoint slots instead of L + 1;
// nothing changes.
model::ModelConfig offload_config(bool tied) {
  model::ModelConfig mc = tiny_config(tied);
  mc.num_hidden_layers = 5;  // layer checkpoints 0..2 travel; 3 and 4 stay resident
  return mc;
}

// act_size: bytes per activation element in the recipe (4 for fp32, 2 for bf16).
void expect_offloaded(const RunResult& flat, const RunResult& paged, const RunResult& resident,
                      const model::ModelConfig& mc, uint64_t act_size) {
  const int offloaded = model::saved_activation_count(mc.num_hidden_layers);
  ASSERT_EQ(offloaded, 3);
  const uint64_t layer_checkpoint_bytes = kB * kT * mc.hidden_size * act_size;
  EXPECT_GE(paged.stats.act_bytes, offloaded * layer_checkpoint_bytes);
  EXPECT_EQ(resident.stats.act_bytes, 0u);
  // Every offload and every fetch acquires host memory.
  const auto host = static_cast<int>(Tier::kHost);
  EXPECT_GE(paged.stats.tiers[host].acquires,
            resident.stats.tiers[host].acquires + uint64_t{2} * offloaded * kSteps * kAccum);
  // L + 1 - 3 = L - 2 layer checkpoint slots fewer.
  EXPECT_EQ(flat.activation_bytes - paged.activation_bytes, static_cast<int64_t>(offloaded * layer_checkpoint_bytes));
  EXPECT_EQ(resident.activation_bytes, flat.activation_bytes);
}

TEST_P(PagedStateTest, OffloadedActivationsRoomyMatchFlatBitwise) {
  const model::ModelConfig mc = offload_config(GetParam().tied);
  const auto batches = make_batches(kSteps * kAccum, kB * kT, 13);
  RunResult flat = run_flat(mc, batches);
  RunResult resident = run_paged(mc, batches, 64ull << 20, 64ull << 20, 0, "");
  RunResult paged = run_paged(mc, batches, 64ull << 20, 64ull << 20, 0, "", /*offload_activations=*/true);
  expect_bitwise_equal(flat, paged, mc);
  expect_offloaded(flat, paged, resident, mc, dtype_size(state_layout().compute_dtype()));
}

TEST_P(PagedStateTest, OffloadedActivationsTightMatchFlatBitwise) {
  const model::ModelConfig mc = offload_config(GetParam().tied);
  const auto batches = make_batches(kSteps * kAccum, kB * kT, 13);
  RunResult flat = run_flat(mc, batches);
  model::ParamLayout layout(mc);
  const uint64_t chunk = tight_chunk_bytes(layout, mc);
  fs::create_directories(dir_ / "nvme");
  const std::string nvme = (dir_ / "nvme").string();
  // The bf16 recipe's AdamW holds a fifth kind of a group (the master) in host memory at once.
  const uint64_t host = (8 + 2 * (state_layout().kinds().size() - 4)) * chunk;
  RunResult resident = run_paged(mc, batches, 6 * chunk, host, 96 * chunk, nvme);
  RunResult paged = run_paged(mc, batches, 6 * chunk, host, 96 * chunk, nvme, /*offload_activations=*/true);
  expect_bitwise_equal(flat, paged, mc);
  expect_offloaded(flat, paged, resident, mc, dtype_size(state_layout().compute_dtype()));
  EXPECT_GT(paged.stats.host_to_nvme_bytes, 0u);
  EXPECT_GT(paged.stats.nvme_to_host_bytes, 0u);
}

// AdamW starting on each group as soon as backward is done with it (on a worker thread, while
// backward continues) gives bitwise the result of updating every group after backward.
TEST_P(PagedStateTest, OptimizerOverlappingBackwardMatchesBitwise) {
  const model::ModelConfig mc = tiny_config(GetParam().tied);
  const auto batches = make_batches(kSteps * kAccum, kB * kT, 11);
  RunResult flat = run_flat(mc, batches, /*grad_clip=*/0.0f);
  RunResult overlapped =
      run_paged(mc, batches, 64ull << 20, 64ull << 20, 0, "", false, /*overlap_optimizer=*/true, /*grad_clip=*/0.0f);
  model::ParamLayout layout(mc);
  const uint64_t chunk = tight_chunk_bytes(layout, mc);
  fs::create_directories(dir_ / "nvme");
  RunResult tight =
      run_paged(mc, batches, 6 * chunk, 8 * chunk, 64 * chunk, (dir_ / "nvme").string(), false, true, 0.0f);
  expect_bitwise_equal(flat, overlapped, mc);
  expect_bitwise_equal(flat, tight, mc);
  // Every group of every step was updated by the worker, queued the moment backward released it.
  EXPECT_EQ(overlapped.overlapped_updates, kSteps * (mc.num_hidden_layers + 2));
  EXPECT_EQ(tight.overlapped_updates, kSteps * (mc.num_hidden_layers + 2));
}

// LoRA (model/lora.h, with dropout): the paged run is the flat reference's bit for bit, roomy,
// through host and nvme, with AdamW overlapping backward, and summing gradients at handover; the
// frozen base never moves.
// The flat run's parameters as a paged run reads them back: a frozen tensor has its compute copy
// alone (bf16 values in the bf16 recipe).
RunResult as_paged_reads(RunResult flat, const model::ModelConfig& mc, Precision precision) {
  if (precision != Precision::kBf16) return flat;
  const model::ParamLayout layout(mc);
  for (const model::TensorSpec& t : layout.tensors()) {
    if (!t.frozen) continue;
    for (int64_t i = 0; i < t.numel; ++i) {
      float& x = flat.params[static_cast<size_t>(t.offset + i)];
      x = kernels::to_f32(kernels::to_bf16(x));
    }
  }
  return flat;
}

TEST_P(PagedStateTest, LoraMatchesFlatBuffersBitwise) {
  model::ModelConfig mc = tiny_config(GetParam().tied);
  mc.lora.rank = 4;
  mc.lora.alpha = 8;
  mc.lora.dropout = 0.1;
  ASSERT_TRUE(mc.validate("test").ok());
  const auto batches = make_batches(kSteps * kAccum, kB * kT, 17);
  const RunResult flat = as_paged_reads(run_flat(mc, batches), mc, GetParam().precision);
  const RunResult roomy = run_paged(mc, batches, 64ull << 20, 64ull << 20, 0, "");
  expect_bitwise_equal(flat, roomy, mc);
  model::ParamLayout layout(mc);
  const uint64_t chunk = tight_chunk_bytes(layout, mc);
  fs::create_directories(dir_ / "nvme");
  const RunResult tight = run_paged(mc, batches, 6 * chunk, 8 * chunk, 64 * chunk, (dir_ / "nvme").string());
  expect_bitwise_equal(flat, tight, mc);
  EXPECT_GT(tight.stats.nvme_to_host_bytes, 0u) << "the nvme tier was never read";
  const RunResult flat_unclipped = as_paged_reads(run_flat(mc, batches, /*grad_clip=*/0.0f), mc, GetParam().precision);
  const RunResult overlapped =
      run_paged(mc, batches, 6 * chunk, 8 * chunk, 64 * chunk, (dir_ / "nvme").string(), false, true, 0.0f);
  expect_bitwise_equal(flat_unclipped, overlapped, mc);
  EXPECT_GT(overlapped.overlapped_updates, 0);
  const RunResult summed =
      run_paged(mc, batches, 6 * chunk, 8 * chunk, 64 * chunk, (dir_ / "nvme").string(), false, false, kClip, true);
  expect_bitwise_equal(flat, summed, mc);
  const RunResult start = as_paged_reads({.params = initial_params(layout, 7)}, mc, GetParam().precision);
  for (const model::TensorSpec& t : layout.tensors()) {
    if (!t.frozen) continue;
    EXPECT_EQ(std::memcmp(start.params.data() + t.offset, tight.params.data() + t.offset, t.numel * sizeof(float)), 0)
        << "the frozen " << t.name << " moved";
  }
}

// A data-parallel rank summing each group's gradients as the last micro-batch's backward hands it
// over (over collectives that move nothing, so the run is one process's): every group of every
// step is summed by the handover thread, once (the tied embedding after its own backward, not
// the head's), acquired beside the schedule's cursor, so after each step the cursor is where
// compute's last acquisition left it; and the bits are the unpaged run's, roomy or paged
// through host and nvme.
TEST_P(PagedStateTest, GradientSumsAtHandoverLeaveTheRunAndTheCursorAlone) {
  const model::ModelConfig mc = tiny_config(GetParam().tied);
  const auto batches = make_batches(kSteps * kAccum, kB * kT, 11);
  RunResult flat = run_flat(mc, batches);
  model::ParamLayout layout(mc);
  const uint64_t chunk = tight_chunk_bytes(layout, mc);
  fs::create_directories(dir_ / "nvme");
  const RunResult roomy = run_paged(mc, batches, 64ull << 20, 64ull << 20, 0, "", false, false, kClip, true);
  const RunResult tight =
      run_paged(mc, batches, 6 * chunk, 16 * chunk, 64 * chunk, (dir_ / "nvme").string(), false, false, kClip, true);
  for (const RunResult* r : {&roomy, &tight}) {
    expect_bitwise_equal(flat, *r, mc);
    EXPECT_EQ(r->handover_sums, kSteps * (mc.num_hidden_layers + 2));
    ASSERT_EQ(r->cursors.size(), static_cast<size_t>(kSteps));
    for (size_t s = 0; s < r->cursors.size(); ++s) EXPECT_EQ(r->cursors[s], r->after_followed) << "after step " << s;
  }
}

// With the Adam moments homed in host memory, AdamW runs there, so the optimizer phase
// prefetches into host memory: no moment chunk ever gets a device slot, even with free device
// slots (which prefetching the phase into the device would fill).
// A NaN gradient (here: every gradient, through a NaN scale; the loss stays finite) is seen in
// the global norm before any group changes: the step leaves parameters, moments and AdamW's
// step count exactly as they were, so [good, NaN, good'] ends bitwise where [good, good'] does.
// With AdamW overlapped with backward that is impossible, and the step is an error instead.
struct SkipRun {
  std::vector<float> params, m, v;
  int64_t step_count = 0;
};

SkipRun run_with_nan_step(bool nan_step, bool overlap, Status* nan_status = nullptr) {
  const model::ModelConfig mc = tiny_config(false);
  const std::vector<Batch> batches = make_batches(4, kB * kT, 5);
  auto device = CpuDevice::create(0, 0).value();
  model::LlamaModel net(mc, model::CpuF32Model(device.get()));
  PagedStateOptions po;
  po.device_bytes = po.host_bytes = 64ull << 20;
  po.optimizer = optimizer_config(overlap ? 0.0f : kClip);
  po.overlap_optimizer = overlap;
  auto ps = PagedState::create(*device, nullptr, net.layout(), po).value();
  EXPECT_TRUE(ps->load_params(initial_params(net.layout(), 7).data()).ok());
  net.set_access(ps.get());
  auto step = [&](const Batch& b, float scale) -> Result<double> {
    EXPECT_TRUE(ps->zero_grads().ok());
    ps->begin_last_micro_batch(1e-2f);
    Result<double> loss = net.compute(b.inputs.data(), b.targets.data(), kB, kT, scale, true);
    EXPECT_TRUE(loss.ok() && std::isfinite(*loss));
    return ps->clip_and_step(1e-2f);
  };
  const float scale = 1.0f / (kB * kT);
  EXPECT_TRUE(step(batches[0], scale).ok());
  SkipRun before;
  const size_t n = static_cast<size_t>(net.layout().total_size());
  before.params.resize(n), before.m.resize(n), before.v.resize(n);
  EXPECT_TRUE(ps->store_params(before.params.data()).ok());
  EXPECT_TRUE(ps->store_moments(before.m.data(), before.v.data()).ok());
  before.step_count = ps->step_count();
  if (nan_step) {
    Result<double> norm = step(batches[1], std::numeric_limits<float>::quiet_NaN());
    if (overlap) {
      EXPECT_FALSE(norm.ok());
      if (nan_status != nullptr) *nan_status = norm.status();
      net.set_access(nullptr);
      return before;
    }
    EXPECT_TRUE(norm.ok() && !std::isfinite(*norm)) << "the norm of NaN gradients";
    SkipRun after;
    after.params.resize(n), after.m.resize(n), after.v.resize(n);
    EXPECT_TRUE(ps->store_params(after.params.data()).ok());
    EXPECT_TRUE(ps->store_moments(after.m.data(), after.v.data()).ok());
    EXPECT_EQ(0, std::memcmp(after.params.data(), before.params.data(), n * 4)) << "a skipped step changed parameters";
    EXPECT_EQ(0, std::memcmp(after.m.data(), before.m.data(), n * 4)) << "a skipped step changed Adam m";
    EXPECT_EQ(0, std::memcmp(after.v.data(), before.v.data(), n * 4)) << "a skipped step changed Adam v";
    EXPECT_EQ(ps->step_count(), before.step_count);
  }
  EXPECT_TRUE(step(batches[2], scale).ok());
  SkipRun out;
  out.params.resize(n), out.m.resize(n), out.v.resize(n);
  EXPECT_TRUE(ps->store_params(out.params.data()).ok());
  EXPECT_TRUE(ps->store_moments(out.m.data(), out.v.data()).ok());
  out.step_count = ps->step_count();
  net.set_access(nullptr);
  return out;
}

TEST(PagedStateSkipTest, NonFiniteGradientsSkipTheStepWithoutChangingAnything) {
  const SkipRun skipped = run_with_nan_step(true, false);
  const SkipRun clean = run_with_nan_step(false, false);
  EXPECT_EQ(skipped.step_count, 2);
  EXPECT_EQ(clean.step_count, 2);
  EXPECT_EQ(0, std::memcmp(skipped.params.data(), clean.params.data(), clean.params.size() * 4));
  EXPECT_EQ(0, std::memcmp(skipped.v.data(), clean.v.data(), clean.v.size() * 4));
}

TEST(PagedStateSkipTest, NonFiniteGradientsWithOverlapStopInsteadOfSkipping) {
  Status st;
  run_with_nan_step(true, true, &st);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("not finite"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("optim.overlap_backward"), std::string::npos) << st.message();
}

TEST(PagedStatePrefetchTest, HostOptimizerPhaseIsNotPrefetchedIntoTheDevice) {
  const model::ModelConfig mc = tiny_config(false);
  const auto batches = make_batches(kSteps * kAccum, kB * kT, 11);
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  model::LlamaModel net(mc, model::CpuF32Model(device->get()));
  // Parameters and gradients on the device; every group's moments in host memory.
  Placement placement(static_cast<int>(mc.num_hidden_layers) + 2);
  for (int g = 0; g < placement.num_groups(); ++g)
    for (StateKind k : {StateKind::kParam, StateKind::kGrad}) placement.row(g, k).home = Tier::kDevice;
  PagedStateOptions po;
  po.device_bytes = 64ull << 20;  // roomy: prefetch could put anything there
  po.host_bytes = 64ull << 20;
  po.lookahead = 8;  // from the gradient norm far into the optimizer phase
  po.grad_accum = kAccum;
  po.optimizer = optimizer_config(kClip);
  po.placement = placement;
  auto paged = PagedState::create(**device, nullptr, net.layout(), po);
  ASSERT_TRUE(paged.ok()) << paged.status().to_string();
  PagedState& ps = **paged;
  ASSERT_TRUE(ps.load_params(initial_params(net.layout(), 7).data()).ok());
  net.set_access(&ps);
  for (int s = 0; s < kSteps; ++s) {
    ASSERT_TRUE(ps.zero_grads().ok());
    for (int m = 0; m < kAccum; ++m) {
      const Batch& b = batches[s * kAccum + m];
      ASSERT_TRUE(net.compute(b.inputs.data(), b.targets.data(), kB, kT, 1.0f / (kAccum * kB * kT), true).ok());
    }
    ASSERT_TRUE(ps.clip_and_step(1e-2f).ok());
    // The device holds the parameter and gradient chunks, and nothing else (a moment chunk
    // copied there would keep its slot, even once its copy went stale).
    uint64_t chunks = 0;
    for (int g = 0; g < ps.store().num_groups(); ++g)
      for (StateKind k : {StateKind::kParam, StateKind::kGrad}) chunks += ps.store().part_chunk_count(g, kDensePart, k);
    EXPECT_EQ(ps.stats().tiers[0].in_use_bytes, chunks * ps.store().chunk_bytes()) << "after step " << s;
  }
  net.set_access(nullptr);
  // The parameters still went up to the device for compute.
  EXPECT_GT(ps.stats().host_to_device_bytes, 0u);
}

// Loading, restoring and reading state homed on the device goes through host memory a slice at
// a time: each slice's chunks go home after it, so the host tier reuses a few slots and holds
// no copy afterwards, however large the state, and the values read back are the values loaded.
TEST(PagedStateLoadTest, PassesOverStateHomedOnTheDeviceLeaveNoCopyInHostMemory) {
  model::ModelConfig mc = tiny_config(false);
  mc.num_hidden_layers = 6;
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  model::LlamaModel net(mc, model::CpuF32Model(device->get()));
  const model::ParamLayout& layout = net.layout();
  Placement placement(static_cast<int>(mc.num_hidden_layers) + 2);
  for (int g = 0; g < placement.num_groups(); ++g)
    for (StateKind k : StateLayout::of(Precision::kFp32).kinds()) placement.row(g, k).home = Tier::kDevice;
  PagedStateOptions po;
  po.device_bytes = 64ull << 20;
  po.host_bytes = 64ull << 20;  // room for a copy of everything, were it kept
  po.chunk_bytes = (tight_chunk_bytes(layout, mc) + 4095) / 4096 * 4096;
  po.grad_accum = kAccum;
  po.optimizer = optimizer_config(kClip);
  po.placement = placement;
  auto paged = PagedState::create(**device, nullptr, layout, po);
  ASSERT_TRUE(paged.ok()) << paged.status().to_string();
  PagedState& ps = **paged;
  const std::vector<float> values = initial_params(layout, 7);
  ASSERT_TRUE(ps.load_params(values.data()).ok());
  std::vector<float> m(values.size()), v(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    m[i] = 0.5f * values[i];
    v[i] = values[i] * values[i];
  }
  ASSERT_TRUE(ps.load_moments(m.data(), v.data()).ok());
  std::vector<float> params(values.size()), m_back(values.size()), v_back(values.size());
  ASSERT_TRUE(ps.store_params(params.data()).ok());
  ASSERT_TRUE(ps.store_moments(m_back.data(), v_back.data()).ok());
  EXPECT_EQ(std::memcmp(params.data(), values.data(), values.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(m_back.data(), m.data(), m.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(v_back.data(), v.data(), v.size() * sizeof(float)), 0);
  const ChunkSpaceStats stats = ps.stats();
  const uint64_t chunk = ps.store().chunk_bytes();
  const TierUsage& host = stats.tiers[static_cast<int>(Tier::kHost)];
  EXPECT_EQ(host.in_use_bytes, 0u) << "a copy stayed in host memory";
  // Two consecutive slices of two kinds at most (host_ram.cpp's kPassSlots), of a state of many
  // more chunks.
  EXPECT_LE(host.peak_bytes, 4 * chunk);
  EXPECT_GT(stats.tiers[static_cast<int>(Tier::kDevice)].in_use_bytes, 12 * chunk);
}

// The chaos suite can fail: with the compute stream's wait for each chunk's move deleted (the
// planted bug), the tight run that is bitwise the flat one above goes wrong under chaos, reading
// slots whose copy has not landed or that were poisoned when their chunk left. The same run with
// the wait in place stays bitwise (the control), so it is the missing wait that is caught.
TEST(PagedStateChaosTest, AMissingWaitForAMoveBreaksTheTightRunUnderChaos) {
  const model::ModelConfig mc = tiny_config(false);
  const auto batches = make_batches(kSteps * kAccum, kB * kT, 11);
  const RunResult flat = run_flat(Precision::kFp32, mc, batches);
  model::ParamLayout layout(mc);
  const uint64_t chunk = tight_chunk_bytes(layout, mc);
  const auto same = [&](const RunResult& r) {
    if (r.losses.size() != flat.losses.size() || r.params.size() != flat.params.size()) return false;
    return std::memcmp(r.losses.data(), flat.losses.data(), flat.losses.size() * sizeof(double)) == 0 &&
           std::memcmp(r.params.data(), flat.params.data(), flat.params.size() * sizeof(float)) == 0;
  };
  g_planted = {.chaos_seed = 7, .skip_acquire_wait = false};
  const RunResult control = run_paged(Precision::kFp32, mc, batches, 6 * chunk, 64 * chunk, 0, "");
  g_planted = {.chaos_seed = 7, .skip_acquire_wait = true};
  const RunResult planted = run_paged(Precision::kFp32, mc, batches, 6 * chunk, 64 * chunk, 0, "");
  g_planted = {};
  EXPECT_GT(control.stats.host_to_device_bytes, 0u) << "the budget does not force paging";
  EXPECT_TRUE(same(control)) << "the run with every wait in place is not bitwise the flat one";
  EXPECT_FALSE(same(planted)) << "a run missing the compute stream's wait for its chunks passed the chaos check";
}

INSTANTIATE_TEST_SUITE_P(TiedAndRecipe, PagedStateTest,
                         ::testing::Values(Variant{false, Precision::kFp32}, Variant{true, Precision::kFp32},
                                           Variant{false, Precision::kBf16}, Variant{true, Precision::kBf16}),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return std::string(info.param.tied ? "Tied" : "Untied") + precision_name(info.param.precision);
                         });

}  // namespace
}  // namespace strata
