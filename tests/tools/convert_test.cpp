// `strata convert` rewrites a Hugging Face directory with another dtype or shard size and names
// what is wrong with other inputs; `strata train model.from=... run.export=...` starts from a
// Hugging Face directory and exports one.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/hf_io.h"
#include "model/params.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

struct CmdResult {
  int exit_code = -1;
  std::string output;
};

CmdResult run_strata(const std::string& args) {
  const std::string cmd = std::string(STRATA_BINARY_DIR) + "/strata " + args + " 2>&1";
  CmdResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

class ConvertTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("strata_convert_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(ConvertTest, HelpAndUsageErrors) {
  CmdResult help = run_strata("convert --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("--shard-size"), std::string::npos);
  CmdResult missing = run_strata("convert --from " + dir_.string());
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  CmdResult dtype = run_strata("convert --from a --to b --dtype f8");
  EXPECT_EQ(dtype.exit_code, 2) << dtype.output;
}

TEST_F(ConvertTest, OtherInputsAreNotAHuggingFaceDirectory) {
  const fs::path file = dir_ / "weights.bin";
  std::ofstream(file) << "x";
  CmdResult r = run_strata("convert --from " + file.string() + " --to " + (dir_ / "out").string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("not a Hugging Face directory (no config.json)"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "out"));
}

TEST_F(ConvertTest, ReshardsToBf16AndKeepsTokenizerFiles) {
  ModelConfig config;
  config.vocab_size = 32;
  config.hidden_size = 16;
  config.intermediate_size = 24;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 2;
  config.max_position_embeddings = 16;
  config.fill_defaults();
  const ParamLayout layout(config);
  std::vector<float> params(static_cast<size_t>(layout.total_size()), 0.0f);
  init_weights(layout, params.data(), 3);
  const fs::path src = dir_ / "src";
  ASSERT_TRUE(export_hf(src.string(), config, layout, params.data()).ok());
  std::ofstream(src / "tokenizer.json") << R"({"model": {}})";

  const fs::path dst = dir_ / "dst";
  CmdResult r = run_strata("convert --from " + src.string() + " --to " + dst.string() + " --dtype bf16 --shard-size 2KB");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dst / "model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(dst / "tokenizer.json"));
  std::ifstream in(dst / "config.json");
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  EXPECT_EQ(j["torch_dtype"], "bfloat16");

  std::vector<float> loaded(params.size(), 0.0f);
  Status st = load_hf_weights(dst.string(), layout, loaded.data());
  ASSERT_TRUE(st.ok()) << st.to_string();
  for (const TensorSpec& t : layout.tensors()) {
    for (int64_t i = 0; i < t.numel; ++i) {
      ASSERT_EQ(loaded[t.offset + i], bf16_to_f32(f32_to_bf16(params[t.offset + i]))) << t.name << "[" << i << "]";
    }
  }
  // An existing non-empty target is refused.
  CmdResult again = run_strata("convert --from " + src.string() + " --to " + dst.string());
  EXPECT_EQ(again.exit_code, 1) << again.output;
}

TEST_F(ConvertTest, TrainStartsFromHuggingFaceDirectoryAndExportsOne) {
  ModelConfig config;
  config.vocab_size = 256;
  config.hidden_size = 16;
  config.intermediate_size = 24;
  config.num_hidden_layers = 1;
  config.num_attention_heads = 2;
  config.max_position_embeddings = 64;
  config.fill_defaults();
  const ParamLayout layout(config);
  std::vector<float> params(static_cast<size_t>(layout.total_size()), 0.0f);
  init_weights(layout, params.data(), 9);
  const fs::path src = dir_ / "src";
  ASSERT_TRUE(export_hf(src.string(), config, layout, params.data()).ok());
  std::ofstream(src / "tokenizer_config.json") << R"({"model_max_length": 64})";
  std::string text;
  for (int i = 0; i < 100; ++i) text += "hello hugging face " + std::to_string(i % 5) + "\n";
  std::ofstream(dir_ / "corpus.txt") << text;

  const fs::path out = dir_ / "export";
  const std::string run = "data.paths=[" + (dir_ / "corpus.txt").string() + "] run.dir=" + (dir_ / "run").string() +
                          " train.micro_batch=2 train.seq_len=16 train.steps=3 optim.warmup_steps=1 model.from=" +
                          src.string() + " run.export=" + out.string();
  CmdResult r = run_strata("train " + run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(out / "tokenizer_config.json"));
  Result<ModelConfig> back = load_hf_config(out.string());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->to_json(), config.to_json());
  std::vector<float> trained(params.size(), 0.0f);
  Status st = load_hf_weights(out.string(), layout, trained.data());
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_FALSE(trained == params) << "the export holds the initial weights, not the trained ones";

  // model.from with model.init is a configuration error.
  CmdResult both = run_strata("train " + run + " model.init=" + (src / "model.safetensors").string());
  EXPECT_EQ(both.exit_code, 1) << both.output;
  EXPECT_NE(both.output.find("model.from"), std::string::npos) << both.output;
}

}  // namespace
}  // namespace strata::model
