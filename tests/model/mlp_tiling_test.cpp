// The dense MLP over token tiles (Model::set_mlp_tile_tokens) against the untiled MLP at
// T = 2048, in fp32 and the bf16 recipe, with kept layers and with recompute:
// - under the fixed-order GEMM (whose rows do not depend on each other) the loss and every
//   gradient but the MLP weights' are bitwise the untiled ones: the tiles compute the same
//   rows;
// - the MLP weights' gradients add the tiles' partial sums: per element the two differ by at
//   most 2 gamma_N sum_t |dy_t x_t| (N tokens, gamma_N = N u / (1 - N u), u = 2^-24), which over
//   the whole tensor the test takes as a relative (Frobenius) error of 1e-4, about gamma_2048;
// - the activation table's MLP buffers hold a tile: doubling T leaves their bytes unchanged;
// - the same for MoE layers: the routed experts over tiles of the expert order, the shared expert
//   over token tiles.
#include <cmath>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../test_util.h"
#include "kernels/linear.h"
#include "model/fixed_order_gemm.h"
#include "model/activations.h"
#include "model/decoder.h"
#include "model/flat_model.h"

namespace strata::model {
namespace {

ModelConfig llama(int64_t intermediate) {
  Result<ModelConfig> c = ModelConfig::from_json(
      {{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", 64}, {"hidden_size", 32},
       {"intermediate_size", intermediate}, {"num_hidden_layers", 2}, {"num_attention_heads", 2},
       {"num_key_value_heads", 1}, {"max_position_embeddings", 4096}},
      "mlp_tiling_test");
  CHECK_MSG(c.ok(), c.status().to_string());
  return *c;
}

constexpr int64_t kT = 2048;

struct Result2 {
  double loss = 0;
  std::vector<float> grads;
};

template <class Net>
Result2 train_step(const ModelConfig& config, int64_t tile, bool keep_layers, int64_t T = kT) {
  FlatModel<Net> model(config);
  model.init_weights(3);
  model.net().set_mlp_tile_tokens(tile);
  model.net().set_keep_layer_activations(keep_layers);
  std::vector<int32_t> inputs(T), targets(T);
  for (int64_t t = 0; t < T; ++t) {
    inputs[static_cast<size_t>(t)] = static_cast<int32_t>((t * 13 + 5) % config.vocab_size);
    targets[static_cast<size_t>(t)] = static_cast<int32_t>((t * 7 + 1) % config.vocab_size);
  }
  model.zero_grads();
  Result<double> loss = model.compute(inputs.data(), targets.data(), 1, T, 1.0f, /*backward=*/true);
  EXPECT_TRUE(loss.ok()) << loss.status().to_string();
  Result2 r;
  r.loss = loss.ok() ? *loss : NAN;
  const size_t n = static_cast<size_t>(model.layout().total_size());
  r.grads.assign(model.grads(), model.grads() + n);
  return r;
}

bool is_mlp_weight(const TensorSpec& t) {
  return t.name.find("mlp.gate_proj") != std::string::npos || t.name.find("mlp.up_proj") != std::string::npos ||
         t.name.find("mlp.down_proj") != std::string::npos;
}

// The tiled step against the untiled one for `config`: the loss and every gradient bitwise,
// but those `summed_over_rows` names (within the bound above), which are counted in `summed`;
// `expert_sums_differ` counts the experts' weights whose gradients differ at all.
struct TileCounts {
  int summed = 0, expert_sums_differ = 0;
};
template <class Net>
TileCounts expect_tiled_step_matches(const ModelConfig& config, int64_t tile, bool keep,
                                     bool (*summed_over_rows)(const TensorSpec&), int64_t T = kT) {
  const ParamLayout layout(config);
  const Result2 untiled = train_step<Net>(config, 0, keep, T);
  const Result2 tiled = train_step<Net>(config, tile, keep, T);
  EXPECT_EQ(std::memcmp(&untiled.loss, &tiled.loss, sizeof(double)), 0)
      << untiled.loss << " untiled, " << tiled.loss << " tiled";
  TileCounts n;
  for (const TensorSpec& t : layout.tensors()) {
    const float* a = untiled.grads.data() + t.offset;
    const float* b = tiled.grads.data() + t.offset;
    const bool same = std::memcmp(a, b, static_cast<size_t>(t.numel) * sizeof(float)) == 0;
    if (summed_over_rows(t)) {
      ++n.summed;
      EXPECT_WITHIN(testing::relative_error(b, a, t.numel), 1e-4) << t.name;
      if (t.name.find(".experts.") != std::string::npos && !same) ++n.expert_sums_differ;
    } else {
      EXPECT_TRUE(same) << t.name << " keep " << keep;
    }
  }
  return n;
}

template <class Net>
void expect_tiles_match_untiled(int64_t tile) {
  FixedOrderGemm gemm;
  const ModelConfig config = llama(96);
  for (const bool keep : {false, true})
    EXPECT_EQ(expect_tiled_step_matches<Net>(config, tile, keep, is_mlp_weight).summed, 3 * config.num_hidden_layers);
}

TEST(MlpTiling, TiledMlpGivesTheUntiledRowsFp32) { expect_tiles_match_untiled<LlamaModel>(384); }
TEST(MlpTiling, TiledMlpGivesTheUntiledRowsBf16) { expect_tiles_match_untiled<LlamaModelBf16>(512); }

// A table planned with the MLP in tiles keeps no kept layer's MLP intermediates: a later, shorter
// micro-batch (no longer than a tile) still runs the MLP as tiles, one here, and so computes
// bitwise what an untiled model does on it.
TEST(MlpTiling, AShorterMicroBatchAfterATiledOneRunsAsOneTile) {
  FixedOrderGemm gemm;
  const ModelConfig config = llama(96);
  FlatModel<LlamaModel> tiled(config), untiled(config);
  tiled.init_weights(3);
  untiled.init_weights(3);
  tiled.net().set_mlp_tile_tokens(384);
  for (FlatModel<LlamaModel>* m : {&tiled, &untiled}) m->net().set_keep_layer_activations(true);
  std::vector<int32_t> tokens(kT);
  for (int64_t t = 0; t < kT; ++t) tokens[static_cast<size_t>(t)] = static_cast<int32_t>((t * 5 + 2) % config.vocab_size);
  ASSERT_TRUE(tiled.compute(tokens.data(), tokens.data(), 1, kT, 1.0f, true).ok());  // plans the tiled table
  const int64_t T = 100;
  tiled.zero_grads();
  untiled.zero_grads();
  Result<double> a = tiled.compute(tokens.data() + 1, tokens.data(), 1, T, 1.0f, true);
  Result<double> b = untiled.compute(tokens.data() + 1, tokens.data(), 1, T, 1.0f, true);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  const size_t n = static_cast<size_t>(tiled.layout().total_size());
  EXPECT_EQ(std::memcmp(tiled.grads(), untiled.grads(), n * sizeof(float)), 0);
}

// MoE layers (4 experts, 2 per token; T = 1024) over tiles: the routed experts over tiles of the
// expert order's rows, the shared expert (and the dense first layer) over token tiles. As for
// the dense MLP, the fixed-order GEMM computes every row alike however the rows are split, so the
// loss and every gradient but those summed over rows (the experts', the shared expert's and the
// dense MLP's weights) are bitwise the untiled ones, and those within the same bound.
ModelConfig moe(bool shared) {
  nlohmann::json j = {{"architectures", {shared ? "Qwen2MoeForCausalLM" : "MixtralForCausalLM"}},
                      {"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 96},
                      {"num_hidden_layers", 3}, {"num_attention_heads", 2}, {"num_key_value_heads", 1},
                      {"max_position_embeddings", 4096}, {"num_local_experts", 4}, {"num_experts", 4},
                      {"num_experts_per_tok", 2}, {"moe_intermediate_size", 48}, {"tie_word_embeddings", false}};
  if (shared) {
    j["shared_expert_intermediate_size"] = 64;
    j["mlp_only_layers"] = {0};
  }
  Result<ModelConfig> c = ModelConfig::from_json(j, "mlp_tiling_test");
  CHECK_MSG(c.ok(), c.status().to_string());
  return *c;
}

bool sums_over_rows(const TensorSpec& t) {
  return is_mlp_weight(t) || t.name.find(".experts.") != std::string::npos ||
         t.name.find("shared_expert.") != std::string::npos;
}

template <class Net>
void expect_moe_tiles_match_untiled(bool shared, int64_t tile) {
  FixedOrderGemm gemm;
  const ModelConfig config = moe(shared);
  ASSERT_TRUE(config.is_moe());
  ASSERT_EQ(config.shared_expert_intermediate_size > 0, shared);
  for (const bool keep : {false, true}) {
    // 1024 tokens, 2048 expert rows: several tiles of each, at half the cost of kT (the suites
    // under sanitizers run these too).
    const TileCounts n = expect_tiled_step_matches<Net>(config, tile, keep, sums_over_rows, 1024);
    EXPECT_GE(n.summed, 3 * config.num_experts * config.num_moe_layers());
    // An expert whose rows span tiles adds partial sums: the tiles did run.
    EXPECT_GT(n.expert_sums_differ, 0);
  }
}

TEST(MlpTiling, TiledExpertsGiveTheUntiledRowsFp32) { expect_moe_tiles_match_untiled<LlamaModel>(false, 384); }
TEST(MlpTiling, TiledExpertsAndSharedExpertGiveTheUntiledRowsFp32) {
  expect_moe_tiles_match_untiled<LlamaModel>(true, 384);
}
TEST(MlpTiling, TiledExpertsAndSharedExpertGiveTheUntiledRowsBf16) {
  expect_moe_tiles_match_untiled<LlamaModelBf16>(true, 256);
}

// The experts' intermediates hold a tile of rows too: a wider expert adds the same bytes at any
// T when tiled (three buffers and their gradients of a tile's rows), more at a longer T untiled.
TEST(MlpTiling, TheExpertBuffersHoldATileWhateverT) {
  auto expert_share = [](int64_t T, int64_t tile, bool keep) {
    using Table = ActivationTable<kernels::CpuF32Ops>;
    ModelConfig wide = moe(true);
    wide.moe_intermediate_size *= 2;
    return Table::bytes_for(wide, T, false, keep, 1, tile) - Table::bytes_for(moe(true), T, false, keep, 1, tile);
  };
  for (const bool keep : {false, true}) {
    EXPECT_EQ(expert_share(4096, 256, keep), expert_share(2048, 256, keep));
    EXPECT_EQ(expert_share(2048, 256, keep), 6 * 256 * 48 * int64_t{sizeof(float)});
    EXPECT_GT(expert_share(4096, 0, keep), expert_share(2048, 0, keep));
  }
  // The fp8 recipe keeps the routed experts untiled (their weight gradients' 128-row blocks count
  // from each expert's first row): their share grows with T, tiles or not.
  using Fp8Table = ActivationTable<kernels::CpuFp8Ops>;
  ModelConfig wide = moe(true);
  wide.moe_intermediate_size *= 2;
  auto fp8_share = [&](int64_t T) {
    return Fp8Table::bytes_for(wide, T, false, false, 1, 256) - Fp8Table::bytes_for(moe(true), T, false, false, 1, 256);
  };
  EXPECT_GT(fp8_share(4096), fp8_share(2048));
}

// The MLP's share of the table (the bytes a wider intermediate adds) does not grow with T when
// tiled, and does untiled.
TEST(MlpTiling, TheMlpBuffersHoldATileWhateverT) {
  auto mlp_share = [](int64_t T, int64_t tile, bool keep) {
    using Table = ActivationTable<kernels::CpuF32Ops>;
    return Table::bytes_for(llama(192), T, false, keep, 1, tile) - Table::bytes_for(llama(96), T, false, keep, 1, tile);
  };
  for (const bool keep : {false, true}) {
    EXPECT_EQ(mlp_share(4096, 256, keep), mlp_share(2048, 256, keep));
    EXPECT_EQ(mlp_share(2048, 256, keep), 6 * 256 * 96 * int64_t{sizeof(float)});
    EXPECT_GT(mlp_share(4096, 0, keep), mlp_share(2048, 0, keep));
  }
}

}  // namespace
}  // namespace strata::model
