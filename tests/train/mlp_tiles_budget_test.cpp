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
#include "train/train_config.h"
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

struct TiledRun {
  std::vector<double> losses;
  std::vector<float> params;
  ChunkSpaceStats stats;
  int64_t nvme_activation_chunks = 0;  // the plan's layer checkpoints homed on nvme
};

Result<TiledRun> train(const model::ModelConfig& mc, const TrainConfig& t, int steps) {
  const int64_t T = t.seq_len;
  ASSIGN_OR_RETURN(std::unique_ptr<PagedEngine> engine, PagedEngine::create(mc, t, optimizer_config(1.0f)));
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  RETURN_IF_ERROR(engine->state().fill_kind(StateKind::kParam, [&](const model::TensorSpec& spec, float* dst) {
    for (int64_t i = 0; i < spec.numel; ++i) dst[i] = spec.name.find("norm") != std::string::npos ? 1.0f : normal(rng);
    return Status::OK();
  }));
  const std::vector<Batch> batches = make_batches(steps, T, 9);
  TiledRun run;
  for (int s = 0; s < steps; ++s) {
    RETURN_IF_ERROR(engine->zero_grads());
    const Batch& b = batches[static_cast<size_t>(s)];
    ASSIGN_OR_RETURN(double loss, engine->micro_batch(b.inputs.data(), b.targets.data(), 1, T,
                                                      1.0f / static_cast<float>(T), true, 1e-3f));
    RETURN_IF_ERROR(engine->step(1e-3f).status());
    run.losses.push_back(loss);
  }
  run.stats = engine->chunk_stats();
  run.nvme_activation_chunks = engine->plan().nvme_activation_chunks;
  run.params.resize(static_cast<size_t>(engine->layout().total_size()));
  RETURN_IF_ERROR(
      engine->state().read_flat(StateKind::kParam, 0, run.params.size() * sizeof(float), run.params.data()));
  return run;
}

// With `smallest_host`, the host budget is the smallest the planner finds, which homes some of the
// layer checkpoints on nvme too.
void expect_tiled_run_fits_where_untiled_does_not(const model::ModelConfig& mc, int64_t seq_len = kSeqLen,
                                                  int steps = kSteps, bool smallest_host = false) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("mlp_tiles_budget_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  TrainConfig roomy;
  roomy.micro_batch = 1;
  roomy.seq_len = seq_len;
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
  // The planner's minimum counts two of the offloading table's three layer-checkpoint slots (the
  // engine plans again with its exact table): one more checkpoint's bytes, and a few chunks.
  const uint64_t checkpoint = static_cast<uint64_t>(seq_len * mc.hidden_size) * sizeof(float);
  tight.memory_device = tiled_plan.min_device_budget + checkpoint + 2 * roomy.chunk_size;
  ASSERT_LT(tight.memory_device, untiled_plan.min_device_budget)
      << "the tiled MLP should let a smaller device hold the step";
  const model::ParamLayout layout(mc);
  const StateLayout state = StateLayout::of(tight.precision);
  // The host: a third of the state (whose four kinds are each a compute copy's size) beside the
  // offloaded layer checkpoints; the rest goes to nvme.
  // At most one checkpoint per layer is offloaded.
  tight.memory_host = 2 * mc.num_hidden_layers * seq_len * mc.hidden_size * sizeof(float) +
                      4 * PagedState::state_bytes(layout, state, StateKind::kParam) / 3;
  tight.nvme_path = dir.string();
  tight.nvme_size = 1ull << 30;
  if (smallest_host) {
    // Searched on the device the engine plans its state in: the budget less the checkpoint the
    // planner does not count.
    TrainConfig effective = tight;
    effective.memory_device -= checkpoint;
    tight.memory_host = smallest_host_budget(mc, effective, DeviceKind::kCpu);
    ASSERT_GT(tight.memory_host, 0u);
  }

  untiled.memory_device = tight.memory_device;
  untiled.memory_host = tight.memory_host;
  untiled.nvme_path = tight.nvme_path;
  untiled.nvme_size = tight.nvme_size;
  Result<TiledRun> refused = train(mc, untiled, steps);
  ASSERT_FALSE(refused.ok()) << "the untiled MLP trained in a device its plan says is too small";
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfMemory) << refused.status().to_string();

  Result<TiledRun> reference = train(mc, roomy, steps);
  ASSERT_TRUE(reference.ok()) << reference.status().to_string();
  Result<TiledRun> paged = train(mc, tight, steps);
  ASSERT_TRUE(paged.ok()) << paged.status().to_string();
  EXPECT_GT(paged->stats.nvme_to_host_bytes, 0u);
  if (smallest_host) EXPECT_GT(paged->nvme_activation_chunks, 0) << "no layer checkpoint was homed on nvme";
  ASSERT_EQ(paged->losses, reference->losses);
  ASSERT_EQ(paged->params.size(), reference->params.size());
  EXPECT_EQ(std::memcmp(paged->params.data(), reference->params.data(), paged->params.size() * sizeof(float)), 0);
  fs::remove_all(dir);
}

