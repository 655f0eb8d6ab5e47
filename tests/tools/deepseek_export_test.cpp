// DeepSeek-V3 through the CLI: `strata train model.from=DIR` on a tiny DeepseekV3ForCausalLM
// built by DeepSeek's published modeling code (tests/model/reference_deepseek.py), with a zero
// learning rate, exports the model it started from bit for bit (the routers'
// e_score_correction_bias included), and the published code loads the export with no missing or
// unexpected tensor and the same logits. `strata convert` does the same without training.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "model/reference_util.h"
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
  const fs::path src = run_reference("reference_deepseek.py", "tools_deepseek_export", "deepseek_v3_bytes");
  ASSERT_FALSE(::testing::Test::HasFailure());
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

  const fs::path converted = dir / "converted";
  CmdResult c = run_strata("convert --from " + src.string() + " --to " + converted.string());
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_EQ(published_code_check(src, converted), 0) << "see " << converted.string() << ".check.json";

  // Generation from it is refused by name, not attempted.
  CmdResult g = run_strata("generate --from " + src.string() + " --prompt hi --max-new-tokens 2");
  EXPECT_NE(g.exit_code, 0) << g.output;
  EXPECT_NE(g.output.find("latent attention"), std::string::npos) << g.output;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata::model
