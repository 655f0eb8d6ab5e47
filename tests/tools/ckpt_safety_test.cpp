// `strata train` and `strata ckpt` against checkpoints that do not match the run or hold a
// diverged state, and runs that diverge: a clear error and a non-zero exit, never a silent
// resume of the wrong model, a NaN checkpoint or an echo of a file that is not a checkpoint's.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/format.h"
#include "ckpt/reader.h"

#include "tools/cli_util.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;

using strata::testing::CmdResult;
using strata::testing::run_strata;

using strata::testing::read_text;

std::vector<nlohmann::json> metrics_of(const fs::path& file) {
  std::vector<nlohmann::json> out;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("event")) out.push_back(j);  // event lines (the run's goodput) are not steps
  }
  return out;
}

// Rewrites the manifest's record of `file` after the file was edited, as a forger would.
void rehash(const fs::path& step_dir, const std::string& file) {
  const fs::path m = step_dir / "manifest.json";
  nlohmann::json j = nlohmann::json::parse(read_text(m));
  j["files"][file]["xxh3_64"] = strata::ckpt::xxh3_hex(strata::ckpt::hash_file((step_dir / file).string()).value());
  std::ofstream(m) << j.dump(2);
}

// Stores one non-square weight of step_dir/model.safetensors with its shape transposed (the same
// element count) and forges the checksum to match; returns its name ("" when none was found).
std::string transpose_a_weight(const fs::path& step_dir) {
  const fs::path model = step_dir / "model.safetensors";
  std::string bytes = read_text(model);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(static_cast<unsigned char>(bytes[i])) << (8 * i);
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
  std::string name, from, to;
  for (auto it = header.begin(); it != header.end() && name.empty(); ++it) {
    if (it.key() == "__metadata__" || (*it)["shape"].size() != 2 || (*it)["shape"][0] == (*it)["shape"][1]) continue;
    name = it.key();
    const auto& s = (*it)["shape"];
    from = "\"shape\":[" + s[0].dump() + "," + s[1].dump() + "]";
    to = "\"shape\":[" + s[1].dump() + "," + s[0].dump() + "]";
  }
  if (name.empty()) return name;
  const size_t at = bytes.find(from, bytes.find("\"" + name + "\""));
  if (at >= n + 8) return "";
  bytes.replace(at, from.size(), to);
  std::ofstream(model, std::ios::binary | std::ios::trunc) << bytes;
  rehash(step_dir, "model.safetensors");
  return name;
}

// Edits one field of step_dir/manifest.json (a JSON pointer) to `value`.
void edit_manifest(const fs::path& step_dir, const std::string& pointer, const nlohmann::json& value) {
  const fs::path m = step_dir / "manifest.json";
  nlohmann::json j = nlohmann::json::parse(read_text(m));
  j[nlohmann::json::json_pointer(pointer)] = value;
  std::ofstream(m) << j.dump(2);
}

class CkptSafetyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::testing::fresh_test_dir("strata_ckpt_safety");
    std::string text;
    for (int i = 0; i < 200; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
    std::ofstream(dir_ / "corpus.txt") << text;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string run(const std::string& run_dir, const std::string& model_set) const {
    return "train data.paths=[" + (dir_ / "corpus.txt").string() + "] run.dir=" + run_dir +
           " train.micro_batch=2 train.seq_len=32 optim.warmup_steps=2 'model.set=[" + model_set + "]'";
  }
  // A committed checkpoint of a 4-layer model after 3 steps.
  fs::path four_layer_checkpoint() {
    const std::string full = (dir_ / "full").string();
    CmdResult a = run_strata(run(full, kFourLayers) + " train.steps=3 ckpt.every=3");
    EXPECT_EQ(a.exit_code, 0) << a.output;
    return fs::path(full) / "checkpoints" / "step-3";
  }
  fs::path dir_;
  static constexpr const char* kFourLayers = "num_hidden_layers=4,hidden_size=64,intermediate_size=96";
};

// A run that diverges: optim.lr=10 with optim.weight_decay=10 multiplies the weights by -99 a
// step, until the forward overflows and the gradient norm (or the loss) is NaN; the weights
// themselves stay finite, and a skipped step leaves them as they were. The skipped steps are
// counted in the metrics, the sixth in a row stops the run with an error naming it, and every
// checkpoint it kept holds finite values. (The step it diverges at is not asserted: it depends
// on how the forward's sums round.)
constexpr const char* kDiverging = " optim.lr=10 optim.weight_decay=10";

