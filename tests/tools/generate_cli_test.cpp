// strata generate: from a Hugging Face directory, a run directory and a checkpoint; the text it
// streams is the one model::generate gives in-process (greedy), a --seed repeats a sampled text
// and another seed changes it, --chat renders the template; weights paged through small device
// and host budgets and nvme give the same text; a LoRA run generates as its merged export does;
// bad inputs are refused by name.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/flat_access.h"
#include "model/generate.h"
#include "model/hf_io.h"
#include "model/params.h"
#include "tools/cli_util.h"
#include "train/paged_weights.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::CmdResult;
using testing::run_strata;

const fs::path kTokenizer = fs::path(STRATA_SOURCE_DIR) / "tests" / "fixtures" / "tokenizer" / "qwen2";

class GenerateCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::fresh_test_dir("generate_cli");
    config_.vocab_size = 640;  // the qwen2 fixture tokenizer's ids and a few more
    config_.hidden_size = 32;
    config_.intermediate_size = 48;
    config_.num_hidden_layers = 2;
    config_.num_attention_heads = 4;
    config_.num_key_value_heads = 2;
    config_.max_position_embeddings = 128;
    config_.fill_defaults();
    const model::ParamLayout layout(config_);
    params_.assign(static_cast<size_t>(layout.total_size()), 0.0f);
    // Weights 10 times init_weights' scale, so that the logits spread and greedy choices are clear.
    model::init_weights(layout, params_.data(), 5);
    for (float& p : params_) p *= 10.0f;
    model::ExportOptions eo;
    eo.copy_tokenizer_from = kTokenizer.string();
    hf_ = dir_ / "hf";
    Status st = model::export_hf(hf_.string(), config_, layout, params_.data(), eo);
    ASSERT_TRUE(st.ok()) << st.to_string();
  }

  // What model::generate gives in-process for the prompt, decoded.
  std::string expected_text(const std::string& prompt, const model::GenerateOptions& options) {
    Result<model::Tokenizer> tok = model::Tokenizer::load(kTokenizer.string());
    EXPECT_TRUE(tok.ok());
    model::EncodeOptions eo;
    eo.add_special_tokens = true;
    return expected_text(tok->encode(prompt, eo), options);
  }
  // The same for a conversation rendered with the generation prompt.
  std::string expected_chat_text(const nlohmann::ordered_json& messages, const model::GenerateOptions& options) {
    Result<model::Tokenizer> tok = model::Tokenizer::load(kTokenizer.string());
    EXPECT_TRUE(tok.ok());
    model::ChatRenderOptions ro;
    ro.add_generation_prompt = true;
    Result<std::string> text = tok->chat_template()->render(messages, ro);
    EXPECT_TRUE(text.ok()) << text.status().to_string();
    EXPECT_TRUE(text->ends_with("<|im_start|>assistant\n")) << *text;
    return expected_text(tok->encode(*text, model::EncodeOptions{.add_special_tokens = false}), options);
  }
  std::string expected_text(const std::vector<int32_t>& ids, const model::GenerateOptions& options) {
    Result<model::Tokenizer> tok = model::Tokenizer::load(kTokenizer.string());
    EXPECT_TRUE(tok.ok());
    std::unique_ptr<model::Model> net = model::make_cpu_decoder(DType::kF32, config_);
    model::FlatAccess access(DType::kF32, params_.data(), nullptr);
    net->set_access(&access);
    Result<std::vector<int32_t>> out = model::generate(*net, ids, options);
    net->set_access(nullptr);
    EXPECT_TRUE(out.ok()) << out.status().to_string();
    return tok->decode(*out);
  }

  // `strata train` from the exported model on a small text corpus (written here) into `run`.
  std::string train_args(const fs::path& run) {
    std::string text;
    for (int i = 0; i < 50; ++i) text += "hello world " + std::to_string(i % 5) + "\n";
    std::ofstream(dir_ / "corpus.txt") << text;
    return "train data.paths=[" + (dir_ / "corpus.txt").string() +
           "] train.micro_batch=2 train.seq_len=16 optim.warmup_steps=1 model.from=" + hf_.string() +
           " run.dir=" + run.string();
  }

  fs::path dir_, hf_;
  model::ModelConfig config_;
  std::vector<float> params_;
};

