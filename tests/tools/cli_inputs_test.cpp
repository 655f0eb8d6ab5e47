// Hostile inputs to `strata plan` and `strata train`: absurd model dimensions, unknown model.set
// keys, malformed YAML and a directory given as the config each fail at once, exit 1, with one
// error line naming the key or file and line.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/token_files.h"
#include "data/tokenize.h"
#include "tools/cli_util.h"

namespace {

namespace fs = std::filesystem;

using strata::testing::CmdResult;
using strata::testing::run_strata;

// Exit 1 with exactly one error line that holds every one of `words`.
void expect_refused(const CmdResult& r, const std::vector<std::string>& words) {
  EXPECT_EQ(r.exit_code, 1) << r.output;
  int error_lines = 0;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) error_lines += line.find("error:") != std::string::npos;
  EXPECT_EQ(error_lines, 1) << r.output;
  for (const std::string& w : words) EXPECT_NE(r.output.find(w), std::string::npos) << "missing '" << w << "' in:\n" << r.output;
}

class CliInputsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::testing::fresh_test_dir("strata_cli_inputs");
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write_file(const std::string& name, const std::string& content) {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary) << content;
    return p.string();
  }
  fs::path dir_;
};

// These used to end in bad_alloc, exhaust memory or hang, or print a wrapped parameter count.
TEST_F(CliInputsTest, PlanRefusesAbsurdModelDimensionsNamingKeyValueAndLimit) {
  struct Case {
    std::string set;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"hidden_size=1e15", {"'hidden_size'", "1000000000000000", "65536"}},
      {"vocab_size=10000000000", {"'vocab_size'", "10000000000", "16777216"}},
      {"num_hidden_layers=1000000000", {"'num_hidden_layers'", "1000000000", "1024"}},
      {"num_hidden_layers=4294967296", {"'num_hidden_layers'", "4294967296", "1024"}},
      {"intermediate_size=4e12", {"'intermediate_size'", "4000000000000", "1048576"}},
      {"hidden_size=18446744073709551615", {"'hidden_size'", "18446744073709551615", "65536"}},
      {"architectures=MixtralForCausalLM,num_local_experts=100000000", {"'num_local_experts'", "100000000", "4096"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.set);
    expect_refused(run_strata("plan run.device=cpu 'model.set=[" + c.set + "]'"), c.words);
  }
}

TEST_F(CliInputsTest, PlanCountsAVeryLargeModelWithoutWrapping) {
  // 1000 layers of hidden 16384 and MLP 65536: 3.8 trillion parameters.
  CmdResult r = run_strata(
      "plan run.device=cuda memory.device=24GiB memory.host=100GiB "
      "'model.set=[hidden_size=16384,intermediate_size=65536,num_hidden_layers=1000,num_attention_heads=128,"
      "num_key_value_heads=8,vocab_size=128256]'");
  EXPECT_NE(r.output.find("1000 layers, hidden 16384, vocab 128256, 3.796T parameters"), std::string::npos) << r.output;
}

TEST_F(CliInputsTest, TokensPerStepAreBounded) {
  // Each key within its range; their product (2^64) used to wrap to 0 tokens per step.
  expect_refused(run_strata("plan run.device=cpu train.micro_batch=1048576 train.seq_len=16777216"),
                 {"train.micro_batch x train.seq_len", "17592186044416", "268435456"});
  expect_refused(run_strata("plan run.device=cpu train.micro_batch=16384 train.seq_len=16384 "
                            "train.grad_accum=1048576"),
                 {"train.grad_accum", "281474976710656", "1099511627776"});
}

// A checkpoint at step 2^63-1 cannot be continued: the next step does not exist (computing it
// used to overflow).
TEST_F(CliInputsTest, ResumeFromTheLastPossibleStepIsRefused) {
  std::string text;
  for (int i = 0; i < 100; ++i) text += "the quick brown fox " + std::to_string(i) + "\n";
  const std::string corpus = write_file("corpus.txt", text);
  const std::string run_dir = (dir_ / "run").string();
  const std::string args = "data.paths=[" + corpus + "] run.dir=" + run_dir +
                           " train.micro_batch=2 train.seq_len=16 train.steps=2 optim.warmup_steps=1 ckpt.every=2"
                           " 'model.set=[num_hidden_layers=1,hidden_size=32,intermediate_size=48]'";
  CmdResult first = run_strata("train " + args);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const fs::path manifest_path = fs::path(run_dir) / "checkpoints" / "step-2" / "manifest.json";
  nlohmann::json manifest;
  {
    std::ifstream in(manifest_path);
    manifest = nlohmann::json::parse(in, nullptr, false);
  }
  ASSERT_TRUE(manifest.is_object());
  manifest["step"] = INT64_MAX;
  std::ofstream(manifest_path, std::ios::trunc) << manifest.dump(2);
  expect_refused(run_strata("train " + args + " --resume auto"), {"9223372036854775807"});
}

TEST_F(CliInputsTest, UnknownModelSetKeyIsRefused) {
  expect_refused(run_strata("plan run.device=cpu 'model.set=[hiden_size=64]'"),
                 {"model.set", "'hiden_size'", "hidden_size"});
  const std::string model = write_file("config.json", R"({"architectures": ["LlamaForCausalLM"],
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
    "num_attention_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32"})");
  // A config.json may carry keys strata does not read (torch_dtype); model.set may not.
  CmdResult ok = run_strata("plan run.device=cpu memory.device=1GiB model.config=" + model);
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  expect_refused(run_strata("plan run.device=cpu model.config=" + model + " 'model.set=[torch_dtype=bfloat16]'"),
                 {"model.set", "'torch_dtype'"});
}

