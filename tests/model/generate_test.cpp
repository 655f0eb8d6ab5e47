// Generation with the KV cache (Decoder::begin_sequence / decode, model/generate.h):
// - the cached logits of every position equal those of recomputing the whole prefix: bitwise
//   with the fixed-order GEMM, whose sums do not depend on the number of rows, for a dense
//   Llama, a Qwen3-style model (q/k norms, biases) and an MoE model (shared expert, a dense
//   layer), in fp32 and in the bf16 recipe; within a bound with OpenBLAS;
// - greedy decoding gives transformers' generate(do_sample=False) tokens on tiny random Llama,
//   Mixtral and Qwen2-MoE models (tests/model/reference_generate.py), and its logits agree;
// - the decode head agrees with the training forward's loss, and training after generation is
//   unchanged; ops queued on a chaos-mode stream decode the same bits;
// - the sampler is seeded, greedy at temperature 0 and keeps only the top-p tokens.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../test_util.h"
#include "core/cpu_device.h"
#include "kernels/linear.h"
#include "model/fixed_order_gemm.h"
#include "model/decoder.h"
#include "model/flat_model.h"
#include "model/generate.h"
#include "model/reference_util.h"

namespace strata::model {
namespace {

ModelConfig config_from(const nlohmann::json& j) {
  Result<ModelConfig> c = ModelConfig::from_json(j, "generate_test");
  CHECK_MSG(c.ok(), c.status().to_string());
  return *c;
}

// Llama with GQA; head_dim 8.
ModelConfig llama_config() {
  return config_from({{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", 53}, {"hidden_size", 32},
                      {"intermediate_size", 40}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                      {"num_key_value_heads", 2}, {"max_position_embeddings", 128}, {"rope_theta", 10000.0}});
}

// Qwen3-style: per-head q/k RMSNorm, tied embeddings; YaRN rotates with an attention factor.
ModelConfig qk_norm_config() {
  return config_from({{"architectures", {"Qwen3ForCausalLM"}}, {"vocab_size", 41}, {"hidden_size", 32},
                      {"intermediate_size", 24}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                      {"num_key_value_heads", 1}, {"head_dim", 12}, {"max_position_embeddings", 64},
                      {"tie_word_embeddings", true},
                      {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 2.0}, {"original_max_position_embeddings", 32}}}});
}

// Qwen2-MoE: layers 0 and 2 have 4 experts (top-2) and a shared expert, layer 1 is dense.
ModelConfig qwen2_moe_config() {
  return config_from({{"architectures", {"Qwen2MoeForCausalLM"}}, {"vocab_size", 31}, {"hidden_size", 16},
                      {"intermediate_size", 24}, {"num_hidden_layers", 3}, {"num_attention_heads", 2},
                      {"num_key_value_heads", 1}, {"max_position_embeddings", 64}, {"num_experts", 4},
                      {"num_experts_per_tok", 2}, {"moe_intermediate_size", 12},
                      {"shared_expert_intermediate_size", 20}, {"mlp_only_layers", {1}}});
}

std::vector<int32_t> random_prompt(int64_t n, int64_t vocab, uint64_t seed) {
  const std::vector<float> r = testing::random_vector(n, seed, 0.0f, 1.0f);
  std::vector<int32_t> out;
  for (float x : r) out.push_back(std::min(static_cast<int32_t>(x * static_cast<float>(vocab)), static_cast<int32_t>(vocab - 1)));
  return out;
}

// Logits of positions prefill-1 .. n-1: the prompt's first `prefill` tokens in one decode, then
// one token per decode.
std::vector<std::vector<float>> cached_logits(Model& model, const std::vector<int32_t>& tokens, int64_t prefill) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  const size_t V = static_cast<size_t>(model.config().vocab_size);
  std::vector<std::vector<float>> out;
  EXPECT_TRUE(model.begin_sequence(n, prefill).ok());
  std::vector<float> logits(V);
  Status st = model.decode(tokens.data(), prefill, logits.data());
  EXPECT_TRUE(st.ok()) << st.to_string();
  out.push_back(logits);
  for (int64_t t = prefill; t < n; ++t) {
    st = model.decode(&tokens[static_cast<size_t>(t)], 1, logits.data());
    EXPECT_TRUE(st.ok()) << st.to_string();
    out.push_back(logits);
  }
  EXPECT_EQ(model.sequence_length(), n);
  return out;
}