TEST_F(GenerateCliTest, GreedyTextIsTheLibrarysAndRepeats) {
  const std::string args = "generate --from " + hf_.string() + " --prompt 'hello world' --max-new-tokens 12 --ignore-eos";
  const CmdResult a = run_strata(args);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  model::GenerateOptions options;
  options.max_new_tokens = 12;
  const std::string text = expected_text("hello world", options);
  ASSERT_FALSE(text.empty());
  EXPECT_NE(a.output.find(text + "\n"), std::string::npos) << "expected the text '" << text << "' in:\n" << a.output;
  EXPECT_NE(a.output.find("12 new tokens"), std::string::npos) << a.output;
  const CmdResult b = run_strata(args);
  EXPECT_EQ(b.exit_code, 0);
  EXPECT_NE(b.output.find(text + "\n"), std::string::npos) << b.output;
  // The bf16 recipe runs too.
  const CmdResult bf16 = run_strata(args + " --precision bf16");
  EXPECT_EQ(bf16.exit_code, 0) << bf16.output;
  // Without --max-new-tokens: 128 at most, here what the context of 128 positions leaves.
  Result<model::Tokenizer> tok = model::Tokenizer::load(kTokenizer.string());
  ASSERT_TRUE(tok.ok());
  const int64_t P = static_cast<int64_t>(tok->encode("hello world", model::EncodeOptions{.add_special_tokens = true}).size());
  const CmdResult all = run_strata("generate --from " + hf_.string() + " --prompt 'hello world' --ignore-eos");
  EXPECT_EQ(all.exit_code, 0) << all.output;
  EXPECT_NE(all.output.find(std::to_string(128 - P + 1) + " new tokens"), std::string::npos) << all.output;
}

TEST_F(GenerateCliTest, WeightsPagedThroughHostAndNvmeGiveTheSameText) {
  // The device holds the largest group alone, the host its staging slots: the rest is on nvme,
  // in a directory generate makes.
  PagedWeightsOptions po;
  po.device_bytes = 1ull << 30;
  Result<WeightsPlacement> roomy = place_weights(model::ParamLayout(config_), po);
  ASSERT_TRUE(roomy.ok()) << roomy.status().to_string();
  uint64_t largest = 0;
  for (uint64_t n : roomy->chunks) largest = std::max(largest, n);
  const uint64_t chunk = roomy->chunk_bytes;
  const std::string budgets = " memory.device=" + std::to_string(largest * chunk) +
                              " memory.host=" + std::to_string((3 + largest) * chunk) +
                              " memory.nvme.path=" + (dir_ / "nvme" / "weights").string() + " memory.nvme.size=64MiB";
  const std::string args = "generate --from " + hf_.string() + " --prompt 'hello world' --max-new-tokens 12 --ignore-eos";
  model::GenerateOptions options;
  options.max_new_tokens = 12;
  const std::string text = expected_text("hello world", options);
  const CmdResult paged = run_strata(args + budgets);
  ASSERT_EQ(paged.exit_code, 0) << paged.output;
  EXPECT_NE(paged.output.find(text + "\n"), std::string::npos) << "expected the text '" << text << "' in:\n" << paged.output;
  EXPECT_NE(paged.output.find("weights paged"), std::string::npos) << paged.output;
  EXPECT_EQ(paged.output.find(" 0 on nvme"), std::string::npos) << paged.output;
  // A device budget below the largest group names the key to raise.
  const CmdResult small = run_strata(args + " memory.device=" + std::to_string(largest * chunk - 1));
  EXPECT_EQ(small.exit_code, 1) << small.output;
  EXPECT_NE(small.output.find("raise memory.device"), std::string::npos) << small.output;
}

