// PagedWeights (train/paged_weights.h): generation over frozen weights in the chunk space.
// - The logits of a prompt and of each token decoded after it with the KV cache are bitwise
//   those of the same compute copy held whole in flat buffers (fp32, bf16), for a dense Llama,
//   a model with tied embeddings and an MoE model; and bitwise the same whether every group
//   lives on the device, the device holds only the groups in use with the rest in host memory,
//   or the rest is homed on nvme (fp32, bf16, fp8). The tight runs must move weights up.
// - A placement over all three tiers at once decodes the same bits; an nvme tier without
//   memory.host homes on nvme what the device has no room for; the fp8 copy computes the fp32
//   model's logits to within fp8's precision (a copy written in the wrong shape would not).
// - Budgets too small for what the model holds at once are refused naming the key.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../test_util.h"
#include "core/cpu_device.h"
#include "core/io_engine.h"
#include "kernels/bf16.h"
#include "model/decoder.h"
#include "model/flat_access.h"
#include "model/params.h"
#include "train/paged_weights.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

model::ModelConfig config_from(const nlohmann::json& j) {
  Result<model::ModelConfig> c = model::ModelConfig::from_json(j, "paged_weights_test");
  CHECK_MSG(c.ok(), c.status().to_string());
  return *c;
}

model::ModelConfig dense_config() {
  return config_from({{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", 53}, {"hidden_size", 32},
                      {"intermediate_size", 40}, {"num_hidden_layers", 4}, {"num_attention_heads", 4},
                      {"num_key_value_heads", 2}, {"max_position_embeddings", 64}});
}

model::ModelConfig tied_config() {
  return config_from({{"architectures", {"Qwen3ForCausalLM"}}, {"vocab_size", 41}, {"hidden_size", 32},
                      {"intermediate_size", 24}, {"num_hidden_layers", 3}, {"num_attention_heads", 4},
                      {"num_key_value_heads", 1}, {"head_dim", 12}, {"max_position_embeddings", 64},
                      {"tie_word_embeddings", true}});
}

model::ModelConfig moe_config() {
  return config_from({{"architectures", {"Qwen2MoeForCausalLM"}}, {"vocab_size", 31}, {"hidden_size", 16},
                      {"intermediate_size", 24}, {"num_hidden_layers", 3}, {"num_attention_heads", 2},
                      {"num_key_value_heads", 1}, {"max_position_embeddings", 64}, {"num_experts", 4},
                      {"num_experts_per_tok", 2}, {"moe_intermediate_size", 12},
                      {"shared_expert_intermediate_size", 20}, {"mlp_only_layers", {1}}});
}

DType compute_dtype(Precision p) { return StateLayout::of(p).compute_dtype(); }

constexpr int64_t kTokens = 12;
constexpr int64_t kPrefill = 4;

std::vector<int32_t> tokens_for(const model::ModelConfig& c) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < kTokens; ++i) t.push_back(static_cast<int32_t>((i * 7 + 3) % c.vocab_size));
  return t;
}

// The prompt's logits, then each next token's, all in one vector.
std::vector<float> decoded_logits(model::Model& net, const std::vector<int32_t>& tokens) {
  const size_t V = static_cast<size_t>(net.config().vocab_size);
  std::vector<float> out, logits(V);
  Status st = net.begin_sequence(kTokens, kPrefill);
  EXPECT_TRUE(st.ok()) << st.to_string();
  st = net.decode(tokens.data(), kPrefill, logits.data());
  EXPECT_TRUE(st.ok()) << st.to_string();
  out.insert(out.end(), logits.begin(), logits.end());
  for (int64_t t = kPrefill; t < kTokens; ++t) {
    st = net.decode(&tokens[static_cast<size_t>(t)], 1, logits.data());
    EXPECT_TRUE(st.ok()) << st.to_string();
    out.insert(out.end(), logits.begin(), logits.end());
  }
  return out;
}