// The logits of position t recomputed from scratch: tokens 0..t in one decode of a new sequence.
std::vector<float> recomputed_logits(Model& model, const std::vector<int32_t>& tokens, int64_t t) {
  std::vector<float> logits(static_cast<size_t>(model.config().vocab_size));
  EXPECT_TRUE(model.begin_sequence(t + 1, t + 1).ok());
  Status st = model.decode(tokens.data(), t + 1, logits.data());
  EXPECT_TRUE(st.ok()) << st.to_string();
  return logits;
}

constexpr int64_t kTokens = 40;  // crosses two 16-row blocks of the CPU attention
constexpr int64_t kPrefill = 5;

template <class Net>
void expect_cached_equals_recomputed(const ModelConfig& config, bool bitwise, double tolerance) {
  FlatModel<Net> model(config);
  model.init_weights(7);
  const std::vector<int32_t> tokens = random_prompt(kTokens, config.vocab_size, 11);
  const std::vector<std::vector<float>> cached = cached_logits(model.net(), tokens, kPrefill);
  ASSERT_EQ(static_cast<int64_t>(cached.size()), kTokens - kPrefill + 1);
  for (int64_t t = kPrefill - 1; t < kTokens; ++t) {
    const std::vector<float> full = recomputed_logits(model.net(), tokens, t);
    const std::vector<float>& kv = cached[static_cast<size_t>(t - kPrefill + 1)];
    ASSERT_EQ(kv.size(), full.size());
    if (bitwise) {
      EXPECT_EQ(std::memcmp(kv.data(), full.data(), kv.size() * sizeof(float)), 0) << "position " << t;
    } else {
      EXPECT_WITHIN(testing::relative_error(kv, full), tolerance) << " position " << t;
    }
  }
}

// The fixed-order GEMM computes every output element over K in one order whatever the number of
// rows, and every other op treats rows (and, in attention, query rows against their keys)
// independently in a fixed order: a position's logits do not depend on how the sequence is cut.
TEST(Generate, KvCacheLogitsAreBitwiseTheFullRecomputeWithFixedOrderGemm) {
  FixedOrderGemm gemm(true);
  expect_cached_equals_recomputed<LlamaModel>(llama_config(), /*bitwise=*/true, 0);
  expect_cached_equals_recomputed<LlamaModel>(qk_norm_config(), true, 0);
  expect_cached_equals_recomputed<LlamaModel>(qwen2_moe_config(), true, 0);
}

TEST(Generate, KvCacheLogitsAreBitwiseTheFullRecomputeInTheBf16Recipe) {
  FixedOrderGemm gemm(true);
  expect_cached_equals_recomputed<LlamaModelBf16>(llama_config(), true, 0);
  expect_cached_equals_recomputed<LlamaModelBf16>(qwen2_moe_config(), true, 0);
}

// With OpenBLAS a GEMM of one row and one of many may sum in different orders. Two orders of an
// fp32 dot product of K terms differ by at most about 2 K u sum|a_i b_i| (u = 2^-24): for the
// widest K here (40) about 5e-6 of the terms' magnitude per GEMM. Through the ~10 GEMMs and
// norms between the embedding and the logits, 1e-4 relative (in the 2-norm over the
// vocabulary) leaves a margin of a few times that.
TEST(Generate, KvCacheLogitsMatchTheFullRecomputeWithOpenBlas) {
  FixedOrderGemm gemm(false);
  expect_cached_equals_recomputed<LlamaModel>(llama_config(), /*bitwise=*/false, 1e-4);
  expect_cached_equals_recomputed<LlamaModel>(qwen2_moe_config(), false, 1e-4);
}

// Decoding's head (final norm and LM head on the last row) and the training forward's fused LM
// head and cross-entropy give the same NLL of a sequence.
TEST(Generate, CachedLogitsGiveTheTrainingForwardsLoss) {
  for (const ModelConfig& config : {llama_config(), qwen2_moe_config()}) {
    FlatModel<LlamaModel> model(config);
    model.init_weights(3);
    const std::vector<int32_t> tokens = random_prompt(kTokens, config.vocab_size, 5);
    std::vector<int32_t> inputs(tokens.begin(), tokens.end() - 1), targets(tokens.begin() + 1, tokens.end());
    const int64_t T = kTokens - 1;
    const double loss_before = model.forward_loss(inputs.data(), targets.data(), 1, T);
    const std::vector<std::vector<float>> cached = cached_logits(model.net(), inputs, 1);
    double nll = 0;
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<float>& z = cached[static_cast<size_t>(t)];
      const double m = *std::max_element(z.begin(), z.end());
      double sum = 0;
      for (float x : z) sum += std::exp(static_cast<double>(x) - m);
      nll += m + std::log(sum) - z[static_cast<size_t>(targets[static_cast<size_t>(t)])];
    }
    EXPECT_WITHIN(relative(nll, loss_before), 1e-5) << " decode NLL " << nll << " vs forward " << loss_before;
    // Training after generation plans the activation table anew and computes as before.
    const double loss_after = model.forward_loss(inputs.data(), targets.data(), 1, T);
    EXPECT_EQ(loss_before, loss_after);
  }
}

