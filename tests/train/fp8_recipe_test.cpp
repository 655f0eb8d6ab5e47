// The fp8 recipe and compact Adam moments in the paged state: the compute copies of linear
// weights are E4M3 blocks of the master, paging never changes the result (bitwise, for every
// recipe and moment format), compact moments read back as their decoded values, and fp8 copies
// halve the parameter bytes that move.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/cpu_device.h"
#include "core/io_engine.h"
#include "kernels/fp8.h"
#include "kernels/moments.h"
#include "kernels/nf4.h"
#include "kernels/bf16.h"
#include "model/param_access.h"
#include "model/decoder.h"
#include "train/paged_state.h"
#include "train_test_util.h"
#include "../fp8_checkpoint.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using kernels::MomentFormat;

constexpr int64_t kRecipeB = 2, kRecipeT = 16, kRecipeSteps = 4, kRecipeAccum = 2;

struct Recipe {
  Precision precision;
  MomentFormat moments;
};

void PrintTo(const Recipe& r, std::ostream* os) {
  *os << precision_name(r.precision) << " with " << kernels::moment_format_name(r.moments) << " moments";
}

struct TrainResult {
  std::vector<double> losses;
  std::vector<float> params, m, v;
  ChunkSpaceStats stats;
};

class Fp8RecipeTest : public ::testing::TestWithParam<Recipe> {
 protected:
  void SetUp() override {
    dir_ = testing::fresh_test_dir("strata_fp8");
    fs::create_directories(dir_ / "nvme");
  }
  void TearDown() override { fs::remove_all(dir_); }

  // kRecipeSteps steps of kRecipeAccum micro-batches through a PagedState with these budgets (0 device: roomy).
  TrainResult train(const model::ModelConfig& mc, const std::vector<Batch>& batches, uint64_t device, uint64_t host,
            uint64_t nvme, uint64_t chunk = 0, PagedState** keep = nullptr, int steps = kRecipeSteps) {
    Recipe r = GetParam();
    if (precision_) r.precision = *precision_;
    // The fp32 weights every run starts from.
    const std::vector<float> init = initial_params(model::ParamLayout(mc), 7);
    auto dev = CpuDevice::create(0, 0);
    CHECK(dev.ok());
    auto io = make_io_engine({.kind = "threads"});
    CHECK(io.ok());
    std::unique_ptr<model::Model> net =
        model::make_cpu_decoder(StateLayout::of(r.precision).compute_dtype(), mc, dev->get());
    PagedStateOptions po;
    po.precision = r.precision;
    po.moments = r.moments;
    po.device_bytes = device ? device : 1ull << 30;
    po.host_bytes = host ? host : 1ull << 30;
    po.nvme_bytes = nvme;
    po.nvme_dir = (dir_ / "nvme").string();
    po.chunk_bytes = chunk;
    po.grad_accum = kRecipeAccum;
    po.optimizer = optimizer_config(0.5f);
    auto paged = PagedState::create(**dev, io->get(), net->layout(), po);
    EXPECT_TRUE(paged.ok()) << paged.status().to_string();
    TrainResult out;
    if (!paged.ok()) return out;
    PagedState& ps = **paged;
    EXPECT_TRUE(ps.load_params(init.data()).ok());
    net->set_access(&ps);
    for (int s = 0; s < steps; ++s) {
      EXPECT_TRUE(ps.zero_grads().ok());
      double loss = 0;
      for (int m = 0; m < kRecipeAccum; ++m) {
        const Batch& b = batches[static_cast<size_t>(s * kRecipeAccum + m)];
        Result<double> l = net->compute(b.inputs.data(), b.targets.data(), kRecipeB, kRecipeT, 1.0f / (kRecipeAccum * kRecipeB * kRecipeT), true);
        EXPECT_TRUE(l.ok()) << l.status().to_string();
        if (l.ok()) loss += *l;
      }
      Result<double> norm = ps.clip_and_step(1e-2f);
      EXPECT_TRUE(norm.ok()) << norm.status().to_string();
      out.losses.push_back(loss);
    }
    net->set_access(nullptr);
    const size_t n = static_cast<size_t>(net->layout().total_size());
    out.params.assign(n, 0.0f);
    out.m.assign(n, 0.0f);
    out.v.assign(n, 0.0f);
    EXPECT_TRUE(ps.store_params(out.params.data()).ok());
    EXPECT_TRUE(ps.store_moments(out.m.data(), out.v.data()).ok());
    out.stats = ps.stats();
    if (keep != nullptr) {
      // Hand the state over (the caller inspects it); the device and engine stay alive with it.
      devices_.push_back(std::move(*dev));
      ios_.push_back(std::move(*io));
      states_.push_back(std::move(*paged));
      *keep = states_.back().get();
    }
    return out;
  }

  fs::path dir_;
  std::optional<Precision> precision_;  // the recipe train() runs, when not the parameter's
  std::vector<std::unique_ptr<Device>> devices_;
  std::vector<std::unique_ptr<IoEngine>> ios_;
  std::vector<std::unique_ptr<PagedState>> states_;
};

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