TEST(MlpTilesBudget, ASequenceWhoseUntiledActivationsDoNotFitTrainsTiledThroughHostAndNvmeBitwise) {
  expect_tiled_run_fits_where_untiled_does_not(wide_mlp_config());
}

// A long sequence on a small budget: 32K tokens through a small model (one narrow attention head,
// so that T^2 attention stays a few seconds on the CPU) whose untiled activations do not fit the
// device. Attention runs in key tiles, the MLP and LM head in token tiles, and the layer
// checkpoints page through the host and nvme with the state; one step matches the roomy run.
TEST(MlpTilesBudget, A32KTokenSequenceTrainsTiledThroughHostAndNvmeAsWithRoom) {
  model::ModelConfig mc = wide_mlp_config();
  mc.num_hidden_layers = 3;  // the first layer's checkpoint leaves the device (saved_activation_count)
  mc.num_attention_heads = 1;
  mc.num_key_value_heads = 1;
  mc.head_dim = 8;
  mc.max_position_embeddings = 32768;
  ASSERT_TRUE(mc.validate("long").ok());
  expect_tiled_run_fits_where_untiled_does_not(mc, 32768, 1, /*smallest_host=*/true);
}

// The same with MoE layers whose experts are wide (4 experts, 2 per token, a shared expert): the
// routed experts run over tiles of the expert order's rows, the shared expert over token tiles.
TEST(MlpTilesBudget, AnMoeSequenceWhoseUntiledExpertsDoNotFitTrainsTiledThroughHostAndNvmeBitwise) {
  model::ModelConfig mc = wide_mlp_config();
  mc.num_experts = 4;
  mc.num_experts_per_tok = 2;
  mc.moe_intermediate_size = 256;
  mc.shared_expert_intermediate_size = 128;
  mc.intermediate_size = 128;
  ASSERT_TRUE(mc.is_moe());
  expect_tiled_run_fits_where_untiled_does_not(mc);
}

// memory.mlp_tile_tokens=auto: untiled where that fits; else the largest candidate tile (halving
// from half the tokens) with which the plan fits.
TEST(MlpTilesBudget, AutoTilesOnlyWhereTheUntiledPlanDoesNotFit) {
  const model::ModelConfig mc = wide_mlp_config();
  TrainConfig t;
  t.micro_batch = 1;
  t.seq_len = kSeqLen;
  t.keep_activations = "false";
  t.memory_device = 1ull << 30;
  t.memory_host = 1ull << 30;
  ASSERT_EQ(t.mlp_tile_tokens, TrainConfig::kMlpTileAuto);
  EXPECT_EQ(planned_mlp_tile(mc, t, DeviceKind::kCpu), 0);

  auto fits = [&](int64_t tile) {
    TrainConfig c = t;
    c.mlp_tile_tokens = tile;
    return make_plan(make_plan_input(mc, c, DeviceKind::kCpu)).fits;
  };
  t.mlp_tile_tokens = 128;
  t.memory_device = make_plan(make_plan_input(mc, t, DeviceKind::kCpu)).min_device_budget;
  t.mlp_tile_tokens = TrainConfig::kMlpTileAuto;
  ASSERT_FALSE(fits(0));
  const int64_t tile = planned_mlp_tile(mc, t, DeviceKind::kCpu);
  EXPECT_GT(tile, 0);
  EXPECT_EQ(tile % 128, 0);
  EXPECT_TRUE(fits(tile));
  // The candidates (512, 256, 128 for 1024 tokens) above it do not fit.
  EXPECT_EQ(mlp_tile_candidates(kSeqLen), (std::vector<int64_t>{512, 256, 128}));
  for (int64_t larger : mlp_tile_candidates(kSeqLen)) {
    if (larger > tile) {
      EXPECT_FALSE(fits(larger)) << larger;
    }
  }
  // A number given is kept, fitting or not.
  t.mlp_tile_tokens = 0;
  EXPECT_EQ(planned_mlp_tile(mc, t, DeviceKind::kCpu), 0);
  t.mlp_tile_tokens = 256;
  EXPECT_EQ(planned_mlp_tile(mc, t, DeviceKind::kCpu), 256);
}