struct Case {
  const char* name;
  model::ModelConfig (*config)();
};

class PagedWeightsTest : public ::testing::TestWithParam<std::tuple<Case, Precision>> {
 protected:
  void SetUp() override {
    dir_ = testing::fresh_test_dir("paged_weights");
  }
  void TearDown() override { fs::remove_all(dir_); }

  struct Run {
    std::vector<float> logits;
    WeightsPlacement placement;
    uint64_t moved_up = 0;   // host -> device bytes while decoding
    uint64_t read_nvme = 0;  // nvme -> host bytes while decoding
  };
  Result<Run> paged(const std::vector<float>& params, const PagedWeightsOptions& options) {
    const model::ModelConfig config = std::get<0>(GetParam()).config();
    const model::ParamLayout layout(config);
    ASSIGN_OR_RETURN(std::unique_ptr<CpuDevice> device, CpuDevice::create(0, 0));
    ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> io, make_io_engine(IoEngineOptions{}));
    ASSIGN_OR_RETURN(std::unique_ptr<PagedWeights> weights, PagedWeights::create(*device, io.get(), layout, options));
    RETURN_IF_ERROR(weights->load(params.data()));
    const ChunkSpaceStats loaded = weights->stats();
    std::unique_ptr<model::Model> net = model::make_cpu_decoder(compute_dtype(options.precision), config);
    net->set_access(weights.get());
    Run run;
    run.logits = decoded_logits(*net, tokens_for(config));
    net->set_access(nullptr);
    run.placement = weights->placement();
    const ChunkSpaceStats after = weights->stats();
    run.moved_up = after.host_to_device_bytes - loaded.host_to_device_bytes;
    run.read_nvme = after.nvme_to_host_bytes - loaded.nvme_to_host_bytes;
    return run;
  }
  fs::path dir_;
};

class PagedWeightsTest_ThreeTiers : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::fresh_test_dir("paged_weights_three");
  }
  void TearDown() override { fs::remove_all(dir_); }
  // The decoded logits of dense_config() with these options.
  Result<std::vector<float>> decode(const std::vector<float>& params, const PagedWeightsOptions& options) {
    const model::ModelConfig config = dense_config();
    ASSIGN_OR_RETURN(std::unique_ptr<CpuDevice> device, CpuDevice::create(0, 0));
    ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> io, make_io_engine(IoEngineOptions{}));
    ASSIGN_OR_RETURN(std::unique_ptr<PagedWeights> weights,
                     PagedWeights::create(*device, io.get(), model::ParamLayout(config), options));
    RETURN_IF_ERROR(weights->load(params.data()));
    std::unique_ptr<model::Model> net = model::make_cpu_decoder(compute_dtype(options.precision), config);
    net->set_access(weights.get());
    std::vector<float> logits = decoded_logits(*net, tokens_for(config));
    net->set_access(nullptr);
    return logits;
  }
  fs::path dir_;
};

// The groups the model holds at once, in chunks (what memory.device must hold at least).
uint64_t held_at_once(const WeightsPlacement& p, bool tied) {
  uint64_t largest = 0;
  for (uint64_t c : p.chunks) largest = std::max(largest, c);
  return std::max(largest, tied ? p.chunks.front() + p.chunks.back() : 0);
}