TEST_F(CkptSafetyTest, ADivergedRunSkipsThenStopsNonZeroWithoutANaNCheckpoint) {
  const std::string run_dir = (dir_ / "run").string();
  CmdResult r = run_strata(run(run_dir, "num_hidden_layers=2,hidden_size=64,intermediate_size=96") +
                           " train.steps=40 ckpt.every=1 ckpt.keep_last=2" + kDiverging);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("has not been finite (NaN or Inf) for 6 steps in a row"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("train.max_skipped_steps=5"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("SKIPPED (1)"), std::string::npos) << "the step line shows the skip";
  const auto metrics = metrics_of(fs::path(run_dir) / "metrics.jsonl");
  ASSERT_GE(metrics.size(), 7u) << r.output;
  ASSERT_LT(metrics.size(), 40u) << r.output;
  EXPECT_EQ(metrics[0]["skipped"], false);
  const size_t first_skipped = metrics.size() - 6;
  EXPECT_EQ(metrics[first_skipped - 1]["skipped"], false);
  for (size_t s = first_skipped; s < metrics.size(); ++s) {
    EXPECT_EQ(metrics[s]["skipped"], true) << "step " << s + 1;
    EXPECT_EQ(metrics[s]["skipped_steps"], s - first_skipped + 1) << "step " << s + 1;
  }
  // A run that fails after it started still ends its metrics with its goodput.
  EXPECT_NE(read_text(fs::path(run_dir) / "metrics.jsonl").find("\"event\":\"goodput\""), std::string::npos);
  EXPECT_NE(r.output.find("goodput "), std::string::npos) << r.output;
  int kept = 0;
  for (const auto& e : fs::directory_iterator(fs::path(run_dir) / "checkpoints")) {
    if (!fs::is_directory(e.path())) continue;  // `latest` and the run's lock on its ckpt.dir
    ++kept;
    CmdResult v = run_strata("ckpt verify " + e.path().string());
    EXPECT_EQ(v.exit_code, 0) << "a checkpoint of a non-finite state was kept: " << e.path() << "\n" << v.output;
  }
  EXPECT_GT(kept, 0) << r.output;

  // train.max_skipped_steps=0: the first non-finite step stops the run.
  const std::string strict = (dir_ / "strict").string();
  CmdResult s = run_strata(run(strict, "num_hidden_layers=2,hidden_size=64,intermediate_size=96") +
                           " train.steps=40 train.max_skipped_steps=0" + kDiverging);
  EXPECT_NE(s.exit_code, 0) << s.output;
  EXPECT_NE(s.output.find("for 1 steps in a row, more than train.max_skipped_steps=0"), std::string::npos) << s.output;
  EXPECT_EQ(metrics_of(fs::path(strict) / "metrics.jsonl").size(), first_skipped + 1) << s.output;
}

// With AdamW overlapped with backward, layers are updated before the step's gradients are all
// judged: a NaN step cannot be skipped, so the run stops at the first one.
TEST_F(CkptSafetyTest, ADivergedRunWithOverlapStopsAtTheFirstNaNStep) {
  const std::string run_dir = (dir_ / "run").string();
  CmdResult r = run_strata(run(run_dir, "num_hidden_layers=2,hidden_size=64,intermediate_size=96") +
                           " train.steps=40 optim.grad_clip=0 optim.overlap_backward=true" + kDiverging);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("cannot be skipped"), std::string::npos) << r.output;
  const auto metrics = metrics_of(fs::path(run_dir) / "metrics.jsonl");
  ASSERT_FALSE(metrics.empty()) << r.output;
  EXPECT_NE(r.output.find("error: step " + std::to_string(metrics.size() + 1) + ":"), std::string::npos)
      << "the first step that was not finite stops the run\n"
      << r.output;
}

