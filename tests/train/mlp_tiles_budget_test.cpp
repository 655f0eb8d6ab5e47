// The dense MLP over token tiles (memory.mlp_tile_tokens) in the engine `strata train` builds:
// the planner counts a tile's MLP buffers, so a sequence whose untiled activations do not fit
// the device trains there, its state and layer checkpoints paged through host memory and nvme,
// bit for bit as the same tiled run with room for everything.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "train/paged_engine.h"
#include "train/planning.h"
#include "train/train_test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

// A wide MLP (16 times the hidden size), so that its intermediates dominate the activations.
model::ModelConfig wide_mlp_config() {
  model::ModelConfig mc = tiny_config(false);
  mc.intermediate_size = 512;
  mc.max_position_embeddings = 2048;
  return mc;
}

constexpr int64_t kSeqLen = 1024;
constexpr int kSteps = 2;
constexpr int64_t kLayerCheckpoints = 3;  // tiny_config's layers: at most this many offloaded

struct TiledRun {
  std::vector<double> losses;
  std::vector<float> params;
  ChunkSpaceStats stats;
};

Result<TiledRun> train(const model::ModelConfig& mc, const TrainConfig& t) {
  ASSIGN_OR_RETURN(std::unique_ptr<PagedEngine> engine, PagedEngine::create(mc, t, optimizer_config(1.0f)));
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  RETURN_IF_ERROR(engine->state().fill_kind(StateKind::kParam, [&](const model::TensorSpec& spec, float* dst) {
    for (int64_t i = 0; i < spec.numel; ++i) dst[i] = spec.name.find("norm") != std::string::npos ? 1.0f : normal(rng);
    return Status::OK();
  }));
  const std::vector<Batch> batches = make_batches(kSteps, kSeqLen, 9);
  TiledRun run;
  for (int s = 0; s < kSteps; ++s) {
    RETURN_IF_ERROR(engine->zero_grads());
    const Batch& b = batches[static_cast<size_t>(s)];
    ASSIGN_OR_RETURN(double loss, engine->micro_batch(b.inputs.data(), b.targets.data(), 1, kSeqLen,
                                                      1.0f / static_cast<float>(kSeqLen), true, 1e-3f));
    RETURN_IF_ERROR(engine->step(1e-3f).status());
    run.losses.push_back(loss);
  }
  run.stats = engine->chunk_stats();
  run.params.resize(static_cast<size_t>(engine->layout().total_size()));
  RETURN_IF_ERROR(
      engine->state().read_flat(StateKind::kParam, 0, run.params.size() * sizeof(float), run.params.data()));
  return run;
}

TEST(MlpTilesBudget, ASequenceWhoseUntiledActivationsDoNotFitTrainsTiledThroughHostAndNvmeBitwise) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("mlp_tiles_budget_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const model::ModelConfig mc = wide_mlp_config();
  TrainConfig roomy;
  roomy.micro_batch = 1;
  roomy.seq_len = kSeqLen;
  roomy.grad_accum = 1;
  roomy.keep_activations = "false";
  roomy.offload_activations = "true";
  roomy.memory_device = 1ull << 30;
  roomy.memory_host = 1ull << 30;
  roomy.mlp_tile_tokens = 128;
  roomy.chunk_size = PagedState::auto_chunk_bytes(model::ParamLayout(mc), roomy.precision);

  // The device: what the tiled plan needs at least, and a few chunks; the untiled needs more.
  TrainConfig untiled = roomy;
  untiled.mlp_tile_tokens = 0;
  const Plan tiled_plan = make_plan(make_plan_input(mc, roomy, DeviceKind::kCpu));
  const Plan untiled_plan = make_plan(make_plan_input(mc, untiled, DeviceKind::kCpu));
  TrainConfig tight = roomy;
  tight.memory_device = tiled_plan.min_device_budget + 2 * roomy.chunk_size;
  ASSERT_LT(tight.memory_device, untiled_plan.min_device_budget)
      << "the tiled MLP should let a smaller device hold the step";
  const model::ParamLayout layout(mc);
  const StateLayout state = StateLayout::of(tight.precision);
  // The host: a third of the state (whose four kinds are each a compute copy's size) beside the
  // offloaded layer checkpoints; the rest goes to nvme.
  tight.memory_host = 2 * kLayerCheckpoints * kSeqLen * mc.hidden_size * sizeof(float) +
                      4 * PagedState::state_bytes(layout, state, StateKind::kParam) / 3;
  tight.nvme_path = dir.string();
  tight.nvme_size = 1ull << 30;

  untiled.memory_device = tight.memory_device;
  untiled.memory_host = tight.memory_host;
  untiled.nvme_path = tight.nvme_path;
  untiled.nvme_size = tight.nvme_size;
  Result<TiledRun> refused = train(mc, untiled);
  ASSERT_FALSE(refused.ok()) << "the untiled MLP trained in a device its plan says is too small";
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfMemory) << refused.status().to_string();

  Result<TiledRun> reference = train(mc, roomy);
  ASSERT_TRUE(reference.ok()) << reference.status().to_string();
  Result<TiledRun> paged = train(mc, tight);
  ASSERT_TRUE(paged.ok()) << paged.status().to_string();
  EXPECT_GT(paged->stats.nvme_to_host_bytes, 0u);
  ASSERT_EQ(paged->losses, reference->losses);
  ASSERT_EQ(paged->params.size(), reference->params.size());
  EXPECT_EQ(std::memcmp(paged->params.data(), reference->params.data(), paged->params.size() * sizeof(float)), 0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