TEST_P(Fp8RecipeTest, TightBudgetsThroughHostAndNvmeMatchRoomyBitwise) {
  const model::ModelConfig mc = fp8_config();
  const auto batches = make_batches(kRecipeSteps * kRecipeAccum, kRecipeB * kRecipeT, 5);
  const TrainResult roomy = train(mc, batches, 0, 0, 0);
  ASSERT_EQ(roomy.losses.size(), static_cast<size_t>(kRecipeSteps));
  for (double l : roomy.losses) ASSERT_TRUE(std::isfinite(l));
  model::ParamLayout layout(mc);
  const uint64_t chunk = PagedState::auto_chunk_bytes(layout, StateLayout::of(GetParam().precision, GetParam().moments));
  const uint64_t group = static_cast<uint64_t>(layout.total_size()) * 4 / (mc.num_hidden_layers + 1);
  const uint64_t c = std::max(chunk, (group + 4095) / 4096 * 4096);
  const TrainResult tight = train(mc, batches, 8 * c, 10 * c, 64 * c, c);
  EXPECT_EQ(roomy.losses, tight.losses);
  EXPECT_TRUE(bitwise_equal(roomy.params, tight.params)) << "paging changed the parameters";
  EXPECT_TRUE(bitwise_equal(roomy.m, tight.m)) << "paging changed the first moments";
  EXPECT_TRUE(bitwise_equal(roomy.v, tight.v)) << "paging changed the second moments";
  EXPECT_GT(tight.stats.host_to_device_bytes, 0u) << "nothing streamed to the device";
  EXPECT_GT(tight.stats.nvme_to_host_bytes, 0u) << "the nvme tier was never read";
}

TEST_P(Fp8RecipeTest, MixtureOfExpertsPagesBitwiseToo) {
  const model::ModelConfig mc = fp8_moe_config();
  const auto batches = make_batches(kRecipeSteps * kRecipeAccum, kRecipeB * kRecipeT, 12);
  const TrainResult roomy = train(mc, batches, 0, 0, 0);
  for (double l : roomy.losses) ASSERT_TRUE(std::isfinite(l));
  model::ParamLayout layout(mc);
  // The chunk of the recipe with fp32 moments, so that every moment format gets the same budgets.
  const uint64_t c = PagedState::auto_chunk_bytes(layout, StateLayout::of(GetParam().precision));
  const TrainResult tight = train(mc, batches, 24 * c, 1024 * c, 0, c);  // the experts stream to the device
  EXPECT_EQ(roomy.losses, tight.losses);
  EXPECT_TRUE(bitwise_equal(roomy.params, tight.params)) << "paging changed the parameters";
  EXPECT_TRUE(bitwise_equal(roomy.m, tight.m) && bitwise_equal(roomy.v, tight.v)) << "paging changed the moments";
  EXPECT_GT(tight.stats.host_to_device_bytes, 0u) << "nothing streamed to the device";
}

// DeepSeek's latent attention and routing (model/mla_layer.h) under the same tight budgets.
TEST_P(Fp8RecipeTest, LatentAttentionPagesBitwiseToo) {
  const model::ModelConfig mc = deepseek_config();
  ASSERT_TRUE(mc.is_mla());
  const auto batches = make_batches(kRecipeSteps * kRecipeAccum, kRecipeB * kRecipeT, 14);
  const TrainResult roomy = train(mc, batches, 0, 0, 0);
  for (double l : roomy.losses) ASSERT_TRUE(std::isfinite(l));
  model::ParamLayout layout(mc);
  const uint64_t c = PagedState::auto_chunk_bytes(layout, StateLayout::of(GetParam().precision));
  const TrainResult tight = train(mc, batches, 24 * c, 48 * c, 1024 * c, c);
  EXPECT_EQ(roomy.losses, tight.losses);
  EXPECT_TRUE(bitwise_equal(roomy.params, tight.params)) << "paging changed the parameters";
  EXPECT_TRUE(bitwise_equal(roomy.m, tight.m) && bitwise_equal(roomy.v, tight.v)) << "paging changed the moments";
  EXPECT_GT(tight.stats.host_to_device_bytes, 0u) << "nothing streamed to the device";
  EXPECT_GT(tight.stats.nvme_to_host_bytes, 0u) << "the nvme tier was never read";
}