// optim.eps=0: the loss and the gradient norm of the step are finite, but AdamW divides 0 by 0
// for the embedding rows of tokens the batches lack (zero gradient, zero moments). The update's
// own check stops the run at that step, naming the tensor and the fix, exit 1; the checkpoint
// committed before it stays the latest, and nothing of the NaN state is saved (the run went on
// with "loss -nan" and exited 0).
TEST_F(CkptSafetyTest, AnUpdateThatWritesNaNStopsTheRunAtThatStepKeepingTheLastCheckpoint) {
  const std::string run_dir = (dir_ / "run").string();
  const std::string args = run(run_dir, "num_hidden_layers=2,hidden_size=64,intermediate_size=96") + " ckpt.every=1";
  CmdResult first = run_strata(args + " train.steps=2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  CmdResult r = run_strata(args + " train.steps=6 optim.eps=0 --resume auto");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error: step 3: AdamW produced non-finite parameters (NaN or Inf) in "
                          "'model.embed_tokens.weight'"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("set optim.eps > 0 (1e-8 is usual)"), std::string::npos) << r.output;
  const fs::path ckpt = fs::path(run_dir) / "checkpoints";
  EXPECT_EQ(read_text(ckpt / "latest"), "step-2\n") << r.output;
  EXPECT_FALSE(fs::exists(ckpt / "step-3")) << r.output;
  CmdResult v = run_strata("ckpt verify " + (ckpt / "step-2").string());
  EXPECT_EQ(v.exit_code, 0) << v.output;
}

// A checkpoint resumes only the model it was made of: fewer layers, another rms_norm_eps or a
// tensor stored transposed are refused, naming the key or the tensor.
TEST_F(CkptSafetyTest, ResumeRefusesAnotherModelNamingTheKeyOrTensor) {
  const fs::path step3 = four_layer_checkpoint();
  ASSERT_TRUE(fs::exists(step3));
  struct Case {
    std::string model_set, words;
  };
  for (const Case& c : {Case{"num_hidden_layers=2,hidden_size=64,intermediate_size=96", "'num_hidden_layers' is '2' in this run but '4'"},
                        Case{std::string(kFourLayers) + ",rms_norm_eps=0.001", "'rms_norm_eps'"}}) {
    const std::string resumed = (dir_ / "resumed").string();
    CmdResult b = run_strata(run(resumed, c.model_set) + " train.steps=6 --resume " + step3.string());
    EXPECT_EQ(b.exit_code, 1) << b.output;
    EXPECT_NE(b.output.find(c.words), std::string::npos) << b.output;
    EXPECT_FALSE(fs::exists(fs::path(resumed) / "metrics.jsonl")) << b.output;
  }

  // The same element count, the shape transposed (and the checksum forged to match).
  const std::string name = transpose_a_weight(step3);
  ASSERT_FALSE(name.empty());
  const std::string resumed = (dir_ / "transposed").string();
  CmdResult t = run_strata(run(resumed, kFourLayers) + " train.steps=6 --resume " + step3.string());
  EXPECT_EQ(t.exit_code, 1) << t.output;
  EXPECT_NE(t.output.find("tensor '" + name + "' has shape"), std::string::npos) << t.output;
}

