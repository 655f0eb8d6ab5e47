// DeepSeek-V3 through the CLI: `strata train model.from=DIR` on a tiny DeepseekV3ForCausalLM
// built by DeepSeek's published modeling code (tests/model/reference_deepseek.py), with a zero
// learning rate, exports the model it started from bit for bit (the routers'
// e_score_correction_bias included), and the published code loads the export with no missing or
// unexpected tensor and the same logits. `strata convert` does the same without training.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <vector>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "model/hf_io.h"
#include "model/reference_util.h"
#include "model/safetensors.h"
#include "tools/cli_util.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

using strata::testing::CmdResult;
using strata::testing::run_strata;

// reference_deepseek.py check SOURCE EXPORT: 0 when the published code loads EXPORT with the
// source's tensors and logits.
int published_code_check(const fs::path& source, const fs::path& exported) {
  const std::string cmd = std::string(kReferencePython) + " " + STRATA_SOURCE_DIR +
                          "/tests/model/reference_deepseek.py check " + source.string() + " " + exported.string() +
                          " >" + exported.string() + ".check.log 2>&1";
  return std::system(cmd.c_str());
}

TEST(DeepseekExportTest, ZeroLearningRateExportsTheStartingModelAndThePublishedCodeLoadsIt) {
  if (!python_can_import("transformers")) {
    GTEST_SKIP() << kReferencePython << " cannot import transformers; the DeepSeek export test needs it";
  }
  if (!reference_script_runs("reference_deepseek.py")) {
    GTEST_SKIP() << kReferencePython << " cannot import DeepSeek's published modeling code with its transformers "
                 << "(tests/model/reference_deepseek.py probe)";
  }
  const fs::path src = run_reference("reference_deepseek.py", "tools_deepseek_export", "deepseek_v3_bytes");
  ASSERT_FALSE(::testing::Test::HasFailure());
  // As the published repositories hold it: the modeling code beside the weights (config.json's
  // auto_map names it), which exports carry over.
  for (const char* file : {"configuration_deepseek.py", "modeling_deepseek.py"})
    fs::copy_file(fs::path(STRATA_SOURCE_DIR) / "tests/fixtures/deepseek/DeepSeek-V3" / file, src / file,
                  fs::copy_options::overwrite_existing);
  const fs::path dir = strata::testing::fresh_test_dir("strata_deepseek_export");
  std::string text;
  for (int i = 0; i < 200; ++i) text += "hello deep seek " + std::to_string(i % 5) + "\n";
  std::ofstream(dir / "corpus.txt") << text;

  const fs::path out = dir / "export";
  CmdResult r = run_strata("train data.paths=[" + (dir / "corpus.txt").string() + "] run.dir=" +
                           (dir / "run").string() +
                           " train.micro_batch=2 train.seq_len=16 train.steps=2 optim.warmup_steps=1 optim.lr=0 "
                           "model.from=" + src.string() + " run.export=" + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(published_code_check(src, out), 0) << "see " << out.string() << ".check.json";
  EXPECT_TRUE(fs::exists(out / "modeling_deepseek.py") && fs::exists(out / "configuration_deepseek.py"));
  std::ifstream config(out / "config.json");
  const std::string exported_config((std::istreambuf_iterator<char>(config)), std::istreambuf_iterator<char>());
  EXPECT_NE(exported_config.find("\"auto_map\""), std::string::npos) << exported_config;

  const fs::path converted = dir / "converted";
  CmdResult c = run_strata("convert --from " + src.string() + " --to " + converted.string());
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_EQ(published_code_check(src, converted), 0) << "see " << converted.string() << ".check.json";

  // A bf16 export keeps the routers' selection biases in F32, as the published checkpoints do:
  // routing compares them with the scores.
  const fs::path half = dir / "bf16";
  CmdResult h = run_strata("convert --from " + src.string() + " --to " + half.string() + " --dtype bf16");
  ASSERT_EQ(h.exit_code, 0) << h.output;
  Result<SafetensorsReader> written = SafetensorsReader::open(half.string());
  ASSERT_TRUE(written.ok()) << written.status().to_string();
  ASSERT_NE(written->find(selection_bias_name(1)), nullptr);
  EXPECT_EQ(written->find(selection_bias_name(1))->dtype, "F32");
  EXPECT_EQ(written->find("model.layers.1.self_attn.kv_b_proj.weight")->dtype, "BF16");

  // Generation from it is refused by name, not attempted.
  CmdResult g = run_strata("generate --from " + src.string() + " --prompt hi --max-new-tokens 2");
  EXPECT_NE(g.exit_code, 0) << g.output;
  EXPECT_NE(g.output.find("latent attention"), std::string::npos) << g.output;
  fs::remove_all(dir);
}

// Qwen3: `strata convert` exports a Qwen3ForCausalLM that transformers' own class (4.51.3,
// tests/model/reference_qwen3.py) loads with no missing or unexpected tensor, every tensor equal to
// the source's and the same logits.
TEST(Qwen3ExportTest, ExportsLoadInTransformersQwen3ForCausalLM) {
  if (!python_can_import("transformers") || !reference_script_runs("reference_qwen3.py")) {
    GTEST_SKIP() << "tests/model/reference_qwen3.py probe: no transformers with Qwen3 here (scripts/setup.sh "
                 << "installs 4.51 into a virtual environment)";
  }
  const fs::path src = run_reference("reference_qwen3.py", "tools_qwen3_export", "qwen3");
  ASSERT_FALSE(::testing::Test::HasFailure());
  const fs::path dir = strata::testing::fresh_test_dir("strata_qwen3_export");
  auto check = [&](const fs::path& exported) {
    const std::string cmd = std::string(kReferencePython) + " " + STRATA_SOURCE_DIR +
                            "/tests/model/reference_qwen3.py check " + src.string() + " " + exported.string() + " >" +
                            exported.string() + ".check.log 2>&1";
    return std::system(cmd.c_str());
  };
  const fs::path converted = dir / "converted";
  CmdResult c = run_strata("convert --from " + src.string() + " --to " + converted.string());
  ASSERT_EQ(c.exit_code, 0) << c.output;
  ASSERT_EQ(check(converted), 0) << "see " << converted.string() << ".check.json";
  fs::remove_all(dir);
}

// Every tensor of `a` is in `b` with the same shape and the same fp32 bits, and the other way.
void expect_same_tensors(const fs::path& a, const fs::path& b) {
  Result<SafetensorsReader> ra = SafetensorsReader::open(a.string());
  Result<SafetensorsReader> rb = SafetensorsReader::open(b.string());
  ASSERT_TRUE(ra.ok() && rb.ok()) << ra.status().to_string() << rb.status().to_string();
  EXPECT_EQ(ra->tensors().size(), rb->tensors().size());
  for (const SafetensorsTensorInfo& t : ra->tensors()) {
    const SafetensorsTensorInfo* other = rb->find(t.name);
    ASSERT_NE(other, nullptr) << b << " lacks " << t.name;
    ASSERT_EQ(other->shape, t.shape) << t.name;
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    std::vector<float> x(static_cast<size_t>(n)), y(static_cast<size_t>(n));
    ASSERT_TRUE(ra->read_f32(t.name, t.shape, x.data()).ok());
    ASSERT_TRUE(rb->read_f32(t.name, t.shape, y.data()).ok());
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0) << t.name << " differs";
  }
}