// DeepSeek-V3's multi-token prediction modules (MoE blocks after the layers, sharing the
// embedding and LM head, model/decoder_impl.h), two of them, trained under the same tight
// budgets: their groups page like layers', and the head's and the embedding's are acquired again
// for each.
TEST_P(Fp8RecipeTest, MultiTokenPredictionPagesBitwiseToo) {
  model::ModelConfig mc = deepseek_config();
  mc.num_nextn_predict_layers = 2;  // the second module reads the first's output
  mc.mtp_loss_weight = 0.3;
  ASSERT_TRUE(mc.validate("test").ok());
  ASSERT_TRUE(mc.trains_mtp() && mc.is_moe_layer(mc.num_hidden_layers));
  const auto batches = make_batches(kRecipeSteps * kRecipeAccum, kRecipeB * kRecipeT, 15);
  const TrainResult roomy = train(mc, batches, 0, 0, 0);
  for (double l : roomy.losses) ASSERT_TRUE(std::isfinite(l));
  model::ParamLayout layout(mc);
  const uint64_t c = PagedState::auto_chunk_bytes(layout, StateLayout::of(GetParam().precision));
  // The module's phase holds its block, the head and its experts at once: a few chunks more
  // than the layers need.
  const TrainResult tight = train(mc, batches, 32 * c, 48 * c, 1024 * c, c);
  EXPECT_EQ(roomy.losses, tight.losses);
  EXPECT_TRUE(bitwise_equal(roomy.params, tight.params)) << "paging changed the parameters";
  EXPECT_TRUE(bitwise_equal(roomy.m, tight.m) && bitwise_equal(roomy.v, tight.v)) << "paging changed the moments";
  EXPECT_GT(tight.stats.host_to_device_bytes, 0u) << "nothing streamed to the device";
  EXPECT_GT(tight.stats.nvme_to_host_bytes, 0u) << "the nvme tier was never read";
  // The module trained: every tensor of it moved from where it started.
  const std::vector<float> init = initial_params(layout, 7);
  for (const model::TensorSpec& t : layout.tensors()) {
    if (!mc.is_mtp_block(model::param_group_of(layout, t) - 1) || t.name.ends_with("e_score_correction_bias"))
      continue;
    if (t.name.find(".experts.") != std::string::npos) continue;  // an expert may get no token
    EXPECT_NE(std::memcmp(init.data() + t.offset, roomy.params.data() + t.offset, t.numel * sizeof(float)), 0)
        << t.name << " did not train";
  }
}

// train.mtp_weight=0: the module is neither computed nor updated (its tensors are frozen), and
// the rest trains as the model without it would (the same losses: the module adds nothing).
TEST_P(Fp8RecipeTest, AnUntrainedMtpModuleStaysAsLoaded) {
  model::ModelConfig mc = deepseek_config();
  const auto batches = make_batches(kRecipeSteps * kRecipeAccum, kRecipeB * kRecipeT, 15);
  const TrainResult without = train(mc, batches, 0, 0, 0);
  mc.num_nextn_predict_layers = 1;
  mc.mtp_loss_weight = 0;
  ASSERT_TRUE(mc.validate("test").ok());
  model::ParamLayout layout(mc);
  const uint64_t c = PagedState::auto_chunk_bytes(layout, StateLayout::of(GetParam().precision));
  const TrainResult kept = train(mc, batches, 32 * c, 48 * c, 1024 * c, c);
  EXPECT_EQ(without.losses, kept.losses);
  // A frozen tensor holds its compute copy alone: it reads back as loaded into that copy.
  const TrainResult loaded = train(mc, batches, 0, 0, 0, 0, nullptr, /*steps=*/0);
  int frozen = 0;
  for (const model::TensorSpec& t : layout.tensors()) {
    if (!t.frozen) continue;
    ++frozen;
    EXPECT_EQ(std::memcmp(loaded.params.data() + t.offset, kept.params.data() + t.offset, t.numel * sizeof(float)), 0)
        << t.name << " changed";
    for (int64_t i = 0; i < t.numel; ++i) {
      if (kept.m[static_cast<size_t>(t.offset + i)] != 0.0f || kept.v[static_cast<size_t>(t.offset + i)] != 0.0f) {
        ADD_FAILURE() << t.name << " has moments";
        break;
      }
    }
  }
  EXPECT_GT(frozen, 10);
}