// The device's transient buffers are O(tile), not O(T): with the MLP in tiles, doubling the
// sequence grows the activation table an engine reserves by the same bytes whatever the MLP's
// width and the vocabulary (the LM head runs over token chunks), so only the per-token buffers of
// the hidden and attention widths (layer inputs, q, k, v, the residual's gradients) grow with T.
// Untiled, the growth includes the MLP's intermediates.
TEST(MlpTilesBudget, DoublingTheSequenceGrowsOnlyThePerTokenBuffersNotTheTiles) {
  auto table_bytes = [](int64_t F, int64_t V, int64_t T, int64_t tile) -> int64_t {
    model::ModelConfig mc = wide_mlp_config();
    mc.intermediate_size = F;
    mc.vocab_size = V;
    mc.max_position_embeddings = 4096;
    TrainConfig t;
    t.micro_batch = 1;
    t.seq_len = T;
    t.keep_activations = "false";
    t.offload_activations = "true";
    t.memory_device = 1ull << 30;
    t.memory_host = 1ull << 30;
    t.mlp_tile_tokens = tile;
    Result<std::unique_ptr<PagedEngine>> engine = PagedEngine::create(mc, t, optimizer_config(1.0f));
    EXPECT_TRUE(engine.ok()) << engine.status().to_string();
    return engine.ok() ? static_cast<int64_t>((*engine)->activation_bytes()) : -1;
  };
  const int64_t T = 1024, V = wide_mlp_config().vocab_size;
  const int64_t growth = table_bytes(512, V, 2 * T, 128) - table_bytes(512, V, T, 128);
  EXPECT_GT(growth, 0);
  for (int64_t F : {512, 1024}) {
    for (int64_t vocab : {V, 4 * V}) {
      const int64_t tiled = table_bytes(F, vocab, 2 * T, 128) - table_bytes(F, vocab, T, 128);
      EXPECT_EQ(tiled, growth) << "F " << F << ", vocabulary " << vocab;
    }
    // Untiled: six (T, F) buffers more (gate, up, act and their gradients), of fp32.
    const int64_t untiled = table_bytes(F, V, 2 * T, 0) - table_bytes(F, V, T, 0);
    EXPECT_EQ(untiled - growth, 6 * T * F * static_cast<int64_t>(sizeof(float))) << "F " << F;
  }
}

TEST(MlpTilesBudget, TheKeyTakesAutoZeroOrMultiplesOf128) {
  const std::pair<const char*, int64_t> good[] = {{"auto", TrainConfig::kMlpTileAuto}, {"0", 0}, {"128", 128},
                                                   {"4096", 4096}};
  for (const auto& [text, value] : good) {
    Result<Config> c = load_train_config("", {std::string("memory.mlp_tile_tokens=") + text});
    ASSERT_TRUE(c.ok()) << c.status().message();
    Result<TrainConfig> t = make_train_config(*c);
    ASSERT_TRUE(t.ok()) << text << ": " << t.status().message();
    EXPECT_EQ(t->mlp_tile_tokens, value) << text;
  }
  for (const char* bad : {"100", "-128", "x", "128x", "", "33554432"}) {
    Result<Config> c = load_train_config("", {std::string("memory.mlp_tile_tokens=") + bad});
    if (!c.ok()) continue;  // refused already as a value
    Result<TrainConfig> refused = make_train_config(*c);
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.status().message().find("memory.mlp_tile_tokens"), std::string::npos)
        << refused.status().message();
  }
}

}  // namespace
}  // namespace strata