TEST_F(CliInputsTest, ModelConfigFileWithHugeIntegerNamesItAsWritten) {
  const std::string model = write_file("config.json", R"({"architectures": ["LlamaForCausalLM"],
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 18446744073709551615,
    "num_attention_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0})");
  const std::string run_dir = (dir_ / "run").string();
  expect_refused(run_strata("train model.config=" + model + " run.dir=" + run_dir),
                 {model, "'num_hidden_layers'", "18446744073709551615", "1024"});
  EXPECT_FALSE(fs::exists(run_dir));
}

TEST_F(CliInputsTest, ConfigPathThatIsADirectoryIsRefused) {
  const fs::path run_dir = dir_ / "run";
  expect_refused(run_strata("train " + dir_.string() + " run.dir=" + run_dir.string()),
                 {dir_.string(), "is a directory"});
  EXPECT_FALSE(fs::exists(run_dir));
  expect_refused(run_strata("plan " + dir_.string()), {dir_.string(), "is a directory"});
}

TEST_F(CliInputsTest, MalformedYamlKeysNameFileAndLine) {
  const std::string list_key = write_file("list_key.yaml", "train:\n  steps: 3\n? [a, b]\n: 1\n");
  expect_refused(run_strata("plan " + list_key), {list_key + ":3", "plain word"});
  const std::string twice = write_file("twice.yaml", "train:\n  steps: 3\n  steps: 4\n");
  expect_refused(run_strata("plan " + twice), {twice + ":3", "'train.steps' is set twice", twice + ":2"});
}

// A loss mask of zeros leaves nothing to predict: the run stops at its first step, naming the
// file and the position, instead of training on nothing and exiting 0 (loss 0.0000, gnorm 0).
// data.allow_empty_loss=true trains such steps.
TEST_F(CliInputsTest, AnAllZeroLossMaskStopsTheRunNamingTheFile) {
  constexpr int32_t kTokens = 4096;
  std::vector<int32_t> header(256, 0);
  header[0] = strata::kLlmcMagicU16;
  header[1] = 1;
  header[2] = kTokens;
  fs::create_directories(dir_ / "masks");
  const fs::path shard = dir_ / "train_000000.bin";
  {
    std::ofstream out(shard, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
    for (int32_t t = 0; t < kTokens; ++t) {
      const uint16_t id = static_cast<uint16_t>(t % 200);
      out.write(reinterpret_cast<const char*>(&id), 2);
    }
  }
  header[0] = strata::kLossMaskMagic;
  {
    std::ofstream out(dir_ / "masks" / "train_000000.mask", std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
    for (int32_t t = 0; t < kTokens; ++t) out.put('\0');
  }
  const std::string args = "train data.paths=[" + shard.string() + "] train.steps=2 train.micro_batch=2 "
                           "train.seq_len=64 optim.warmup_steps=0 run.dir=" + (dir_ / "run").string();
  expect_refused(run_strata(args), {"step 1", shard.string(), "no token to predict", "data.allow_empty_loss"});
  const CmdResult allowed = run_strata(args + "-allowed data.allow_empty_loss=true");
  EXPECT_EQ(allowed.exit_code, 0) << allowed.output;
}

// A 65,536-token vocabulary under the demo's 10 MiB host budget: loading the weights once took
// the whole embedding group through host memory and failed ("tier 'host' has no slot for chunk
// 53"); it now goes a chunk of each kind at a time, so the run trains. A host budget below even
// that is refused before anything loads, naming what the load needs.
TEST_F(CliInputsTest, AHostBudgetBelowWhatTheWeightsPassThroughIsRefusedBeforeLoading) {
  const std::string args = "model.set=[vocab_size=65536] train.steps=2 optim.warmup_steps=0 memory.device=400MiB "
                           "run.dir=" + (dir_ / "run").string();
  const CmdResult demo_host = run_strata("train " + args);
  EXPECT_EQ(demo_host.exit_code, 0) << demo_host.output;
  expect_refused(run_strata("train " + args + "-small memory.host=100KiB"),
                 {"memory.host", "while they load", "192.00 KiB"});
}

// Usage errors read like every other error: "strata CMD: error: ..." naming the command, exit 2.
TEST_F(CliInputsTest, UsageErrorsSayErrorAndNameTheCommand) {
  const std::pair<const char*, const char*> cases[] = {
      {"data tokenize", "strata data: error: --tokenizer is required"},
      {"data bogus", "strata data: error: unknown subcommand 'bogus'"},
      {"train --bogus", "strata train: error: unknown option '--bogus'"},
      {"plan --bogus", "strata plan: error: unexpected argument '--bogus'"},
      {"profile --bogus", "strata profile: error: unknown option '--bogus'"},
      {"bench queue --steps x", "strata bench queue: error: --steps needs a whole number"},
  };
  for (const auto& [args, want] : cases) {
    const CmdResult r = run_strata(args);
    EXPECT_EQ(r.exit_code, 2) << args << ":\n" << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << args << ":\n" << r.output;
  }
}

}  // namespace