// An FP8 checkpoint (DeepSeek-V3's format: E4M3 weights with fp32 scales per 128 x 128 block,
// here of any value, not powers of two) loads straight into the fp8 recipe: the master holds the
// weights dequantised, and the compute copy of every linear weight is the checkpoint's own codes
// and scales, byte for byte (the recipe's own quantiser would round the scales to powers of two);
// a step trains from them.
// LoRA (model/lora.h) on every recipe: the adapters train through tight budgets bitwise as with
// room, with dropout; the frozen base keeps its compute copy alone (no gradient, master or
// moment bytes exist for it) and reads back as loaded (paged_state_test.cpp holds LoRA runs
// against the flat reference).
TEST_P(Fp8RecipeTest, LoraAdaptersPageBitwiseAndTheBaseHasNoTrainingState) {
  model::ModelConfig mc = fp8_config();
  mc.lora.rank = 4;
  mc.lora.alpha = 8;
  mc.lora.dropout = 0.1;
  ASSERT_TRUE(mc.validate("test").ok());
  model::ParamLayout layout(mc);
  ASSERT_TRUE(layout.has_lora());
  const auto batches = make_batches(kRecipeSteps * kRecipeAccum, kRecipeB * kRecipeT, 16);
  const TrainResult start = train(mc, batches, 0, 0, 0, 0, nullptr, /*steps=*/0);
  const TrainResult roomy = train(mc, batches, 0, 0, 0);
  for (double l : roomy.losses) ASSERT_TRUE(std::isfinite(l));
  const StateLayout state = StateLayout::of(GetParam().precision, GetParam().moments);
  const uint64_t c = PagedState::auto_chunk_bytes(layout, StateLayout::of(GetParam().precision));
  const TrainResult tight = train(mc, batches, 8 * c, 10 * c, 1024 * c, c);
  EXPECT_EQ(roomy.losses, tight.losses);
  EXPECT_TRUE(bitwise_equal(roomy.params, tight.params)) << "paging changed the parameters";
  EXPECT_TRUE(bitwise_equal(roomy.m, tight.m) && bitwise_equal(roomy.v, tight.v)) << "paging changed the moments";
  EXPECT_GT(tight.stats.host_to_device_bytes, 0u) << "nothing streamed to the device";
  EXPECT_GT(tight.stats.nvme_to_host_bytes, 0u) << "the nvme tier was never read";

  // The base reads back as it was loaded (through its compute copy), with no moments; every
  // adapter's B moved from its zero start.
  uint64_t adapter_elements = 0, adapter_moment_bytes = 0;
  for (const model::TensorSpec& t : layout.tensors()) {
    const size_t at = static_cast<size_t>(t.offset);
    if (t.adapts < 0) {
      EXPECT_EQ(std::memcmp(start.params.data() + at, roomy.params.data() + at, t.numel * sizeof(float)), 0)
          << "the frozen " << t.name << " changed";
      for (int64_t i = 0; i < t.numel; ++i) {
        if (roomy.m[at + i] != 0.0f || roomy.v[at + i] != 0.0f) {
          ADD_FAILURE() << "the frozen " << t.name << " has moments";
          break;
        }
      }
      continue;
    }
    adapter_elements += static_cast<uint64_t>(t.numel);
    adapter_moment_bytes += kernels::moment_bytes(GetParam().moments, t.numel);
    if (t.name.ends_with("lora_B.weight")) {
      bool moved = false;
      for (int64_t i = 0; i < t.numel; ++i) moved = moved || roomy.params[at + i] != 0.0f;
      EXPECT_TRUE(moved) << t.name << " did not train";
    }
  }
  // The state's bytes: gradients, master and moments of the adapters alone.
  EXPECT_EQ(PagedState::state_bytes(layout, state, StateKind::kGrad), adapter_elements * sizeof(float));
  EXPECT_EQ(PagedState::state_bytes(layout, state, StateKind::kAdamM), adapter_moment_bytes);
  EXPECT_EQ(PagedState::state_bytes(layout, state, StateKind::kMaster),
            state.separate_master() ? adapter_elements * sizeof(float) : 0);
  // The layers' moments are far under a chunk (sized for the frozen copies): they pack on from
  // chunk to chunk instead of each layer opening one (StateStore::packs_small_group).
  uint64_t moment_chunks = 0;
  for (uint64_t n : PagedState::group_chunks(layout, c, state, StateKind::kAdamM)) moment_chunks += n;
  EXPECT_LT(moment_chunks, static_cast<uint64_t>(mc.num_hidden_layers)) << "each layer's moments opened a chunk";

}

// LoRA on an MoE model's attention, dense MLP, shared expert and every routed expert (which then
// run expert by expert, model/moe_layer.h): the experts' adapters page with their experts, and the
// adapters train through tight budgets bitwise as with room, with dropout.
TEST_P(Fp8RecipeTest, LoraOnTheExpertsPagesBitwise) {
  model::ModelConfig mc = fp8_moe_config();
  mc.lora.rank = 4;
  mc.lora.alpha = 8;
  mc.lora.dropout = 0.1;
  mc.lora.targets |= model::kLoraExperts;
  ASSERT_TRUE(mc.validate("test").ok());
  model::ParamLayout layout(mc);
  const auto batches = make_batches(kRecipeSteps * kRecipeAccum, kRecipeB * kRecipeT, 19);
  const TrainResult start = train(mc, batches, 0, 0, 0, 0, nullptr, /*steps=*/0);
  const TrainResult roomy = train(mc, batches, 0, 0, 0);
  for (double l : roomy.losses) ASSERT_TRUE(std::isfinite(l));
  const uint64_t c = PagedState::auto_chunk_bytes(layout, StateLayout::of(GetParam().precision));
  const TrainResult tight = train(mc, batches, 24 * c, 1024 * c, 0, c);  // the experts stream to the device
  EXPECT_EQ(roomy.losses, tight.losses);
  EXPECT_TRUE(bitwise_equal(roomy.params, tight.params)) << "paging changed the parameters";
  EXPECT_TRUE(bitwise_equal(roomy.m, tight.m) && bitwise_equal(roomy.v, tight.v)) << "paging changed the moments";
  EXPECT_GT(tight.stats.host_to_device_bytes, 0u) << "nothing streamed to the device";
  int expert_adapters = 0, moved = 0, shared = 0;
  for (const model::TensorSpec& t : layout.tensors()) {
    const size_t at = static_cast<size_t>(t.offset);
    if (t.adapts < 0) {
      EXPECT_EQ(std::memcmp(start.params.data() + at, roomy.params.data() + at, t.numel * sizeof(float)), 0)
          << "the frozen " << t.name << " changed";
      continue;
    }
    shared += t.name.find(".shared_expert.") != std::string::npos ? 1 : 0;
    if (model::param_expert_of(layout, t) < 0 || !t.name.ends_with("lora_B.weight")) continue;
    ++expert_adapters;
    bool m = false;
    for (int64_t i = 0; i < t.numel; ++i) m = m || roomy.params[at + i] != 0.0f;
    moved += m ? 1 : 0;
  }
  EXPECT_EQ(expert_adapters, 2 * 8 * 3);  // two MoE layers, eight experts, three projections
  EXPECT_EQ(shared, 2 * 2 * 3);           // A and B of the shared expert's three projections
  EXPECT_GT(moved, expert_adapters / 2) << "the routed experts' adapters hardly trained";
}