TEST_F(GenerateCliTest, ASeedRepeatsASampledTextAndAnotherChangesIt) {
  const std::string args = "generate --from " + hf_.string() +
                           " --prompt 'once upon a time' --max-new-tokens 16 --ignore-eos --temperature 1.5 --top-p 0.95";
  model::GenerateOptions options;
  options.max_new_tokens = 16;
  options.sampling = {1.5, 0.95, 7};
  const std::string seven = expected_text("once upon a time", options);
  options.sampling.seed = 8;
  const std::string eight = expected_text("once upon a time", options);
  ASSERT_NE(seven, eight) << "two seeds drew the same 16 tokens";
  const CmdResult a = run_strata(args + " --seed 7");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_NE(a.output.find(seven + "\n"), std::string::npos) << a.output;
  const CmdResult b = run_strata(args + " --seed 8");
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find(eight + "\n"), std::string::npos) << b.output;
}

TEST_F(GenerateCliTest, ChatRendersTheTemplateWithTheGenerationPrompt) {
  const fs::path chat = dir_ / "chat.json";
  const std::string conversation =
      R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])";
  std::ofstream(chat) << conversation;
  const CmdResult r =
      run_strata("generate --from " + hf_.string() + " --chat " + chat.string() + " --max-new-tokens 6 --ignore-eos");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  model::GenerateOptions options;
  options.max_new_tokens = 6;
  const std::string text = expected_chat_text(nlohmann::ordered_json::parse(conversation), options);
  EXPECT_NE(r.output.find(text + "\n"), std::string::npos) << "expected '" << text << "' in:\n" << r.output;
  // The ShareGPT shape is read as data tokenize reads it; a conversation ending with the
  // assistant has nothing to answer.
  std::ofstream(chat) << R"({"conversations": [{"from": "human", "value": "Hi"}]})";
  EXPECT_EQ(run_strata("generate --from " + hf_.string() + " --chat " + chat.string() + " --max-new-tokens 2").exit_code,
            0);
  std::ofstream(chat) << R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])";
  const CmdResult done = run_strata("generate --from " + hf_.string() + " --chat " + chat.string());
  EXPECT_EQ(done.exit_code, 1);
  EXPECT_NE(done.output.find("ends with an assistant turn"), std::string::npos) << done.output;
}

TEST_F(GenerateCliTest, RunDirectoriesAndCheckpointsUseTheRunsTokenizer) {
  const fs::path run = dir_ / "run";
  CmdResult r = run_strata(train_args(run) + " train.steps=2 ckpt.every=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const fs::path& from : {run, run / "checkpoints", run / "checkpoints" / "step-2"}) {
    r = run_strata("generate --from " + from.string() + " --prompt hello --max-new-tokens 3");
    EXPECT_EQ(r.exit_code, 0) << from << "\n" << r.output;
  }
  // A checkpoint outside any run needs --tokenizer, and says so.
  fs::copy(run / "checkpoints", dir_ / "loose", fs::copy_options::recursive);
  r = run_strata("generate --from " + (dir_ / "loose").string() + " --prompt hello");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("--tokenizer"), std::string::npos) << r.output;
  r = run_strata("generate --from " + (dir_ / "loose").string() + " --tokenizer " + kTokenizer.string() +
                 " --prompt hello --max-new-tokens 2");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// A LoRA run generates with its adapters over the base it took from model.from: greedily, the