// Queued on a compute stream in chaos mode (random delays before every task, released slots
// poisoned), decoding reads its tokens and logits only after the ops that own them: the same bits
// as ops run in the caller.
TEST(Generate, QueuedOpsOnAChaoticStreamDecodeAsOpsInTheCaller) {
  FixedOrderGemm gemm(true);
  Result<std::unique_ptr<CpuDevice>> device = CpuDevice::create(0, 0, /*chaos_seed=*/5);
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  for (const ModelConfig& config : {llama_config(), qwen2_moe_config()}) {
    FlatModel<LlamaModel> direct(config);
    FlatModel<LlamaModel> queued(config, CpuF32Model(device->get()));
    direct.init_weights(9);
    queued.init_weights(9);
    const std::vector<int32_t> tokens = random_prompt(24, config.vocab_size, 4);
    const auto want = cached_logits(direct.net(), tokens, 6);
    const auto got = cached_logits(queued.net(), tokens, 6);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), got[i].size() * sizeof(float)), 0) << "step " << i;
    GenerateOptions options;
    options.max_new_tokens = 10;
    options.sampling = {0.9, 0.95, 3};
    Result<std::vector<int32_t>> a = generate(direct.net(), tokens, options);
    Result<std::vector<int32_t>> b = generate(queued.net(), tokens, options);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(*a, *b);
  }
}