// QLoRA's base (lora.base=nf4): the linear weights' compute copies are NF4 (kernels/nf4.h) of the
// loaded values, every other tensor bf16; the adapters train through tight budgets bitwise as
// with room, the base reads back as its NF4 values, and the copies take about a quarter of bf16's
// bytes. (Once, beside the bf16 recipe's instance: the moments are the parameter's.)
TEST_P(Fp8RecipeTest, LoraOnAnNf4BasePagesBitwise) {
  if (GetParam().precision != Precision::kBf16) GTEST_SKIP() << "runs beside the bf16 recipe's instance";
  model::ModelConfig mc = fp8_config();
  mc.lora.rank = 4;
  mc.lora.alpha = 8;
  ASSERT_TRUE(mc.validate("test").ok());
  model::ParamLayout layout(mc);
  precision_ = Precision::kNf4;
  const auto batches = make_batches(kRecipeSteps * kRecipeAccum, kRecipeB * kRecipeT, 18);
  const TrainResult start = train(mc, batches, 0, 0, 0, 0, nullptr, /*steps=*/0);
  const TrainResult roomy = train(mc, batches, 0, 0, 0);
  for (double l : roomy.losses) ASSERT_TRUE(std::isfinite(l));
  const StateLayout nf4 = StateLayout::of(Precision::kNf4, GetParam().moments);
  const uint64_t c = PagedState::auto_chunk_bytes(layout, StateLayout::of(Precision::kBf16));
  const TrainResult tight = train(mc, batches, 8 * c, 10 * c, 1024 * c, c);
  EXPECT_EQ(roomy.losses, tight.losses);
  EXPECT_TRUE(bitwise_equal(roomy.params, tight.params)) << "paging changed the parameters";
  EXPECT_TRUE(bitwise_equal(roomy.m, tight.m) && bitwise_equal(roomy.v, tight.v)) << "paging changed the moments";
  EXPECT_GT(tight.stats.nvme_to_host_bytes, 0u) << "the nvme tier was never read";
  const std::vector<float> init = initial_params(layout, 7);
  int matrices = 0;
  for (const model::TensorSpec& t : layout.tensors()) {
    const size_t at = static_cast<size_t>(t.offset);
    if (!t.frozen) continue;
    std::vector<float> expected(init.begin() + t.offset, init.begin() + t.offset + t.numel);
    if (model::param_is_linear_weight(layout, t)) {
      ++matrices;
      std::vector<uint8_t> q(kernels::nf4_layout(t.numel).bytes);
      kernels::nf4_quantize(expected.data(), t.numel, q.data());
      kernels::nf4_dequantize(q.data(), t.numel, expected.data());
    } else {
      for (float& x : expected) x = kernels::to_f32(kernels::to_bf16(x));
    }
    EXPECT_EQ(std::memcmp(expected.data(), start.params.data() + at, t.numel * sizeof(float)), 0)
        << t.name << " is not its loaded values in the base's format";
    EXPECT_EQ(std::memcmp(start.params.data() + at, roomy.params.data() + at, t.numel * sizeof(float)), 0)
        << "the frozen " << t.name << " changed";
  }
  EXPECT_EQ(matrices, 7 * mc.num_hidden_layers);
  const uint64_t bf16_copy = PagedState::state_bytes(layout, StateLayout::of(Precision::kBf16), StateKind::kParam);
  const uint64_t nf4_copy = PagedState::state_bytes(layout, nf4, StateKind::kParam);
  EXPECT_LT(nf4_copy, bf16_copy / 2) << "an nf4 base should take well under half of bf16's bytes";
}