// text of the merged export (`convert --merge`, W + (alpha / r) B A) and not the base's. The
// learning rate is high enough that four steps move the adapters past the base's greedy choices.
TEST_F(GenerateCliTest, ALoraRunGeneratesWithItsAdaptersAsItsMergedExportDoes) {
  const fs::path run = dir_ / "lora_run";
  CmdResult r = run_strata(train_args(run) +
                           " optim.lr=0.05 train.steps=4 ckpt.every=4 train.method=lora lora.rank=4 lora.alpha=32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path merged = dir_ / "lora_merged";
  r = run_strata("convert --merge --from " + (run / "checkpoints").string() + " --to " + merged.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The generated text: the lines between the log line that starts generating and the one that
  // counts the new tokens.
  const auto generated = [](const std::string& from) {
    const CmdResult g = run_strata("generate --from " + from + " --prompt 'hello world' --max-new-tokens 10 --ignore-eos");
    EXPECT_EQ(g.exit_code, 0) << g.output;
    const size_t starts = g.output.find("generating up to"), counted = g.output.find(" new tokens in");
    const size_t begin = starts == std::string::npos ? starts : g.output.find('\n', starts);
    const size_t end = counted == std::string::npos ? counted : g.output.rfind('\n', counted);
    const bool found = begin != std::string::npos && end != std::string::npos && begin < end;
    EXPECT_TRUE(found) << g.output;
    return found ? g.output.substr(begin + 1, end - begin - 1) : std::string();
  };
  const std::string from_run = generated(run.string());
  ASSERT_FALSE(from_run.empty());
  EXPECT_EQ(from_run, generated(merged.string() + " --tokenizer " + kTokenizer.string()));
  EXPECT_NE(from_run, generated(hf_.string())) << "the adapters changed no greedy choice";
}

TEST_F(GenerateCliTest, BadInputsAreRefusedByName) {
  const std::string from = " --from " + hf_.string();
  struct Case {
    std::string args;
    int code;
    std::string says;
  };
  const std::vector<Case> cases = {
      {" --prompt hi", 2, "--from is required"},
      {from, 2, "exactly one of --prompt"},
      {from + " --prompt hi --chat x.json", 2, "exactly one of --prompt"},
      {from + " --prompt hi --temperature -1", 2, "--temperature"},
      {from + " --prompt hi --top-p 0", 2, "--top-p"},
      {from + " --prompt hi --max-new-tokens 0", 2, "--max-new-tokens"},
      {from + " --prompt hi --seed x", 2, "--seed"},
      {from + " --prompt hi --device tpu", 2, "--device"},
      {from + " --prompt hi --bogus 1", 2, "unknown option"},
      {from + " --prompt hi memory.hots=1GiB", 2, "unknown key 'memory.hots'"},
      {from + " --prompt hi memory.device=lots", 2, "memory.device is 'lots'"},
      {from + " --prompt hi memory.host=1GiB", 2, "give memory.device too"},
      {from + " --prompt hi memory.device=1GiB memory.nvme.size=1GiB", 2, "memory.nvme.path=DIR"},
      {from + " --prompt hi --precision fp16", 2, "--precision"},
      {" --from " + (dir_ / "nowhere").string() + " --prompt hi", 1, "not a Hugging Face directory"},
      {from + " --prompt hi --max-new-tokens 500", 1, "max_position_embeddings"},
      {from + " --chat " + (dir_ / "missing.json").string(), 1, "missing.json"},
      {from + " --prompt hi --tokenizer " + dir_.string(), 1, "--tokenizer"},
  };
  for (const Case& c : cases) {
    const CmdResult r = run_strata("generate" + c.args);
    EXPECT_EQ(r.exit_code, c.code) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.args << "\n" << r.output;
  }
  // A Hugging Face directory without a tokenizer asks for one.
  fs::remove(hf_ / "tokenizer.json");
  const CmdResult r = run_strata("generate" + from + " --prompt hi");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("pass --tokenizer DIR"), std::string::npos) << r.output;
  const CmdResult help = run_strata("generate --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("Usage: strata generate"), std::string::npos);
  EXPECT_NE(help.output.find("--top-p"), std::string::npos);
}

}  // namespace
}  // namespace strata
