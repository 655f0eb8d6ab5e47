// DeepSeek-V3 through the CLI: `strata train model.from=DIR` on a tiny DeepseekV3ForCausalLM
// built by DeepSeek's published modeling code (tests/model/reference_deepseek.py), with a zero
// learning rate, exports the model it started from bit for bit (the routers'
// e_score_correction_bias included), and the published code loads the export with no missing or
// unexpected tensor and the same logits. `strata convert` does the same without training.
#include <gtest/gtest.h>

#include <cstdlib>
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

}  // namespace
}  // namespace strata::model