// A DeepSeek-V3 with its multi-token prediction module (model.layers.3.*, an MoE block, and the
// checkpoint's copies of the embedding and LM head in it): at a zero learning rate the module
// trains (train.mtp_weight's default) and exports as it came, bit for bit, every tensor and
// selection bias of the source there and no other; at train.mtp_weight=0 with a learning rate the
// model trains and the module exports unchanged.
TEST(DeepseekExportTest, TheMultiTokenPredictionModuleExportsAsItCameOrAsTrained) {
  if (!python_can_import("transformers")) {
    GTEST_SKIP() << kReferencePython << " cannot import transformers; the DeepSeek export test needs it";
  }
  if (!reference_script_runs("reference_deepseek.py")) {
    GTEST_SKIP() << kReferencePython << " cannot import DeepSeek's published modeling code with its transformers "
                 << "(tests/model/reference_deepseek.py probe)";
  }
  const fs::path src = run_reference("reference_deepseek.py", "tools_deepseek_mtp_export", "deepseek_v3_mtp_bytes");
  ASSERT_FALSE(::testing::Test::HasFailure());
  const fs::path dir = strata::testing::fresh_test_dir("strata_deepseek_mtp_export");
  std::string text;
  for (int i = 0; i < 200; ++i) text += "hello deep seek " + std::to_string(i % 5) + "\n";
  std::ofstream(dir / "corpus.txt") << text;
  const std::string common = "train data.paths=[" + (dir / "corpus.txt").string() +
                             "] train.micro_batch=2 train.seq_len=16 train.steps=2 optim.warmup_steps=1 model.from=" +
                             src.string();

  const fs::path same = dir / "same";
  CmdResult r = run_strata(common + " run.dir=" + (dir / "run0").string() + " optim.lr=0 ckpt.every=2 run.export=" +
                           same.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("mtp: loss"), std::string::npos) << "the module did not train: " << r.output;
  expect_same_tensors(src / "model.safetensors", same);
  // The run's checkpoint converts to the same model (every MoE block's selection bias, the
  // modules' included).
  const fs::path converted = dir / "converted";
  r = run_strata("convert --from " + (dir / "run0" / "checkpoints").string() + " --to " + converted.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_tensors(src / "model.safetensors", converted);

  const fs::path kept = dir / "kept";
  r = run_strata(common + " run.dir=" + (dir / "run1").string() + " optim.lr=1e-2 train.mtp_weight=0 run.export=" +
                 kept.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("mtp: loss"), std::string::npos) << r.output;
  Result<SafetensorsReader> before = SafetensorsReader::open((src / "model.safetensors").string());
  Result<SafetensorsReader> after = SafetensorsReader::open(kept.string());
  ASSERT_TRUE(before.ok() && after.ok());
  int module = 0, trained = 0;
  for (const SafetensorsTensorInfo& t : before->tensors()) {
    ASSERT_NE(after->find(t.name), nullptr) << t.name;
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    std::vector<float> x(static_cast<size_t>(n)), y(static_cast<size_t>(n));
    ASSERT_TRUE(before->read_f32(t.name, t.shape, x.data()).ok());
    ASSERT_TRUE(after->read_f32(t.name, t.shape, y.data()).ok());
    const bool equal = std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
    // The module's own tensors; its copies of the embedding and LM head follow the trained ones.
    const bool own = t.name.starts_with("model.layers.3.") && !t.name.ends_with("embed_tokens.weight") &&
                     !t.name.ends_with("shared_head.head.weight");
    if (own) {
      ++module;
      EXPECT_TRUE(equal) << t.name << " changed at train.mtp_weight=0";
    } else if (t.name.ends_with("self_attn.o_proj.weight") || t.name.ends_with("embed_tokens.weight")) {
      ++trained;
      EXPECT_FALSE(equal) << t.name << " did not train";
    }
  }
  EXPECT_GT(module, 20);
  EXPECT_EQ(trained, 3 + 2);  // the layers' o_proj, the embedding and the module's copy of it
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata::model