TEST_P(Fp8RecipeTest, AnFp8CheckpointLoadsItsOwnCodesAndScalesAsTheComputeCopies) {
  if (GetParam().precision != Precision::kFp8) GTEST_SKIP() << "the fp8 recipe's copies";
  const model::ModelConfig mc = fp8_config();
  model::ParamLayout layout(mc);
  const auto written = model::write_checkpoint(dir_ / "fp8_checkpoint", layout, model::block_grid);
  Result<model::SafetensorsReader> reader = model::open_hf_weights((dir_ / "fp8_checkpoint").string(), layout);
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  std::vector<float> dequantised(static_cast<size_t>(layout.total_size()), 0.0f);
  ASSERT_TRUE(model::read_hf_weights(*reader, layout, dequantised.data()).ok());

  auto dev = CpuDevice::create(0, 0);
  ASSERT_TRUE(dev.ok());
  auto io = make_io_engine({.kind = "threads"});
  ASSERT_TRUE(io.ok());
  PagedStateOptions po;
  po.precision = GetParam().precision;
  po.moments = GetParam().moments;
  po.device_bytes = po.host_bytes = 1ull << 30;
  po.nvme_dir = (dir_ / "nvme").string();
  po.grad_accum = 1;
  po.optimizer = optimizer_config(0.5f);
  auto paged = PagedState::create(**dev, io->get(), layout, po);
  ASSERT_TRUE(paged.ok()) << paged.status().to_string();
  PagedState& ps = **paged;
  ASSERT_TRUE(ps.fill_kind(StateKind::kParam, [&](const model::TensorSpec& t, float* dst) {
                  return model::read_hf_tensor(*reader, t, dst);
                }).ok());
  ASSERT_TRUE(ps.fill_quantized_copies([&](const model::TensorSpec& t, uint8_t* copy) {
                  return model::read_hf_fp8_copy(*reader, t, copy);
                }).ok());
  std::vector<float> master(dequantised.size(), 0.0f);
  ASSERT_TRUE(ps.store_params(master.data()).ok());
  EXPECT_EQ(std::memcmp(master.data(), dequantised.data(), master.size() * sizeof(float)), 0)
      << "the master is not the dequantised checkpoint";

  std::unique_ptr<Stream> stream = (*dev)->create_stream();
  ps.set_compute_stream(stream.get());
  int copies = 0;
  for (const model::TensorSpec& t : layout.tensors()) {
    if (!model::param_is_linear_weight(layout, t)) continue;
    const model::Written& w = written.at(t.name);
    const int g = model::param_group_of(layout, t);
    ASSERT_TRUE(ps.begin(g, true, false).ok());
    stream->synchronize();
    const auto* copy = static_cast<const uint8_t*>(ps.param(t.offset));
    const int64_t rows = t.shape[0], cols = t.shape[1];
    EXPECT_EQ(std::memcmp(copy, w.bytes.data(), w.bytes.size()), 0) << t.name << "'s codes";
    EXPECT_EQ(std::memcmp(copy + kernels::fp8_matrix_scale_offset(rows, cols), w.scales.data(),
                          w.scales.size() * sizeof(float)),
              0)
        << t.name << "'s block scales";
    ps.end(g, true, false);
    ++copies;
  }
  ps.set_compute_stream(nullptr);
  EXPECT_GT(copies, 6);

  std::unique_ptr<model::Model> net = model::make_cpu_decoder(DType::kF8E4M3, mc, dev->get());
  net->set_access(&ps);
  const auto batches = make_batches(1, kRecipeB * kRecipeT, 16);
  ASSERT_TRUE(ps.zero_grads().ok());
  Result<double> loss = net->compute(batches[0].inputs.data(), batches[0].targets.data(), kRecipeB, kRecipeT, 1.0f / (kRecipeB * kRecipeT), true);
  ASSERT_TRUE(loss.ok()) << loss.status().to_string();
  EXPECT_TRUE(std::isfinite(*loss));
  EXPECT_TRUE(ps.clip_and_step(1e-2f).ok());
  net->set_access(nullptr);
}

