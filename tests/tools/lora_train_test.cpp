// `strata train` with train.method=lora end to end, against PEFT (tests/model/reference_lora.py):
// a base and a PEFT adapter start the run, the adapter export loads in PeftModel.from_pretrained
// with PEFT's values and logits, the merged export in transformers alone; checkpoints hold the
// adapters only and resume bit for bit (with dropout); the checkpoint converts to the same adapter
// and merged model; wrong combinations are refused by name.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/format.h"
#include "ckpt/reader.h"
#include "model/reference_util.h"
#include "model/safetensors.h"
#include "tools/cli_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using model::kReferencePython;
using model::reference_script_runs;
using model::run_reference;
using testing::CmdResult;
using testing::run_strata;

// tests/model/reference_lora.py MODE VARIANT_DIR TARGET: its exit status.
int reference_check(const std::string& mode, const fs::path& variant_dir, const fs::path& target) {
  const std::string cmd = std::string(kReferencePython) + " " + STRATA_SOURCE_DIR + "/tests/model/reference_lora.py " +
                          mode + " " + variant_dir.string() + " " + target.string() + " >" + target.string() +
                          ".log 2>&1";
  return std::system(cmd.c_str());
}

// Every tensor of two safetensors files (or directories) equal, bit for bit, and the same names.
void expect_same_tensors(const fs::path& a, const fs::path& b) {
  Result<model::SafetensorsReader> x = model::SafetensorsReader::open(a.string());
  Result<model::SafetensorsReader> y = model::SafetensorsReader::open(b.string());
  ASSERT_TRUE(x.ok() && y.ok()) << a << " " << b;
  ASSERT_EQ(x->tensors().size(), y->tensors().size());
  for (const model::SafetensorsTensorInfo& t : x->tensors()) {
    ASSERT_NE(y->find(t.name), nullptr) << t.name;
    std::vector<float> u(static_cast<size_t>(t.numel)), v(static_cast<size_t>(t.numel));
    ASSERT_TRUE(x->read_f32(t.name, t.shape, u.data()).ok());
    ASSERT_TRUE(y->read_f32(t.name, t.shape, v.data()).ok());
    EXPECT_EQ(std::memcmp(u.data(), v.data(), u.size() * sizeof(float)), 0) << t.name << " differs";
  }
}

