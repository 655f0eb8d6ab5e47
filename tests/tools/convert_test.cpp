// `strata convert` rewrites a Hugging Face directory with another dtype or shard size, exports a
// strata checkpoint as one, and names what is wrong with other inputs; `strata train model.from=... run.export=...` starts from a
// Hugging Face directory and exports one.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/hf_io.h"
#include "model/params.h"
#include "model/safetensors.h"

#include "tools/cli_util.h"
#include "test_util.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

using strata::testing::CmdResult;
using strata::testing::run_strata;

class ConvertTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::testing::fresh_test_dir("strata_convert");
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
  EXPECT_NE(r.output.find("checkpoint"), std::string::npos) << r.output;
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

using strata::testing::read_json;

// The dtype of every tensor of a Hugging Face directory; "" when they differ.
std::string weights_dtype(const fs::path& dir) {
  Result<SafetensorsReader> r = SafetensorsReader::open(dir.string());
  if (!r.ok()) return r.status().to_string();
  std::string dtype = r->tensors().at(0).dtype;
  for (const SafetensorsTensorInfo& t : r->tensors()) {
    if (t.dtype != dtype) return "";
  }
  return dtype;
}

TEST_F(ConvertTest, ExportsKeepTheSourcesDtypeUnlessToldOtherwise) {
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
  const fs::path src = dir_ / "src";  // a bf16 model, as most on the Hub
  ExportOptions bf16;
  bf16.dtype = SafetensorsWriteDtype::kBF16;
  ASSERT_TRUE(export_hf(src.string(), config, layout, params.data(), bf16).ok());
  std::string text;
  for (int i = 0; i < 100; ++i) text += "hello hugging face " + std::to_string(i % 5) + "\n";
  std::ofstream(dir_ / "corpus.txt") << text;
  const std::string common = "data.paths=[" + (dir_ / "corpus.txt").string() +
                             "] train.micro_batch=2 train.seq_len=16 optim.warmup_steps=1 ";

  // train: a bf16 source exports bf16 by default; its checkpoints remember the source's dtype.
  const fs::path out = dir_ / "export";
  CmdResult r = run_strata("train " + common + "train.steps=2 ckpt.every=2 model.from=" + src.string() +
                           " run.dir=" + (dir_ / "run").string() + " run.export=" + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_json(out / "config.json")["torch_dtype"], "bfloat16");
  EXPECT_EQ(weights_dtype(out), "BF16");
  EXPECT_EQ(fs::file_size(out / "model.safetensors"), fs::file_size(src / "model.safetensors"));
  const fs::path ckpt = dir_ / "run" / "checkpoints";
  EXPECT_EQ(read_json(ckpt / "step-2" / "manifest.json")["model_config"]["torch_dtype"], "bfloat16");
  // A run this fast prints no progress lines (stderr is not a terminal here: no \r either).
  EXPECT_EQ(r.output.find("loading weights"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find('\r'), std::string::npos) << r.output;

  // run.export_dtype overrides.
  const fs::path out_f32 = dir_ / "export_f32";
  r = run_strata("train " + common + "train.steps=1 model.from=" + src.string() + " run.dir=" +
                 (dir_ / "run_f32").string() + " run.export=" + out_f32.string() + " run.export_dtype=f32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_json(out_f32 / "config.json")["torch_dtype"], "float32");
  EXPECT_EQ(weights_dtype(out_f32), "F32");

  // A run resumed without model.from still knows the source's dtype, from the checkpoint.
  const fs::path resumed = dir_ / "export_resumed";
  r = run_strata("train " + common + "train.steps=3 ckpt.every=2 model.config=" + (src / "config.json").string() +
                 " run.dir=" + (dir_ / "run").string() + " run.export=" + resumed.string() + " --resume auto");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_json(resumed / "config.json")["torch_dtype"], "bfloat16");
  EXPECT_EQ(weights_dtype(resumed), "BF16");

  // convert: a checkpoint exports in its source's dtype; --dtype overrides, f16 included.
  const fs::path converted = dir_ / "converted";
  r = run_strata("convert --from " + ckpt.string() + " --to " + converted.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(weights_dtype(converted), "BF16");
  const fs::path half = dir_ / "half";
  r = run_strata("convert --from " + src.string() + " --to " + half.string() + " --dtype f16");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_json(half / "config.json")["torch_dtype"], "float16");
  EXPECT_EQ(weights_dtype(half), "F16");
  // ... and an f16 model stays f16.
  const fs::path half_again = dir_ / "half_again";
  r = run_strata("convert --from " + half.string() + " --to " + half_again.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(weights_dtype(half_again), "F16");
  EXPECT_EQ(read_json(half_again / "config.json")["torch_dtype"], "float16");
}


// Compares every tensor of the Hugging Face directories `a` and `b` (same names, shapes, F32):
// bitwise equal when expect_equal, otherwise at least one tensor must differ.
void expect_same_tensors(const fs::path& a, const fs::path& b, bool expect_equal) {
  Result<SafetensorsReader> ra = SafetensorsReader::open(a.string());
  ASSERT_TRUE(ra.ok()) << ra.status().to_string();
  Result<SafetensorsReader> rb = SafetensorsReader::open(b.string());
  ASSERT_TRUE(rb.ok()) << rb.status().to_string();
  ASSERT_EQ(ra->tensors().size(), rb->tensors().size());
  bool all_equal = true;
  for (size_t i = 0; i < ra->tensors().size(); ++i) {
    const SafetensorsTensorInfo& ta = ra->tensors()[i];
    const SafetensorsTensorInfo& tb = rb->tensors()[i];
    ASSERT_EQ(ta.name, tb.name);
    ASSERT_EQ(ta.shape, tb.shape) << ta.name;
    EXPECT_EQ(ta.dtype, "F32") << ta.name;
    EXPECT_EQ(tb.dtype, "F32") << tb.name;
    std::vector<float> va(static_cast<size_t>(ta.numel)), vb(static_cast<size_t>(tb.numel));
    ASSERT_TRUE(ra->read_f32(ta.name, va.data()).ok()) << ta.name;
    ASSERT_TRUE(rb->read_f32(tb.name, vb.data()).ok()) << tb.name;
    const bool same = std::memcmp(va.data(), vb.data(), va.size() * sizeof(float)) == 0;
    if (expect_equal) {
      EXPECT_TRUE(same) << ta.name << " differs between " << a << " and " << b;
    }
    all_equal = all_equal && same;
  }
  if (!expect_equal) {
    EXPECT_FALSE(all_equal) << a << " and " << b << " hold the same weights";
  }
}

TEST_F(ConvertTest, ExportsAStrataCheckpoint) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "the checkpoint converts to a model " + std::to_string(i % 7) + "\n";
  std::ofstream(dir_ / "corpus.txt") << text;
  const fs::path run = dir_ / "run";
  const fs::path exported = dir_ / "export";
  CmdResult train = run_strata("train data.paths=[" + (dir_ / "corpus.txt").string() +
                               "] train.micro_batch=2 train.seq_len=32 train.steps=4 optim.warmup_steps=1"
                               " 'model.set=[num_hidden_layers=2,hidden_size=64,intermediate_size=96]' run.dir=" +
                               run.string() + " ckpt.every=2 run.export=" + exported.string());
  ASSERT_EQ(train.exit_code, 0) << train.output;
  const fs::path ckpts = run / "checkpoints";
  ASSERT_TRUE(fs::exists(ckpts / "latest"));
  ASSERT_TRUE(fs::exists(ckpts / "step-2" / "manifest.json"));

  // The latest checkpoint holds the final weights, which run.export wrote too (both fp32).
  const fs::path out = dir_ / "out";
  CmdResult r = run_strata("convert --from " + ckpts.string() + " --to " + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(out / "config.json"));
  Result<ModelConfig> back = load_hf_config(out.string());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  Result<ModelConfig> trained = load_hf_config(exported.string());
  ASSERT_TRUE(trained.ok()) << trained.status().to_string();
  EXPECT_EQ(back->to_json(), trained->to_json());
  expect_same_tensors(out, exported, /*expect_equal=*/true);

  // DIR/latest names the same checkpoint.
  const fs::path via_latest = dir_ / "via_latest";
  r = run_strata("convert --from " + (ckpts / "latest").string() + " --to " + via_latest.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_tensors(via_latest, exported, /*expect_equal=*/true);

  // A specific step: the weights after step 2, not the final ones; bf16 on request.
  const fs::path step2 = dir_ / "step2";
  r = run_strata("convert --from " + (ckpts / "step-2").string() + " --to " + step2.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(step2 / "config.json"));
  expect_same_tensors(step2, exported, /*expect_equal=*/false);
  const fs::path step2_bf16 = dir_ / "step2_bf16";
  r = run_strata("convert --from " + (ckpts / "step-2").string() + " --to " + step2_bf16.string() + " --dtype bf16");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  {
    std::ifstream in(step2_bf16 / "config.json");
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    EXPECT_EQ(j["torch_dtype"], "bfloat16");
  }

  // transformers loads the converted directory, when it is installed.
  if (std::system("/usr/bin/python3 -c 'import torch, transformers' >/dev/null 2>&1") == 0) {
    const std::string cmd = "/usr/bin/python3 -c 'import sys; from transformers import AutoModelForCausalLM; "
                            "AutoModelForCausalLM.from_pretrained(sys.argv[1])' " + out.string() + " 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << "transformers could not load " << out;
  }

  // A checkpoint whose manifest lacks model_config is refused, naming the manifest.
  const fs::path bare = dir_ / "bare" / "step-2";
  fs::create_directories(bare.parent_path());
  fs::copy(ckpts / "step-2", bare, fs::copy_options::recursive);
  nlohmann::json manifest;
  {
    std::ifstream in(bare / "manifest.json");
    manifest = nlohmann::json::parse(in, nullptr, false);
  }
  ASSERT_TRUE(manifest.is_object());
  manifest.erase("model_config");
  std::ofstream(bare / "manifest.json", std::ios::trunc) << manifest.dump(2);
  r = run_strata("convert --from " + bare.string() + " --to " + (dir_ / "bare_out").string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find((bare / "manifest.json").string()), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("model_config"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "bare_out"));

  // A model_config far larger than the saved tensors (8 TiB of fp32 parameters) is refused by
  // comparing it with the checkpoint's tensors before the model's memory is allocated.
  const fs::path huge = dir_ / "huge" / "step-2";
  fs::create_directories(huge.parent_path());
  fs::copy(ckpts / "step-2", huge, fs::copy_options::recursive);
  {
    std::ifstream in(huge / "manifest.json");
    manifest = nlohmann::json::parse(in, nullptr, false);
  }
  ASSERT_TRUE(manifest.is_object());
  manifest["model_config"]["vocab_size"] = 1 << 24;
  manifest["model_config"]["hidden_size"] = 1 << 16;
  manifest["model_config"]["num_attention_heads"] = 64;
  manifest["model_config"]["num_key_value_heads"] = 8;
  std::ofstream(huge / "manifest.json", std::ios::trunc) << manifest.dump(2);
  r = run_strata("convert --from " + huge.string() + " --to " + (dir_ / "huge_out").string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("model.embed_tokens.weight"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find((huge / "manifest.json").string()), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "huge_out"));
}

// The source's tensors are checked before the model's memory is allocated: a config.json of an
// 8 TiB model beside no weights names the missing weights instead of failing to allocate.
TEST_F(ConvertTest, MissingWeightsAreNamedBeforeTheModelIsAllocated) {
  const fs::path src = dir_ / "src";
  fs::create_directories(src);
  std::ofstream(src / "config.json") << R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 16777216, "hidden_size": 65536, "intermediate_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 10000.0})";
  CmdResult r = run_strata("convert --from " + src.string() + " --to " + (dir_ / "out").string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(src.string()), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("safetensors"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "out"));
}

}  // namespace
}  // namespace strata::model