// The compute copy the model reads: E4M3 blocks of the master for linear weights (bytes equal
// to the reference quantiser's), bf16 of the master for everything else.
TEST_P(Fp8RecipeTest, ComputeCopiesAreTheMasterQuantised) {
  if (GetParam().precision == Precision::kFp32) GTEST_SKIP() << "the fp32 recipe's copy is the master";
  const model::ModelConfig mc = fp8_config();
  const auto batches = make_batches(kRecipeSteps * kRecipeAccum, kRecipeB * kRecipeT, 6);
  PagedState* ps = nullptr;
  const TrainResult run = train(mc, batches, 0, 0, 0, 0, &ps);
  ASSERT_NE(ps, nullptr);
  // Read as a model would: on a compute stream, whose waits for the moves are done before the
  // host looks.
  std::unique_ptr<Stream> stream = devices_.back()->create_stream();
  ps->set_compute_stream(stream.get());
  model::ParamLayout layout(mc);
  int quantised = 0;
  for (const model::TensorSpec& t : layout.tensors()) {
    const int g = model::param_group_of(layout, t);
    ASSERT_TRUE(ps->begin(g, true, false).ok());
    stream->synchronize();
    const auto* copy = static_cast<const uint8_t*>(ps->param(t.offset));
    const float* master = run.params.data() + t.offset;
    const bool fp8 = GetParam().precision == Precision::kFp8 && model::param_is_linear_weight(layout, t);
    if (fp8) {
      const int64_t rows = t.shape[0], cols = t.numel / rows;
      std::vector<uint8_t> want(kernels::fp8_matrix_bytes(rows, cols));
      kernels::cpu::quantize_weight_e4m3(want.data(), master, rows, cols);
      EXPECT_EQ(std::memcmp(copy, want.data(), want.size()), 0) << t.name << " is not its master in E4M3 blocks";
      ++quantised;
    } else {
      for (int64_t i = 0; i < t.numel; ++i) {
        uint16_t bits;
        std::memcpy(&bits, copy + 2 * i, 2);
        ASSERT_EQ(bits, kernels::f32_to_bf16(master[i])) << t.name << "[" << i << "]";
      }
    }
    ps->end(g, true, false);
  }
  ps->set_compute_stream(nullptr);
  if (GetParam().precision == Precision::kFp8) {
    EXPECT_EQ(quantised, 7 * mc.num_hidden_layers);
  }
}

// What checkpoints read beside training (read_flat) is what store_moments decodes, for any range.
TEST_P(Fp8RecipeTest, MomentsReadInRangesEqualTheWholeDecode) {
  const model::ModelConfig mc = fp8_config();
  const auto batches = make_batches(kRecipeSteps * kRecipeAccum, kRecipeB * kRecipeT, 8);
  PagedState* ps = nullptr;
  const TrainResult run = train(mc, batches, 0, 0, 0, 0, &ps);
  ASSERT_NE(ps, nullptr);
  model::ParamLayout layout(mc);
  for (const auto& [kind, want] : {std::pair{StateKind::kAdamM, &run.m}, std::pair{StateKind::kAdamV, &run.v}}) {
    for (const model::TensorSpec& t : layout.tensors()) {
      const uint64_t numel = static_cast<uint64_t>(t.numel);
      // Ranges that start and end inside 256-element blocks, and the whole tensor.
      for (uint64_t first : {uint64_t{0}, uint64_t{77}, uint64_t{300}, numel / 3}) {
        for (uint64_t count : {uint64_t{1}, uint64_t{300}, numel}) {
          if (first >= numel) continue;
          count = std::min(count, numel - first);
          std::vector<float> got(count, -1.0f);
          const uint64_t at = static_cast<uint64_t>(t.offset) + first;
          ASSERT_TRUE(ps->read_flat(kind, at * 4, count * 4, got.data()).ok());
          for (uint64_t i = 0; i < count; ++i)
            ASSERT_EQ(got[i], (*want)[at + i]) << state_kind_name(kind) << " of " << t.name << " at " << first + i;
        }
      }
    }
  }
}

// Compact moments store fewer bytes and, stored back, decode to themselves (what a resume from a
// checkpoint of decoded moments relies on).
TEST_P(Fp8RecipeTest, MomentsLoadedBackAreUnchanged) {
  const model::ModelConfig mc = fp8_config();
  const auto batches = make_batches(kRecipeSteps * kRecipeAccum, kRecipeB * kRecipeT, 9);
  PagedState* ps = nullptr;
  const TrainResult run = train(mc, batches, 0, 0, 0, 0, &ps);
  ASSERT_NE(ps, nullptr);
  ASSERT_TRUE(ps->load_moments(run.m.data(), run.v.data()).ok());
  std::vector<float> m(run.m.size()), v(run.v.size());
  ASSERT_TRUE(ps->store_moments(m.data(), v.data()).ok());
  EXPECT_TRUE(bitwise_equal(m, run.m));
  EXPECT_TRUE(bitwise_equal(v, run.v));
}

INSTANTIATE_TEST_SUITE_P(Recipes, Fp8RecipeTest,
                         ::testing::Values(Recipe{Precision::kFp8, MomentFormat::kF32},
                                           Recipe{Precision::kFp8, MomentFormat::kBf16},
                                           Recipe{Precision::kFp8, MomentFormat::kInt8},
                                           Recipe{Precision::kBf16, MomentFormat::kInt8},
                                           Recipe{Precision::kFp32, MomentFormat::kBf16}),
                         [](const auto& info) {
                           return std::string(precision_name(info.param.precision)) + "_" +
                                  kernels::moment_format_name(info.param.moments);
                         });