// `ckpt verify` fails on all-NaN weights whose checksums match, naming the tensors.
TEST_F(CkptSafetyTest, VerifyFailsOnNaNWeightsNamingTheTensors) {
  const fs::path step3 = four_layer_checkpoint();
  CmdResult ok = run_strata("ckpt verify " + step3.string());
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  const fs::path model = step3 / "model.safetensors";
  std::string bytes = read_text(model);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(static_cast<unsigned char>(bytes[i])) << (8 * i);
  const uint32_t nan_bits = 0x7fc00000u;
  for (size_t off = 8 + n; off + 4 <= bytes.size(); off += 4) std::memcpy(&bytes[off], &nan_bits, 4);
  std::ofstream(model, std::ios::binary | std::ios::trunc) << bytes;
  rehash(step3, "model.safetensors");
  CmdResult r = run_strata("ckpt verify " + step3.string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("model.norm.weight: 64 NaN/Inf values"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("hold NaN or Inf"), std::string::npos) << r.output;
  // Resuming from it is refused too.
  CmdResult b = run_strata(run((dir_ / "resumed").string(), kFourLayers) + " train.steps=6 --resume " + step3.string());
  EXPECT_EQ(b.exit_code, 1) << b.output;
  EXPECT_NE(b.output.find("non-finite"), std::string::npos) << b.output;
}

// optim.eps=0 in the last step of a run: its loss and norm are finite, but AdamW writes 0/0
// into the rows of tokens the batch lacks (zero gradient, zero moments). The run fails naming a
// tensor, and its export is not written (it ended "loss -nan", exit 0, and exported NaNs).
TEST_F(CkptSafetyTest, ARunWhoseLastUpdateLeavesNaNWeightsFailsAndExportsNothing) {
  const std::string run_dir = (dir_ / "run").string();
  const fs::path hf = dir_ / "hf";
  CmdResult r = run_strata(run(run_dir, "num_hidden_layers=2,hidden_size=64,intermediate_size=96") +
                           " train.steps=1 optim.warmup_steps=0 optim.eps=0 run.export=" + hf.string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error: step 1: AdamW produced non-finite parameters (NaN or Inf) in '"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(hf / "model.safetensors")) << r.output;
}

// `strata convert` checks a checkpoint as a resume does: a manifest that lists 2 layers while its
// files hold 4, a weight stored transposed and a recipe strata never writes are refused, naming
// the tensor or field, and nothing is written (each exported 0 bytes' worth of a wrong model
// before, exit 0).
TEST_F(CkptSafetyTest, ConvertChecksACheckpointAsAResumeDoes) {
  const fs::path step3 = four_layer_checkpoint();
  struct Case {
    std::string name, words;
    std::function<void(const fs::path&)> edit;
  };
  const Case cases[] = {
      {"fewer-layers", "which this model lacks",
       [](const fs::path& d) { edit_manifest(d, "/model_config/num_hidden_layers", 2); }},
      {"transposed", "has shape", [](const fs::path& d) { EXPECT_FALSE(transpose_a_weight(d).empty()); }},
      {"recipe", "field 'precision.recipe'",
       [](const fs::path& d) { edit_manifest(d, "/precision/recipe", "fp16"); }},
  };
  for (const Case& c : cases) {
    const fs::path copy = dir_ / c.name / "step-3";
    fs::create_directories(copy.parent_path());
    fs::copy(step3, copy, fs::copy_options::recursive);
    c.edit(copy);
    const fs::path out = dir_ / (c.name + "-hf");
    CmdResult r = run_strata("convert --from " + copy.string() + " --to " + out.string());
    EXPECT_EQ(r.exit_code, 1) << c.name << ": " << r.output;
    EXPECT_NE(r.output.find(c.words), std::string::npos) << c.name << ": " << r.output;
    EXPECT_FALSE(fs::exists(out / "model.safetensors")) << c.name;
  }
}

// Weights holding NaN are not exported unless asked for by name.
TEST_F(CkptSafetyTest, ConvertRefusesNonFiniteWeightsUnlessAllowed) {
  const fs::path step3 = four_layer_checkpoint();
  const std::string hf = (dir_ / "hf").string();
  CmdResult ok = run_strata("convert --from " + step3.string() + " --to " + hf);
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  // A NaN in the exported directory (the checksums of a Hugging Face directory are nobody's).
  const fs::path model = fs::path(hf) / "model.safetensors";
  std::string bytes = read_text(model);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(static_cast<unsigned char>(bytes[i])) << (8 * i);
  const uint16_t nan_bits = 0x7fc0;  // bf16 or f32's high half: NaN either way
  std::memcpy(&bytes[8 + n + 2], &nan_bits, 2);
  std::ofstream(model, std::ios::binary | std::ios::trunc) << bytes;
  CmdResult refused = run_strata("convert --from " + hf + " --to " + (dir_ / "again").string());
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("NaN or Inf values"), std::string::npos) << refused.output;
  EXPECT_NE(refused.output.find("--allow-nonfinite"), std::string::npos) << refused.output;
  CmdResult allowed = run_strata("convert --from " + hf + " --to " + (dir_ / "allowed").string() + " --allow-nonfinite");
  EXPECT_EQ(allowed.exit_code, 0) << allowed.output;
}

// A `latest` pointing at another file: verify fails without printing what that file holds.
TEST_F(CkptSafetyTest, LatestPointingOutsideIsNotEchoed) {
  const fs::path ckpt = dir_ / "ckpt";
  fs::create_directories(ckpt);
  std::string passwd;
  for (int i = 0; i < 24; ++i) passwd += "user" + std::to_string(i) + ":x:1000:1000::/home/u:/bin/sh\n";
  std::ofstream(dir_ / "passwd") << passwd;
  fs::create_symlink(dir_ / "passwd", ckpt / "latest");
  CmdResult r = run_strata("ckpt verify " + ckpt.string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(r.output.find("user"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step-N"), std::string::npos) << r.output;
}

}  // namespace
