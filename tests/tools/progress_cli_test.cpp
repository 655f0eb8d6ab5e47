// Progress lines as a user sees them when stderr is not a terminal (a pipe here): a fast
// operation prints none, and nothing ever writes the terminal's carriage return into a log.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "tools/cli_util.h"

namespace {

namespace fs = std::filesystem;

using strata::testing::CmdResult;
using strata::testing::run_strata;

class ProgressCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::testing::fresh_test_dir("strata_progress");
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(ProgressCliTest, FastOperationsPrintNoProgressLines) {
  std::string jsonl;
  for (int i = 0; i < 200; ++i) jsonl += "{\"text\": \"a short document number " + std::to_string(i) + "\"}\n";
  std::ofstream(dir_ / "docs.jsonl") << jsonl;
  CmdResult tok = run_strata("data tokenize --tokenizer " + std::string(STRATA_SOURCE_DIR) +
                             "/tests/fixtures/tokenizer/llama3 --input " + (dir_ / "docs.jsonl").string() +
                             " --format jsonl --out " + (dir_ / "tokens").string());
  ASSERT_EQ(tok.exit_code, 0) << tok.output;
  EXPECT_NE(tok.output.find("wrote 1 shard(s)"), std::string::npos) << tok.output;
  EXPECT_EQ(tok.output.find("tokenize:"), std::string::npos) << "a progress line for a fast run:\n" << tok.output;
  EXPECT_EQ(tok.output.find('\r'), std::string::npos) << tok.output;

  const fs::path run = dir_ / "run";
  CmdResult train = run_strata("train data.paths=[" + (dir_ / "tokens").string() + "] run.dir=" + run.string() +
                               " memory.nvme.path=" + (dir_ / "nvme").string() +
                               " model.set=[vocab_size=900] train.micro_batch=2 train.seq_len=16 train.steps=2"
                               " optim.warmup_steps=1 ckpt.every=2");
  ASSERT_EQ(train.exit_code, 0) << train.output;
  CmdResult verify = run_strata("ckpt verify " + (run / "checkpoints").string());
  ASSERT_EQ(verify.exit_code, 0) << verify.output;
  for (const CmdResult* r : {&train, &verify}) {
    EXPECT_EQ(r->output.find("initialising weights:"), std::string::npos) << r->output;
    EXPECT_EQ(r->output.find("saving checkpoint step"), std::string::npos) << r->output;
    EXPECT_EQ(r->output.find("verifying "), std::string::npos) << r->output;
    EXPECT_EQ(r->output.find('\r'), std::string::npos) << r->output;
  }
}

}  // namespace