TEST_P(PagedWeightsTest, TightBudgetsDecodeBitwiseAsRoomyOnesAndFlatWeights) {
  const auto& [c, precision] = GetParam();
  const model::ModelConfig config = c.config();
  const model::ParamLayout layout(config);
  std::vector<float> params(static_cast<size_t>(layout.total_size()));
  model::init_weights(layout, params.data(), 5);

  PagedWeightsOptions roomy;
  roomy.precision = precision;
  roomy.device_bytes = 1ull << 30;
  Result<Run> all = paged(params, roomy);
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  for (Tier home : all->placement.homes) EXPECT_EQ(home, Tier::kDevice);
  EXPECT_EQ(all->moved_up, 0u) << "a roomy run moved weights up";

  // Against the compute copy held whole (the fp8 recipe's copy has no flat form here).
  if (precision != Precision::kFp8) {
    std::vector<uint16_t> bf16;
    if (precision == Precision::kBf16) {
      bf16.resize(params.size());
      kernels::round_to_bf16(bf16.data(), params.data(), static_cast<int64_t>(params.size()));
    }
    const DType dtype = compute_dtype(precision);
    model::FlatAccess flat(dtype, bf16.empty() ? static_cast<void*>(params.data()) : bf16.data(), nullptr);
    std::unique_ptr<model::Model> net = model::make_cpu_decoder(dtype, config);
    net->set_access(&flat);
    const std::vector<float> expected = decoded_logits(*net, tokens_for(config));
    net->set_access(nullptr);
    ASSERT_EQ(expected.size(), all->logits.size());
    EXPECT_EQ(0, std::memcmp(expected.data(), all->logits.data(), expected.size() * sizeof(float)));
  }

  const bool tied = layout.lm_head() == layout.embed_tokens();
  const uint64_t chunk = all->placement.chunk_bytes;
  const uint64_t at_once = held_at_once(all->placement, tied);

  // Through host memory: the device holds what the model uses at once, and one chunk more.
  PagedWeightsOptions host = roomy;
  host.device_bytes = (at_once + 1) * chunk;
  Result<Run> through_host = paged(params, host);
  ASSERT_TRUE(through_host.ok()) << through_host.status().to_string();
  EXPECT_GT(through_host->moved_up, 0u);
  EXPECT_EQ(0, std::memcmp(all->logits.data(), through_host->logits.data(), all->logits.size() * sizeof(float)));

  // Through nvme: the host holds its staging and passing slots only.
  PagedWeightsOptions nvme = host;
  nvme.device_bytes = at_once * chunk;
  uint64_t largest = 0;
  for (uint64_t n : all->placement.chunks) largest = std::max(largest, n);
  nvme.host_bytes = (3 + largest) * chunk;
  nvme.nvme_bytes = 1ull << 30;
  nvme.nvme_dir = dir_.string();
  Result<Run> through_nvme = paged(params, nvme);
  ASSERT_TRUE(through_nvme.ok()) << through_nvme.status().to_string();
  int on_nvme = 0;
  for (Tier home : through_nvme->placement.homes) on_nvme += home == Tier::kNvme;
  EXPECT_GT(on_nvme, 0);
  EXPECT_GT(through_nvme->read_nvme, 0u);
  EXPECT_EQ(0, std::memcmp(all->logits.data(), through_nvme->logits.data(), all->logits.size() * sizeof(float)));
}

INSTANTIATE_TEST_SUITE_P(Models, PagedWeightsTest,
                         ::testing::Combine(::testing::Values(Case{"dense", dense_config}, Case{"tied", tied_config},
                                                             Case{"moe", moe_config}),
                                            ::testing::Values(Precision::kFp32, Precision::kBf16, Precision::kFp8)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  precision_name(std::get<1>(info.param));
                         });