// The fp8 copies halve what the compute copy weighs: the parameter bytes of the layers (where
// every matrix is E4M3) are about half the bf16 recipe's, and the planner counts the same bytes
// the store allocates.
TEST(Fp8Layout, ParameterBytesHalveAgainstBf16) {
  const model::ModelConfig mc = fp8_config();
  model::ParamLayout layout(mc);
  const uint64_t bf16 = PagedState::state_bytes(layout, StateLayout::of(Precision::kBf16), StateKind::kParam);
  const uint64_t fp8 = PagedState::state_bytes(layout, StateLayout::of(Precision::kFp8), StateKind::kParam);
  uint64_t matrices = 0, other = 0;
  for (const model::TensorSpec& t : layout.tensors())
    (model::param_is_linear_weight(layout, t) ? matrices : other) += static_cast<uint64_t>(t.numel);
  uint64_t scales = 0, pads = 0;
  for (const model::TensorSpec& t : layout.tensors()) {
    if (!model::param_is_linear_weight(layout, t)) continue;
    const int64_t rows = t.shape[0], cols = t.numel / rows;
    scales += static_cast<uint64_t>(kernels::fp8_blocks(rows) * kernels::fp8_blocks(cols)) * 4;
    pads += kernels::fp8_matrix_scale_offset(rows, cols) - static_cast<uint64_t>(t.numel);
  }
  EXPECT_EQ(bf16, 2 * (matrices + other));
  EXPECT_EQ(fp8, matrices + pads + scales + 2 * other);
  const StateLayout int8 = StateLayout::of(Precision::kBf16, MomentFormat::kInt8);
  EXPECT_LT(PagedState::state_bytes(layout, int8, StateKind::kAdamM), static_cast<uint64_t>(layout.num_parameters()) * 11 / 10)
      << "int8 moments take a byte per element and a scale per 256";
}

// The traffic the fp8 copies save, from real steps under a tight device budget: the compute
// copy's chunks that move between host and device weigh about half the bf16 recipe's. The model
// is shaped like Llama's layers (intermediate 3.5 x hidden), with the chunk as large as its
// largest fp32 tensor, so a layer's bf16 copy fills two chunks and its E4M3 copy one.
TEST(Fp8Traffic, ParameterTrafficHalvesAgainstBf16) {
  model::ModelConfig mc = tiny_config(true);
  mc.hidden_size = 128;
  mc.intermediate_size = 448;
  mc.num_attention_heads = 4;
  mc.num_key_value_heads = 2;
  mc.head_dim = 32;
  mc.num_hidden_layers = 8;
  const uint64_t chunk = static_cast<uint64_t>(mc.intermediate_size * mc.hidden_size) * 4;
  const auto batches = make_batches(2 * kRecipeAccum, kRecipeB * kRecipeT, 3);
  uint64_t moved[2] = {0, 0};
  for (int r = 0; r < 2; ++r) {
    const Precision precision = r == 0 ? Precision::kBf16 : Precision::kFp8;
    const std::vector<float> init = initial_params(model::ParamLayout(mc), 7);
    auto dev = CpuDevice::create(0, 0);
    auto io = make_io_engine({.kind = "threads"});
    ASSERT_TRUE(dev.ok() && io.ok());
    std::unique_ptr<model::Model> net =
        model::make_cpu_decoder(StateLayout::of(precision).compute_dtype(), mc, dev->get());
    PagedStateOptions po;
    po.precision = precision;
    po.chunk_bytes = chunk;
    po.device_bytes = 12 * chunk;  // a layer's state and a little: everything else streams
    po.host_bytes = 1ull << 30;
    po.grad_accum = kRecipeAccum;
    po.optimizer = optimizer_config(0.5f);
    auto ps = PagedState::create(**dev, io->get(), net->layout(), po);
    ASSERT_TRUE(ps.ok()) << ps.status().to_string();
    ASSERT_TRUE((*ps)->load_params(init.data()).ok());
    net->set_access(ps->get());
    const ChunkSpaceStats before = (*ps)->stats();
    for (int s = 0; s < 2; ++s) {
      ASSERT_TRUE((*ps)->zero_grads().ok());
      for (int m = 0; m < kRecipeAccum; ++m) {
        const Batch& b = batches[static_cast<size_t>(s * kRecipeAccum + m)];
        ASSERT_TRUE(net->compute(b.inputs.data(), b.targets.data(), kRecipeB, kRecipeT, 1.0f / (kRecipeAccum * kRecipeB * kRecipeT), true).ok());
      }
      ASSERT_TRUE((*ps)->clip_and_step(1e-2f).ok());
    }
    const size_t k = static_cast<size_t>(StateKind::kParam);
    moved[r] = (*ps)->stats().moved_by_kind[k] - before.moved_by_kind[k];
    net->set_access(nullptr);
  }
  const double ratio = static_cast<double>(moved[1]) / static_cast<double>(moved[0]);
  std::printf("compute-copy bytes moved in 2 steps: bf16 %llu, fp8 %llu, ratio %.3f (target <= 0.55)\n",
              static_cast<unsigned long long>(moved[0]), static_cast<unsigned long long>(moved[1]), ratio);
  ASSERT_GT(moved[0], 0u) << "the bf16 copies never moved: the budget does not force paging";
  EXPECT_LE(ratio, 0.55);
}

}  // namespace
}  // namespace strata