TEST(Generate, DecodeRefusesWhatItCannotRun) {
  FlatModel<LlamaModel> model(llama_config());
  model.init_weights(1);
  std::vector<float> logits(53);
  const int32_t tokens[3] = {1, 2, 3};
  EXPECT_EQ(model.net().decode(tokens, 1, logits.data()).code(), StatusCode::kInvalidArgument);  // no sequence
  ASSERT_TRUE(model.net().begin_sequence(3, 2).ok());
  EXPECT_EQ(model.net().decode(tokens, 3, logits.data()).code(), StatusCode::kInvalidArgument);  // chunk of 2
  const int32_t outside = 53;
  EXPECT_EQ(model.net().decode(&outside, 1, logits.data()).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(model.net().decode(tokens, 2, logits.data()).ok());
  ASSERT_TRUE(model.net().decode(tokens + 2, 1, logits.data()).ok());
  EXPECT_EQ(model.net().decode(tokens, 1, logits.data()).code(), StatusCode::kInvalidArgument);  // full
  EXPECT_EQ(model.net().begin_sequence(0, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(model.net().begin_sequence(4, 5).code(), StatusCode::kInvalidArgument);

  nlohmann::json windowed = llama_config().to_json();
  windowed["architectures"] = {"MistralForCausalLM"};
  windowed["sliding_window"] = 8;
  FlatModel<LlamaModel> mistral(config_from(windowed));
  EXPECT_EQ(mistral.net().begin_sequence(9, 1).code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(mistral.net().begin_sequence(8, 1).ok());
}

// ---- parity with transformers' generate ---------------------------------------------------------

void expect_greedy_parity(const std::string& variant) {
  if (!python_can_import("transformers")) {
    GTEST_SKIP() << kReferencePython << " cannot import transformers; the generation parity test needs it";
  }
  const std::string dir = run_reference("reference_generate.py", "model_generate", variant);
  ASSERT_FALSE(::testing::Test::HasFailure());
  Result<ModelConfig> config = ModelConfig::from_file(dir + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  FlatModel<LlamaModel> model(*config);
  Status loaded = model.load_safetensors(dir + "/model.safetensors");
  ASSERT_TRUE(loaded.ok()) << loaded.to_string();
  std::ifstream file(dir + "/reference.json");
  const nlohmann::json ref = nlohmann::json::parse(file, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(ref.is_discarded()) << "cannot parse " << dir << "/reference.json";
  const std::vector<int32_t> prompt = ref["prompt"].get<std::vector<int32_t>>();
  const std::vector<int32_t> expected = ref["generated"].get<std::vector<int32_t>>();
  const std::vector<std::vector<float>> scores = ref["scores"].get<std::vector<std::vector<float>>>();
  ASSERT_EQ(scores.size(), expected.size());

  // Greedy generation, streamed.
  GenerateOptions options;
  options.max_new_tokens = static_cast<int64_t>(expected.size());
  std::vector<int32_t> streamed;
  Result<std::vector<int32_t>> got = generate(model.net(), prompt, options, [&](int32_t t) {
    streamed.push_back(t);
    return true;
  });
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(*got, expected);
  EXPECT_EQ(streamed, expected);

  // The logits each token was chosen from, step by step along transformers' sequence.
  std::vector<int32_t> sequence = prompt;
  sequence.insert(sequence.end(), expected.begin(), expected.end() - 1);
  const std::vector<std::vector<float>> cached =
      cached_logits(model.net(), sequence, static_cast<int64_t>(prompt.size()));
  ASSERT_EQ(cached.size(), scores.size());
  for (size_t i = 0; i < scores.size(); ++i)
    EXPECT_WITHIN(testing::relative_error(cached[i], scores[i]), 1e-5) << " new token " << i;
}

TEST(GenerateParity, GreedyDecodingEqualsTransformersGenerateLlama) { expect_greedy_parity("llama"); }
TEST(GenerateParity, GreedyDecodingEqualsTransformersGenerateMixtral) { expect_greedy_parity("mixtral"); }
TEST(GenerateParity, GreedyDecodingEqualsTransformersGenerateQwen2Moe) { expect_greedy_parity("qwen2_moe"); }

// ---- sampling -----------------------------------------------------------------------------------

TEST(Sampler, GreedyTakesTheFirstHighestLogit) {
  Sampler greedy(SamplingOptions{});
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(greedy.next(logits), 1);
}

TEST(Sampler, TheSameSeedDrawsTheSameTokensAndTheFrequenciesFollowTheSoftmax) {
  SamplingOptions o;
  o.temperature = 1.0;
  o.seed = 42;
  // Probabilities 0.5, 0.3, 0.2.
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  Sampler a(o), b(o);
  std::vector<int> counts(3, 0);
  constexpr int kDraws = 20000;
  for (int i = 0; i < kDraws; ++i) {
    const int32_t t = a.next(logits);
    ASSERT_EQ(t, b.next(logits));
    ++counts[static_cast<size_t>(t)];
  }
  // Binomial standard deviation at most sqrt(0.25 / 20000) = 0.0035; 5 of them.
  EXPECT_NEAR(counts[0] / double(kDraws), 0.5, 0.018);
  EXPECT_NEAR(counts[1] / double(kDraws), 0.3, 0.018);
  EXPECT_NEAR(counts[2] / double(kDraws), 0.2, 0.018);
  o.seed = 43;
  Sampler c(o), d(SamplingOptions{1.0, 1.0, 42});
  int differ = 0;
  for (int i = 0; i < 64; ++i) differ += c.next(logits) != d.next(logits) ? 1 : 0;
  EXPECT_GT(differ, 0) << "another seed draws another sequence";
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
  const std::vector<float> logits = {std::log(0.1f), std::log(0.6f), std::log(0.3f)};
  SamplingOptions o;
  o.temperature = 1.0;
  o.top_p = 0.5;  // token 1 alone reaches it
  Sampler only_top(o);
  for (int i = 0; i < 200; ++i) ASSERT_EQ(only_top.next(logits), 1);
  o.top_p = 0.8;  // tokens 1 and 2 (0.9): never token 0
  Sampler two(o);
  std::vector<int> counts(3, 0);
  for (int i = 0; i < 2000; ++i) ++counts[static_cast<size_t>(two.next(logits))];
  EXPECT_EQ(counts[0], 0);
  EXPECT_GT(counts[1], counts[2]);
  EXPECT_GT(counts[2], 0);
}

TEST(Sampler, OptionsOutsideTheirRangesAreRefused) {
  EXPECT_FALSE(check_sampling_options({-0.5, 1.0, 0}).ok());
  EXPECT_FALSE(check_sampling_options({NAN, 1.0, 0}).ok());
  EXPECT_FALSE(check_sampling_options({1.0, 0.0, 0}).ok());
  EXPECT_FALSE(check_sampling_options({1.0, 1.5, 0}).ok());
  EXPECT_TRUE(check_sampling_options({0.7, 0.9, 0}).ok());
}

}  // namespace
}  // namespace strata::model