TEST_F(PagedWeightsTest_ThreeTiers, ThreeTiersAtOnceAndNvmeWithoutAHostBudgetDecodeBitwise) {
  const model::ModelConfig config = dense_config();
  const model::ParamLayout layout(config);
  std::vector<float> params(static_cast<size_t>(layout.total_size()));
  model::init_weights(layout, params.data(), 5);
  PagedWeightsOptions roomy;
  roomy.device_bytes = 1ull << 30;
  Result<WeightsPlacement> all = place_weights(layout, roomy);
  ASSERT_TRUE(all.ok());
  const uint64_t chunk = all->chunk_bytes;
  uint64_t largest = 0, in_flight = 0;
  std::vector<uint64_t> sorted = all->chunks;
  std::sort(sorted.rbegin(), sorted.rend());
  largest = sorted[0];
  for (size_t i = 0; i < 3 && i < sorted.size(); ++i) in_flight += sorted[i];
  // The device: the groups in flight, the largest once more and one chunk (the embedding's); the
  // host: its staging and one layer; nvme the rest.
  PagedWeightsOptions three = roomy;
  three.device_bytes = (in_flight + largest + 1) * chunk;
  three.host_bytes = (3 + largest + all->chunks[2]) * chunk;
  three.nvme_bytes = 1ull << 30;
  three.nvme_dir = dir_.string();
  Result<std::vector<float>> expected = decode(params, roomy);
  ASSERT_TRUE(expected.ok()) << expected.status().to_string();
  Result<WeightsPlacement> spread = place_weights(layout, three);
  ASSERT_TRUE(spread.ok()) << spread.status().to_string();
  for (Tier t : {Tier::kDevice, Tier::kHost, Tier::kNvme})
    EXPECT_NE(std::count(spread->homes.begin(), spread->homes.end(), t), 0) << tier_name(t);
  Result<std::vector<float>> got = decode(params, three);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(*got, *expected);

  // memory.host unset with nvme: the host stages only, and every group off the device is on nvme.
  PagedWeightsOptions no_host = three;
  no_host.host_bytes = 0;
  Result<WeightsPlacement> staged = place_weights(layout, no_host);
  ASSERT_TRUE(staged.ok()) << staged.status().to_string();
  EXPECT_EQ(std::count(staged->homes.begin(), staged->homes.end(), Tier::kHost), 0);
  EXPECT_EQ(staged->host_slots, 3 + largest);
  got = decode(params, no_host);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(*got, *expected);

  // fp8: E4M3 weights (3 mantissa bits, a relative step of 1/16) move the logits by a few
  // percent; a copy quantised in the wrong shape scrambles them.
  PagedWeightsOptions fp8 = three;
  fp8.precision = Precision::kFp8;
  got = decode(params, fp8);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_WITHIN(testing::relative_error(*got, *expected), 0.15);
}

TEST(PagedWeights, BudgetsBelowWhatTheModelHoldsAtOnceAreRefusedByName) {
  const model::ParamLayout layout(dense_config());
  PagedWeightsOptions o;
  o.device_bytes = 1ull << 30;
  Result<WeightsPlacement> roomy = place_weights(layout, o);
  ASSERT_TRUE(roomy.ok()) << roomy.status().to_string();
  const uint64_t chunk = roomy->chunk_bytes;
  const uint64_t at_once = held_at_once(*roomy, false);

  o.device_bytes = at_once * chunk - 1;
  Result<WeightsPlacement> small = place_weights(layout, o);
  ASSERT_FALSE(small.ok());
  EXPECT_EQ(small.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(small.status().message().find("memory.device"), std::string::npos) << small.status().to_string();

  // Without nvme the host must hold every group the device has no room for.
  o.device_bytes = at_once * chunk;
  o.host_bytes = 3 * chunk;
  Result<WeightsPlacement> host = place_weights(layout, o);
  ASSERT_FALSE(host.ok());
  EXPECT_NE(host.status().message().find("memory.host"), std::string::npos) << host.status().to_string();

  // With nvme the host stages the rest through it, which must hold it.
  uint64_t largest = 0;
  for (uint64_t n : roomy->chunks) largest = std::max(largest, n);
  o.host_bytes = (3 + largest) * chunk;
  o.nvme_bytes = chunk;
  Result<WeightsPlacement> nvme = place_weights(layout, o);
  ASSERT_FALSE(nvme.ok());
  EXPECT_NE(nvme.status().message().find("raise memory.nvme.size"), std::string::npos) << nvme.status().to_string();
}

}  // namespace
}  // namespace strata