TEST(LoraTrainTest, AdaptersTrainResumeAndExportTheWayPeftReadsThem) {
  if (!reference_script_runs("reference_lora.py"))
    GTEST_SKIP() << "tests/model/reference_lora.py probe: torch, transformers or peft cannot be imported here";
  const fs::path ref = run_reference("reference_lora.py", "tools_lora", "llama_lora");
  ASSERT_FALSE(::testing::Test::HasFailure());
  const fs::path dir = testing::fresh_test_dir("strata_lora_train");
  // An llm.c token file (256 int32 header: magic, version, count; then uint16 tokens) in the
  // reference's vocabulary of 97.
  {
    std::vector<int32_t> header(256, 0);
    std::vector<uint16_t> tokens;
    for (int i = 0; i < 4000; ++i) tokens.push_back(static_cast<uint16_t>((i * 37 + i / 11) % 97));
    header[0] = 20240520;
    header[1] = 1;
    header[2] = static_cast<int32_t>(tokens.size());
    std::ofstream out(dir / "tokens.bin", std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), static_cast<std::streamsize>(header.size() * 4));
    out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
  }
  const std::string common = "train data.format=llmc data.paths=[" + (dir / "tokens.bin").string() +
                             "] train.micro_batch=2 train.seq_len=16 optim.warmup_steps=1 train.method=lora model.from=" +
                             (ref / "base").string();

  // 1. PEFT's trained adapter at learning rate 0: the exports are that model.
  const fs::path adapter = dir / "adapter";
  CmdResult r = run_strata(common + " model.adapter=" + (ref / "trained_adapter").string() +
                           " train.steps=2 optim.lr=0 run.dir=" + (dir / "run0").string() + " run.export=" +
                           adapter.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("lora: rank 4, alpha 8"), std::string::npos) << r.output;
  expect_same_tensors(ref / "trained_adapter" / "adapter_model.safetensors", adapter / "adapter_model.safetensors");
  EXPECT_EQ(reference_check("check", ref, adapter), 0) << "PEFT's check failed; see " << adapter.string() << ".log";
  const fs::path merged = dir / "merged";
  r = run_strata(common + " model.adapter=" + (ref / "trained_adapter").string() +
                 " train.steps=2 optim.lr=0 run.export_merged=true run.dir=" + (dir / "run1").string() +
                 " run.export=" + merged.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(reference_check("check_merged", ref, merged), 0) << "see " << merged.string() << ".log";

  // 2. Training with dropout, checkpointed at step 2 of 4: the checkpoint holds the adapters'
  // parameters and moments and nothing of the base; resuming from it gives the same adapter.
  const std::string trained = common + " train.steps=4 optim.lr=1e-2 lora.rank=8 lora.alpha=16 lora.dropout=0.1 "
                                       "ckpt.every=2 ckpt.keep_last=5";
  const fs::path whole = dir / "whole";
  r = run_strata(trained + " run.dir=" + (dir / "run2").string() + " run.export=" + whole.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  {
    std::unique_ptr<ckpt::CheckpointReader> reader;
    Result<std::unique_ptr<ckpt::CheckpointReader>> opened =
        ckpt::CheckpointReader::open((dir / "run2" / "checkpoints" / "step-2").string(), {});
    ASSERT_TRUE(opened.ok()) << opened.status().to_string();
    int adapters = 0;
    for (const ckpt::SavedTensor& t : (*opened)->tensors()) {
      if (t.kind == ckpt::TensorKind::kState) continue;
      EXPECT_NE(t.name.find(".lora_"), std::string::npos) << "the checkpoint holds base tensor " << t.name;
      ++adapters;
    }
    EXPECT_EQ(adapters, 3 * 2 * 7 * 2);  // param, m, v of A and B on 7 projections of 2 layers
  }
  fs::create_directories(dir / "run3" / "checkpoints");
  fs::copy(dir / "run2" / "checkpoints" / "step-2", dir / "run3" / "checkpoints" / "step-2",
           fs::copy_options::recursive);
  std::ofstream(dir / "run3" / "checkpoints" / "latest") << "step-2\n";
  const fs::path resumed = dir / "resumed";
  r = run_strata(trained + " run.dir=" + (dir / "run3").string() + " run.export=" + resumed.string() +
                 " --resume " + (dir / "run3" / "checkpoints").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_tensors(whole / "adapter_model.safetensors", resumed / "adapter_model.safetensors");

  // 3. The checkpoint converts to the adapter, and with --merge to the merged model.
  const fs::path converted = dir / "converted";
  r = run_strata("convert --from " + (dir / "run2" / "checkpoints").string() + " --to " + converted.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_tensors(whole / "adapter_model.safetensors", converted / "adapter_model.safetensors");
  const fs::path converted_merged = dir / "converted_merged";
  r = run_strata("convert --merge --from " + (dir / "run2" / "checkpoints").string() + " --to " +
                 converted_merged.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(fs::exists(converted_merged / "config.json"));

  // 4. Refused by name: another rank on resume, an adapter without train.method=lora.
  r = run_strata(common + " train.steps=4 lora.rank=4 lora.alpha=16 lora.dropout=0.1 ckpt.every=2 run.dir=" +
                 (dir / "run4").string() + " --resume " + (dir / "run2" / "checkpoints").string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("strata_lora"), std::string::npos) << r.output;
  r = run_strata("train model.adapter=" + (ref / "adapter").string() + " model.from=" + (ref / "base").string() +
                 " run.dir=" + (dir / "run5").string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("train.method=lora"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace strata
