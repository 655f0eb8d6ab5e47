// Data parallelism end to end: `strata train` launched as several processes with torchrun's
// variables, on the CPU backend through Gloo, against one process training the same global
// batch; checkpoints written by 4 ranks resumed by 1 and 4; a rank killed mid-run.
//
// Why a bound and not bitwise: one process accumulates a step's micro-batches into the same
// gradient buffer (the weight-gradient GEMM adds into it), while ranks each start from zero and
// their sums are added in rank order afterwards. The addends are the same, their association is
// not, so gradients agree to a few ulps and parameters after a few AdamW steps to about 1e-6 of
// their size. The same world size repeats bit for bit.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/units.h"
#include "model/safetensors.h"
#include "tools/cli_util.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::CmdResult;

// The step lines' `key` ("loss", or "eval_loss" on the steps that evaluated) of metrics.jsonl,
// in step order.
std::vector<double> losses_of(const fs::path& metrics, const char* key = "loss") {
  std::vector<double> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains(key) && j.contains("step")) out.push_back(j[key].get<double>());
  }
  return out;
}

using strata::testing::read_text;

// Largest |a - b| over every tensor of two exported models, and the largest |a|.
struct ParamDiff {
  double max_abs = -1;
  double max_value = 0;
  size_t tensors = 0;
};
ParamDiff compare_exports(const fs::path& a, const fs::path& b) {
  ParamDiff d;
  auto ra = model::SafetensorsReader::open((a / "model.safetensors").string());
  auto rb = model::SafetensorsReader::open((b / "model.safetensors").string());
  if (!ra.ok() || !rb.ok()) return d;
  d.max_abs = 0;
  for (const auto& info : ra->tensors()) {
    int64_t n = 1;
    for (int64_t s : info.shape) n *= s;
    std::vector<float> x(static_cast<size_t>(n)), y(static_cast<size_t>(n));
    if (!ra->read_f32(info.name, x.data()).ok() || !rb->read_f32(info.name, y.data()).ok()) return ParamDiff{};
    for (size_t i = 0; i < x.size(); ++i) {
      const double diff = std::fabs(static_cast<double>(x[i]) - y[i]);
      if (!(diff <= d.max_abs)) d.max_abs = diff;  // a NaN sticks
      d.max_value = std::max(d.max_value, std::fabs(static_cast<double>(x[i])));
    }
    ++d.tensors;
  }
  return d;
}

class DataParallelTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::fresh_test_dir("dp"); }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  std::string corpus() {
    const fs::path p = dir_ / "corpus.txt";
    if (!fs::exists(p)) {
      std::ofstream out(p);
      for (int i = 0; i < 300; ++i) out << "the quick brown fox jumps over the lazy dog " << (i * 7919) % 13 << "\n";
    }
    return p.string();
  }
  // A tiny dense model; `accum` micro-batches of 2 sequences per rank.
  std::string run_args(const std::string& run_dir, int accum, const std::string& model_set = "") {
    return "train data.paths=[" + corpus() + "] run.dir=" + run_dir +
           " train.micro_batch=2 train.seq_len=32 train.steps=4 optim.warmup_steps=1 train.grad_accum=" +
           std::to_string(accum) + " 'model.set=[num_hidden_layers=2,hidden_size=64,intermediate_size=96" +
           model_set + "]'";
  }

  // Runs `strata ARGS` as `world` ranks at once, with torchrun's variables, each rank's output
  // in its own log; returns each rank's result.
  std::vector<CmdResult> launch(int world, const std::string& args, const std::string& name,
                                const std::string& extra_env = "") {
    std::vector<CmdResult> results(static_cast<size_t>(world));
    std::vector<std::thread> threads;
    const std::string rdzv = (dir_ / "rendezvous").string();
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        const fs::path log = dir_ / (name + ".rank" + std::to_string(r) + ".log");
        const std::string env = "RANK=" + std::to_string(r) + " WORLD_SIZE=" + std::to_string(world) +
                                " LOCAL_RANK=" + std::to_string(r) + " LOCAL_WORLD_SIZE=" + std::to_string(world) +
                                " TORCHELASTIC_RUN_ID=" + name + " " + extra_env + " ";
        const std::string cmd = env + std::string(STRATA_BINARY_DIR) + "/strata " + args +
                                " parallel.rendezvous=" + rdzv + " parallel.timeout_s=30 > " + log.string() + " 2>&1";
        const int status = std::system(cmd.c_str());
        results[static_cast<size_t>(r)].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        results[static_cast<size_t>(r)].output = read_text(log);
      });
    }
    for (auto& t : threads) t.join();
    return results;
  }
  static std::string all_output(const std::vector<CmdResult>& rs) {
    std::string out;
    for (size_t r = 0; r < rs.size(); ++r) out += "--- rank " + std::to_string(r) + "\n" + rs[r].output;
    return out;
  }
  static bool all_ok(const std::vector<CmdResult>& rs) {
    for (const CmdResult& r : rs)
      if (r.exit_code != 0) return false;
    return true;
  }

  fs::path dir_;
};

// The bounds for "the same step in another world size" (see the file comment).
constexpr double kLossTol = 1e-5;   // relative, per step
constexpr double kParamTol = 1e-5;  // absolute, on weights of size ~0.1 after 4 steps of lr 3e-3

void expect_close_losses(const std::vector<double>& a, const std::vector<double>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    const double rel = std::fabs(a[i] - b[i]) / std::max(std::fabs(a[i]), 1e-12);
    EXPECT_TRUE(rel <= kLossTol) << what << ": step " << i + 1 << " loss " << a[i] << " vs " << b[i];
  }
}

// Every step's host tier bytes in `metrics` (rank 0's) within `budget`, over `steps` steps.
void expect_host_within(const fs::path& metrics, uint64_t budget, int steps) {
  std::ifstream in(metrics);
  std::string line;
  int seen = 0;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object() || !j.contains("host_bytes")) continue;
    ++seen;
    EXPECT_LE(j["host_bytes"].get<uint64_t>(), budget) << line;
  }
  EXPECT_EQ(seen, steps) << metrics;
}

// The run in `run` took the steps of the one in `one` (losses, and eval losses when `eval`) and
// exported its weights, within the bounds.
void expect_trained_as(const fs::path& one, const fs::path& run, const std::string& what, bool eval = false,
                       double param_tol = kParamTol) {
  expect_close_losses(losses_of(one / "metrics.jsonl"), losses_of(run / "metrics.jsonl"), what);
  if (eval)
    expect_close_losses(losses_of(one / "metrics.jsonl", "eval_loss"), losses_of(run / "metrics.jsonl", "eval_loss"),
                        what + " eval");
  const ParamDiff d = compare_exports(one / "export", run / "export");
  ASSERT_GT(d.tensors, 0u) << what;
  EXPECT_TRUE(d.max_abs <= param_tol) << what << ": max |diff| " << d.max_abs;
}

TEST_F(DataParallelTest, WorldTwoAndFourTrainTheOneProcessRunsGlobalBatch) {
  const fs::path one = dir_ / "one", two = dir_ / "two", four = dir_ / "four";
  // Evaluations share their micro-batches out over the ranks: the same windows at every world.
  const std::string eval = " data.eval_paths=[" + corpus() + "] train.eval_every=2 train.eval_steps=5";
  CmdResult single =
      testing::run_strata(run_args(one.string(), 4) + eval + " run.export=" + (one / "export").string());
  ASSERT_EQ(single.exit_code, 0) << single.output;
  auto w2 = launch(2, run_args(two.string(), 2) + eval + " run.export=" + (two / "export").string(), "w2");
  ASSERT_TRUE(all_ok(w2)) << all_output(w2);
  auto w4 = launch(4, run_args(four.string(), 1) + eval + " run.export=" + (four / "export").string(), "w4");
  ASSERT_TRUE(all_ok(w4)) << all_output(w4);
  EXPECT_NE(w4[0].output.find("rank 0 of 4"), std::string::npos) << w4[0].output;
  EXPECT_NE(w4[0].output.find("x 4 ranks"), std::string::npos) << w4[0].output;

  const auto l1 = losses_of(one / "metrics.jsonl");
  ASSERT_EQ(l1.size(), 4u);
  expect_close_losses(l1, losses_of(two / "metrics.jsonl"), "world 2");
  expect_close_losses(l1, losses_of(four / "metrics.jsonl"), "world 4");
  const auto e1 = losses_of(one / "metrics.jsonl", "eval_loss");
  ASSERT_EQ(e1.size(), 2u);
  expect_close_losses(e1, losses_of(two / "metrics.jsonl", "eval_loss"), "world 2 eval");
  expect_close_losses(e1, losses_of(four / "metrics.jsonl", "eval_loss"), "world 4 eval");
  for (const fs::path& other : {two, four}) {
    const ParamDiff d = compare_exports(one / "export", other / "export");
    ASSERT_GT(d.tensors, 0u) << other;
    EXPECT_TRUE(d.max_abs <= kParamTol) << other << ": max |diff| " << d.max_abs << " (largest weight " << d.max_value
                                        << ")";
    EXPECT_GT(d.max_value, 0.01);
  }
  // A launch that ended well leaves no addresses behind for the next one with its job id.
  EXPECT_FALSE(fs::exists(dir_ / "rendezvous" / "w4"));
  // Only rank 0 writes the run's files; the other ranks leave no metrics of their own.
  EXPECT_FALSE(fs::exists(four / "metrics.rank1.jsonl"));
}

// Overlapped collectives (parallel.overlap_comm, through a Comm of their own) are the same
// operations on the same bytes as the collectives made in line: the same bits, with
// micro-batches accumulated first and the gradients paged through host memory.
// - ZeRO-0 (all-reduce) and ZeRO-1 (reduce to ranges): the gradient sums start on a thread of
//   their own as backward hands each layer over.
// - ZeRO-2 (reduce-scatter) and ZeRO-3 (and the weights' all-gathers): on the communication
//   stream, behind the compute that produced their bytes and ahead of the compute that reads
//   them; the trace shows them on that stream's lane.
TEST_F(DataParallelTest, OverlappedCollectivesAreTheBitsOfCollectivesInLine) {
  for (const char* zero : {"0", "1", "2", "3"}) {
    std::vector<fs::path> runs;
    const bool sliced = zero[0] >= '2';
    for (const char* overlap : {"false", "true"}) {
      const fs::path run = dir_ / (std::string("zero") + zero + "_overlap_" + overlap);
      // ZeRO-2 and 3 with tied embeddings: the embedding's gradients and weights are taken at
      // the head and at the embedding, and a small embedding shares the workspaces with the layers.
      const std::string args = run_args(run.string(), 2, sliced ? ",tie_word_embeddings=true" : "") +
                               " parallel.zero=" + zero + " parallel.overlap_comm=" + overlap + " memory.device=" +
                               (sliced ? "1500KiB" : "1200KiB") + " run.export=" + (run / "export").string();
      auto w2 = launch(2, args, std::string("handover") + zero + overlap);
      ASSERT_TRUE(all_ok(w2)) << all_output(w2);
      const bool stream = w2[0].output.find("run on a communication stream") != std::string::npos;
      EXPECT_EQ(stream, sliced && std::string(overlap) == "true") << w2[0].output;
      runs.push_back(run);
    }
    const std::string what = std::string("ZeRO-") + zero;
    EXPECT_EQ(losses_of(runs[0] / "metrics.jsonl"), losses_of(runs[1] / "metrics.jsonl")) << what;
    const ParamDiff d = compare_exports(runs[0] / "export", runs[1] / "export");
    ASSERT_GT(d.tensors, 0u) << what;
    EXPECT_EQ(d.max_abs, 0.0) << what;
  }
  // MoE: expert groups of 2 at ZeRO-2 (the experts' sums with their layer's on the communication
  // stream, through the holders' Comm of that stream; the token exchanges on the compute path),
  // and ZeRO-3 without expert groups (each layer's experts' weights gathered with the layer).
  const std::string moe = ",model_type=mixtral,num_local_experts=4,num_experts_per_tok=2";
  for (const char* parallel : {"parallel.zero=2 parallel.expert_parallel=2", "parallel.zero=3"}) {
    std::vector<fs::path> runs;
    for (const char* overlap : {"false", "true"}) {
      const std::string name = std::string("experts_zero") + parallel[14] + "_overlap_" + overlap;
      const fs::path run = dir_ / name;
      auto w2 = launch(2, run_args(run.string(), 2, moe) + " " + parallel + " parallel.overlap_comm=" + overlap +
                              " run.export=" + (run / "export").string(),
                       name);
      ASSERT_TRUE(all_ok(w2)) << all_output(w2);
      EXPECT_EQ(w2[0].output.find("run on a communication stream") != std::string::npos,
                std::string(overlap) == "true")
          << w2[0].output;
      runs.push_back(run);
    }
    EXPECT_EQ(losses_of(runs[0] / "metrics.jsonl"), losses_of(runs[1] / "metrics.jsonl")) << parallel;
    EXPECT_EQ(compare_exports(runs[0] / "export", runs[1] / "export").max_abs, 0.0) << parallel;
  }
}

// "homes: param: 4 device, 0 host, 0 nvme; grad: ...": the rest of the `kind` entry on this rank.
std::string homes_of(const std::string& log, const std::string& kind) {
  const size_t at = log.find(kind + ": ", log.find("homes: "));
  if (at == std::string::npos) return "";
  const size_t end = log.find_first_of(";\n", at);
  return log.substr(at + kind.size() + 2, end == std::string::npos ? std::string::npos : end - at - kind.size() - 2);
}

// Bytes of each rank's file `stem`.rank-R-of-W.safetensors in a step directory, in rank order.
std::vector<uint64_t> shard_bytes(const fs::path& step, const char* stem, int world) {
  std::vector<uint64_t> out;
  for (int r = 0; r < world; ++r) {
    char name[96];
    std::snprintf(name, sizeof name, "%s.rank-%05d-of-%05d.safetensors", stem, r, world);
    out.push_back(fs::exists(step / name) ? fs::file_size(step / name) : 0);
  }
  return out;
}

// In the bf16 recipe each rank keeps master weights and Adam moments only for its range of
// every tensor (half of each), updates that range and sends its part of the new bf16 copies to
// the other rank; the export reads the masters back from the final (sharded) checkpoint, where
// each rank wrote its ranges.
TEST_F(DataParallelTest, Bf16MastersAndMomentsLiveOnlyOnTheRankOwningTheirRange) {
  const fs::path one = dir_ / "one", two = dir_ / "two";
  const std::string bf16 = " train.precision=bf16 ckpt.every=4";
  CmdResult single = testing::run_strata(run_args(one.string(), 2) + bf16 + " run.export=" + (one / "export").string() +
                                         " run.export_dtype=f32");
  ASSERT_EQ(single.exit_code, 0) << single.output;
  EXPECT_EQ(homes_of(single.output, "master"), "4 device, 0 host, 0 nvme") << single.output;
  auto w2 = launch(2, run_args(two.string(), 1) + bf16 + " run.export=" + (two / "export").string() +
                          " run.export_dtype=f32", "bf16");
  ASSERT_TRUE(all_ok(w2)) << all_output(w2);
  // Rank 0 logs its homes.
  EXPECT_EQ(homes_of(w2[0].output, "master"), "4 device, 0 host, 0 nvme (this rank's ranges)") << w2[0].output;
  EXPECT_EQ(homes_of(w2[0].output, "adam_v"), "4 device, 0 host, 0 nvme (this rank's ranges)") << w2[0].output;
  EXPECT_EQ(homes_of(w2[0].output, "param"), "4 device, 0 host, 0 nvme") << w2[0].output;
  // Each rank wrote about half of the optimizer state: within 10% of half the one process's file.
  const fs::path whole = one / "checkpoints" / "step-4" / "optimizer.safetensors";
  ASSERT_TRUE(fs::exists(whole));
  const double half = static_cast<double>(fs::file_size(whole)) / 2;
  for (uint64_t b : shard_bytes(two / "checkpoints" / "step-4", "optimizer", 2))
    EXPECT_TRUE(std::fabs(static_cast<double>(b) - half) <= 0.1 * half) << b << " bytes against half of " << 2 * half;
  expect_close_losses(losses_of(one / "metrics.jsonl"), losses_of(two / "metrics.jsonl"), "bf16 world 2");
  const ParamDiff d = compare_exports(one / "export", two / "export");
  ASSERT_GT(d.tensors, 0u);
  EXPECT_TRUE(d.max_abs <= kParamTol) << "max |diff| " << d.max_abs;
}

// optim.eps=0 with the optimizer state sharded (bf16 recipe): each rank updates its range of the
// embedding and writes 0/0 into the rows of tokens the batch lacks. Every rank learns of the
// first such tensor on any rank at the end of the step and stops there with the same error
// naming it, exit 1, none waiting for another past the step.
TEST_F(DataParallelTest, AnUpdateThatWritesNaNOnARankStopsEveryRankNamingTheTensor) {
  const fs::path run = dir_ / "run";
  auto w2 = launch(2, run_args(run.string(), 1) + " train.precision=bf16 optim.eps=0", "eps0");
  for (size_t r = 0; r < w2.size(); ++r) {
    EXPECT_EQ(w2[r].exit_code, 1) << "rank " << r << "\n" << all_output(w2);
    EXPECT_NE(w2[r].output.find("step 1: AdamW produced non-finite parameters (NaN or Inf) in "
                                "'model.embed_tokens.weight'"),
              std::string::npos)
        << "rank " << r << "\n"
        << all_output(w2);
  }
}

TEST_F(DataParallelTest, MoeWithGlobalBalancingAndTightBudgetsThroughNvmeOnEveryRank) {
  const std::string moe = ",model_type=mixtral,num_local_experts=4,num_experts_per_tok=2,router_bias_update_rate=0.05";
  const fs::path one = dir_ / "one", two = dir_ / "two";
  CmdResult single = testing::run_strata(run_args(one.string(), 2, moe) + " run.export=" + (one / "export").string());
  ASSERT_EQ(single.exit_code, 0) << single.output;
  const std::string tight = " memory.device=2500KiB memory.host=2600KiB memory.nvme.path=" + (dir_ / "nvme").string() +
                            " memory.nvme.size=16MiB memory.offload_activations=true";
  auto w2 = launch(2, run_args(two.string(), 1, moe) + tight + " run.export=" + (two / "export").string(), "moe");
  ASSERT_TRUE(all_ok(w2)) << all_output(w2);
  // Each rank paged through its own folder of the nvme tier.
  EXPECT_TRUE(fs::exists(dir_ / "nvme" / "rank-0"));
  EXPECT_TRUE(fs::exists(dir_ / "nvme" / "rank-1"));
  std::ifstream in(two / "metrics.jsonl");
  std::string line;
  std::getline(in, line);
  EXPECT_GT(nlohmann::json::parse(line)["nvme_bytes"].get<uint64_t>(), 0u) << line;
  expect_close_losses(losses_of(one / "metrics.jsonl"), losses_of(two / "metrics.jsonl"), "moe world 2");
  const ParamDiff d = compare_exports(one / "export", two / "export");
  ASSERT_GT(d.tensors, 0u);
  // The selection bias moves by sign(mean load - load): only global counts keep the ranks (and
  // the single process) on the same routing; a rank-local count sends the weights elsewhere.
  EXPECT_TRUE(d.max_abs <= kParamTol) << "max |diff| " << d.max_abs;
}

// MoE at ZeRO-2 and 3: which experts a rank's tokens reach is its own, so every rank sums every
// expert's gradients (zeros where none of its tokens went) and gathers every expert's weights,
// in one order on all ranks. Top-2 of 4 experts, each rank's micro-batch routed its own way,
// every kind paged through host and nvme: two ranks train what one process trains.
TEST_F(DataParallelTest, MoeAtZeroTwoAndThreeTrainsWhatOneProcessTrains) {
  const std::string moe = ",model_type=mixtral,num_local_experts=4,num_experts_per_tok=2,router_bias_update_rate=0.05";
  const fs::path one = dir_ / "one";
  CmdResult single = testing::run_strata(run_args(one.string(), 2, moe) + " run.export=" + (one / "export").string());
  ASSERT_EQ(single.exit_code, 0) << single.output;
  const std::string tight = " memory.device=3300KiB memory.host=2600KiB memory.nvme.path=" + (dir_ / "nvme").string() +
                            " memory.nvme.size=16MiB memory.offload_activations=true";
  for (int zero : {2, 3}) {
    const std::string name = "moe_zero" + std::to_string(zero);
    const fs::path run = dir_ / name;
    auto ranks = launch(2, run_args(run.string(), 1, moe) + tight + " parallel.zero=" + std::to_string(zero) +
                               " run.export=" + (run / "export").string(),
                        name);
    ASSERT_TRUE(all_ok(ranks)) << all_output(ranks);
    EXPECT_NE(homes_of(ranks[0].output, zero == 3 ? "param" : "grad").find("(this rank's ranges)"), std::string::npos)
        << ranks[0].output;
    std::ifstream in(run / "metrics.jsonl");
    std::string line;
    std::getline(in, line);
    EXPECT_GT(nlohmann::json::parse(line)["nvme_bytes"].get<uint64_t>(), 0u) << line;
    expect_trained_as(one, run, name);
  }
}

// LoRA (train.method=lora): the adapters' gradients are summed over the ranks and their optimizer
// state sharded (ZeRO-1, 2 and 3: gradients, then the compute copies too), the frozen base is left
// alone (every rank reads it from the same random init); the merged export, read from the sharded
// final checkpoint and the base's init, is what one process with the same global batch trains.
TEST_F(DataParallelTest, LoraAdaptersShardedOverTheRanksTrainWhatOneProcessTrains) {
  const std::string lora = " train.method=lora lora.rank=4 lora.alpha=8 run.export_merged=true";
  const fs::path one = dir_ / "one";
  CmdResult single = testing::run_strata(run_args(one.string(), 2) + lora + " run.export=" + (one / "export").string());
  ASSERT_EQ(single.exit_code, 0) << single.output;
  for (int zero : {1, 2, 3}) {
    const std::string name = "lora_zero" + std::to_string(zero);
    const fs::path run = dir_ / name;
    auto ranks = launch(2, run_args(run.string(), 1) + lora + " parallel.zero=" + std::to_string(zero) +
                               " run.export=" + (run / "export").string(),
                        name);
    ASSERT_TRUE(all_ok(ranks)) << all_output(ranks);
    expect_trained_as(one, run, name);
  }
}

// Expert parallelism: each MoE layer's routed rows go to the ranks of their experts and come back
// (model/expert_parallel.h); the dense parts and the gradient sums stay data-parallel over the
// whole world. An expert group of 2 at world 2, groups of 2 and of 4 at world 4 (ZeRO-3 and
// ZeRO-2, paging through the host tier), against one process with the same global batch and its
// global balancing, evaluations included: within the bound, and the same world repeats bit for
// bit.
TEST_F(DataParallelTest, ExpertGroupsTrainWhatOneProcessTrains) {
  const std::string moe = ",model_type=mixtral,num_local_experts=4,num_experts_per_tok=2,router_bias_update_rate=0.05";
  const std::string eval = " data.eval_paths=[" + corpus() + "] train.eval_every=2 train.eval_steps=3";
  const fs::path one = dir_ / "one";
  CmdResult single =
      testing::run_strata(run_args(one.string(), 4, moe) + eval + " run.export=" + (one / "export").string());
  ASSERT_EQ(single.exit_code, 0) << single.output;
  // Tight devices (which hold P times a rank's expert rows: its experts may receive every rank's)
  // that page the state through the host tier on every rank.
  const std::string tight = " memory.device=3400KiB memory.host=2600KiB memory.offload_activations=true";
  struct Case {
    int world, experts;
    std::string name, extra;
  };
  const std::vector<Case> cases = {{2, 2, "ep2", ""},
                                   {2, 2, "ep2_again", ""},
                                   // (ZeRO-3 in line, ZeRO-2 overlapped)
                                   {4, 2, "w4_ep2_zero3", tight + " parallel.zero=3 parallel.overlap_comm=false ckpt.every=4"},
                                   {4, 4, "w4_ep4_zero2", tight + " parallel.zero=2 memory.device=4000KiB"}};
  std::vector<fs::path> runs;
  for (const Case& c : cases) {
    const fs::path run = dir_ / c.name;
    auto ranks = launch(c.world, run_args(run.string(), 4 / c.world, moe) + eval + c.extra +
                                     " parallel.expert_parallel=" + std::to_string(c.experts) +
                                     " run.export=" + (run / "export").string(),
                        c.name);
    ASSERT_TRUE(all_ok(ranks)) << all_output(ranks);
    if (!c.extra.empty()) {
      std::ifstream in(run / "metrics.jsonl");
      std::string line;
      std::getline(in, line);
      EXPECT_GT(nlohmann::json::parse(line)["moved_bytes"].get<uint64_t>(), 0u) << c.name << ": " << line;
    }
    expect_trained_as(one, run, c.name, /*eval=*/true);
    runs.push_back(run);
  }
  EXPECT_EQ(losses_of(runs[0] / "metrics.jsonl"), losses_of(runs[1] / "metrics.jsonl"));
  EXPECT_EQ(compare_exports(runs[0] / "export", runs[1] / "export").max_abs, 0.0);

  // Each rank holds only its experts' state. At ZeRO-1 the compute copy and gradients are whole
  // on every rank: with groups of 2 a rank holds half the experts' (the moments, sliced, are a
  // half either way), so its chunks shrink by at least that half of the experts' fp32 copy and
  // gradients, less a chunk of rounding.
  const fs::path whole = dir_ / "ep1";
  auto w2 = launch(2, run_args(whole.string(), 2, moe), "ep1");
  ASSERT_TRUE(all_ok(w2)) << all_output(w2);
  auto first_state = [](const fs::path& metrics) {
    std::ifstream in(metrics);
    std::string line;
    std::getline(in, line);
    return nlohmann::json::parse(line)["state_bytes"].get<uint64_t>();
  };
  // 2 MoE layers x 4 experts x 3 matrices of 96 x 64 fp32 elements, copy and gradient.
  const uint64_t expert_bytes = 2ull * 4 * 3 * 96 * 64 * 4 * 2;
  for (const char* file : {"metrics.jsonl", "metrics.rank-1.jsonl"}) {
    const uint64_t split = first_state(runs[0] / file), all = first_state(whole / file);
    EXPECT_GE(all, split + expert_bytes / 2 - 64 * 1024) << file << ": " << all << " bytes without expert groups, "
                                                          << split << " with";
  }

  // The plan counts a rank's own experts only: with the host tier holding the state, the host
  // bytes strata plan gives a rank are what the rank's engine holds (the plan prints three
  // significant digits).
  const fs::path paged = dir_ / "ep2_host";
  const std::string host_args = run_args(paged.string(), 2, moe) +
                                " run.device=cpu memory.device=2600KiB memory.host=2600KiB parallel.zero=1 "
                                "parallel.expert_parallel=2";
  auto on_host = launch(2, host_args, "ep2_host");
  ASSERT_TRUE(all_ok(on_host)) << all_output(on_host);
  std::string plan_args = host_args.substr(std::string("train ").size()) + " parallel.world_size=2";
  CmdResult plan = testing::run_strata("plan " + plan_args);
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  // The chosen level's row: "  1*  DEVICE UNIT  HOST UNIT ..."
  const size_t row = plan.output.find("\n  1*");
  ASSERT_NE(row, std::string::npos) << plan.output;
  std::istringstream fields(plan.output.substr(row + 1));
  std::string level, device_value, device_unit, host_value, host_unit;
  fields >> level >> device_value >> device_unit >> host_value >> host_unit;
  Result<uint64_t> planned_host = parse_bytes(host_value + " " + host_unit);
  ASSERT_TRUE(planned_host.ok()) << plan.output;
  const uint64_t engine_host = [&] {
    std::ifstream in(paged / "metrics.jsonl");
    std::string line;
    std::getline(in, line);
    return nlohmann::json::parse(line)["host_bytes"].get<uint64_t>();
  }();
  EXPECT_GT(engine_host, 0u);
  EXPECT_TRUE(std::fabs(static_cast<double>(*planned_host) / static_cast<double>(engine_host) - 1) <= 0.01)
      << "planned " << *planned_host << " host bytes, the engine holds " << engine_host << "\n" << plan.output;

  // The checkpoint of four ranks in expert groups of 2 at ZeRO-3 says how it was written, and
  // resumes on one process, on two ranks without expert groups and on two in one group, each for
  // two more steps alike.
  CmdResult inspect = testing::run_strata("ckpt inspect " + (runs[2] / "checkpoints" / "step-4").string());
  EXPECT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_NE(inspect.output.find("experts split over groups of 2 ranks"), std::string::npos) << inspect.output;
  std::vector<fs::path> resumed;
  for (const auto& [world, experts, name] : std::vector<std::tuple<int, int, std::string>>{
           {1, 1, "resumed1"}, {2, 1, "resumed2"}, {2, 2, "resumed2_ep2"}}) {
    const fs::path run = dir_ / name;
    fs::copy(runs[2], run, fs::copy_options::recursive);
    const std::string args = run_args(run.string(), 4 / world, moe) + eval +
                             " train.steps=6 --resume auto parallel.expert_parallel=" + std::to_string(experts);
    if (world == 1) {
      CmdResult alone = testing::run_strata(args);
      ASSERT_EQ(alone.exit_code, 0) << alone.output;
    } else {
      auto ranks = launch(world, args, name);
      ASSERT_TRUE(all_ok(ranks)) << all_output(ranks);
    }
    ASSERT_EQ(losses_of(run / "metrics.jsonl").size(), 6u) << name;
    resumed.push_back(run);
  }
  expect_close_losses(losses_of(resumed[0] / "metrics.jsonl"), losses_of(resumed[1] / "metrics.jsonl"),
                      "resumed at world 2");
  expect_close_losses(losses_of(resumed[0] / "metrics.jsonl"), losses_of(resumed[2] / "metrics.jsonl"),
                      "resumed at world 2 in one expert group");
}

// What expert parallelism cannot split is refused before training, naming the key.
TEST_F(DataParallelTest, ExpertGroupsThatCannotSplitAreRefusedNamingTheKey) {
  const std::string moe = ",model_type=mixtral,num_local_experts=4,num_experts_per_tok=2";
  CmdResult alone = testing::run_strata(run_args((dir_ / "alone").string(), 1, moe) + " parallel.expert_parallel=2");
  EXPECT_NE(alone.exit_code, 0);
  EXPECT_NE(alone.output.find("parallel.expert_parallel=2 must divide the number of ranks, 1"), std::string::npos)
      << alone.output;
  auto three = launch(2, run_args((dir_ / "three").string(), 1, moe) + " parallel.expert_parallel=3", "three");
  for (const CmdResult& r : three) {
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("parallel.expert_parallel=3 must divide the number of ranks, 2"), std::string::npos)
        << r.output;
  }
  auto dense = launch(2, run_args((dir_ / "dense").string(), 1) + " parallel.expert_parallel=2", "dense");
  for (const CmdResult& r : dense) {
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("this model has none"), std::string::npos) << r.output;
  }
}

// Context parallelism: each sequence split over the ranks of a context group (rank r takes chunks
// r and 2N-1-r of 2N), attention as a ring between them. The global batch is one process's, so
// the losses, eval losses and weights are its within the bounds above (attention's sums run in
// other blocks and the ranks' gradients add in rank order). Groups of 2 and 4, alone and beside
// data parallelism (world 4 as 2 groups of 2), dense and MoE, one under tight budgets through the
// host tier with the layer checkpoints offloaded. The weights' bound is looser than data
// parallelism's: every attention gradient's sums run in another order too, and AdamW's steps
// divide by the gradients' own size, so an element whose gradient nearly cancels moves by more
// (1.1e-5 seen). A ring that got a block or a position wrong moves the losses by far more than
// their bound, and the weights by about lr = 3e-3 a step.
TEST_F(DataParallelTest, ContextGroupsTrainWhatOneProcessTrains) {
  constexpr double kContextParamTol = 5e-5;
  const std::string moe = ",model_type=mixtral,num_local_experts=4,num_experts_per_tok=2,router_bias_update_rate=0.05";
  const std::string eval = " data.eval_paths=[" + corpus() + "] train.eval_every=2 train.eval_steps=3";
  for (const std::string& model : {std::string(), moe}) {
    const std::string kind = model.empty() ? "dense" : "moe";
    const fs::path one = dir_ / ("cp_one_" + kind);
    CmdResult single =
        testing::run_strata(run_args(one.string(), 4, model) + eval + " run.export=" + (one / "export").string());
    ASSERT_EQ(single.exit_code, 0) << single.output;
    struct Case {
      int world, context;
      std::string extra;
    };
    std::vector<Case> cases = {{2, 2, ""}, {4, 2, ""}};
    if (model.empty()) {
      cases.push_back({4, 4, ""});
      cases.push_back({2, 2, " memory.device=1MiB memory.host=8MiB memory.offload_activations=true"});
    }
    for (const Case& c : cases) {
      const std::string name = fmt::format("cp_{}_w{}_cp{}{}", kind, c.world, c.context, c.extra.empty() ? "" : "_tight");
      const fs::path run = dir_ / name;
      const int accum = 4 * c.context / c.world;  // the global batch: 4 micro-batches
      auto ranks = launch(c.world, run_args(run.string(), accum, model) + eval + c.extra +
                                       " parallel.context_parallel=" + std::to_string(c.context) +
                                       " run.export=" + (run / "export").string(),
                          name);
      ASSERT_TRUE(all_ok(ranks)) << all_output(ranks);
      EXPECT_NE(ranks[0].output.find(fmt::format("x {} context groups of {} ranks", c.world / c.context, c.context)),
                std::string::npos)
          << ranks[0].output;
      if (!c.extra.empty()) {  // the tight budgets paged the state
        std::ifstream in(run / "metrics.jsonl");
        std::string line;
        std::getline(in, line);
        EXPECT_GT(nlohmann::json::parse(line)["moved_bytes"].get<uint64_t>(), 0u) << name << ": " << line;
      }
      expect_trained_as(one, run, name, /*eval=*/true, kContextParamTol);
    }
  }
}

TEST_F(DataParallelTest, ContextGroupsThatCannotSplitAreRefusedNamingTheKey) {
  struct Case {
    int world;
    std::string args, model, message;
  };
  const std::string moe = ",model_type=mixtral,num_local_experts=4,num_experts_per_tok=2";
  const std::vector<Case> cases = {
      {1, " parallel.context_parallel=2", "", "parallel.context_parallel=2 must divide the number of ranks, 1"},
      {2, " parallel.context_parallel=2 train.seq_len=30", "", "train.seq_len=30 must be a multiple of 4"},
      {2, " parallel.context_parallel=2 data.packing=document data.eos_id=0", "",
       "parallel.context_parallel=2 with data.packing=document"},
      {2, " parallel.context_parallel=2 parallel.expert_parallel=2", moe, "with parallel.expert_parallel=2"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const std::string name = "cp_refused_" + std::to_string(i);
    const std::string args = run_args((dir_ / name).string(), 1, c.model) + c.args;
    std::vector<CmdResult> results =
        c.world == 1 ? std::vector<CmdResult>{testing::run_strata(args)} : launch(c.world, args, name);
    for (const CmdResult& r : results) {
      EXPECT_NE(r.exit_code, 0) << name;
      EXPECT_NE(r.output.find(c.message), std::string::npos) << name << ": " << r.output;
    }
  }
}

// ZeRO-2: each rank keeps only its ranges of the gradients' sums, beside its ranges of the master
// weights and moments; backward writes a layer's full gradients into a workspace, and each
// range is summed onto its rank as backward ends (micro-batch by micro-batch). At worlds 2 and 4,
// under tight budgets through host and nvme on every rank, the losses and weights are one
// process's within the bound, and the same world repeats bit for bit. A checkpoint it writes
// resumes at ZeRO-1.
TEST_F(DataParallelTest, ZeroTwoShardsTheGradientsAndTrainsWhatOneProcessTrains) {
  // Four layers: a rank's share of two would fit the host at world 4 (its slices share chunks).
  const std::string layers = ",num_hidden_layers=4";
  const fs::path one = dir_ / "one";
  CmdResult single =
      testing::run_strata(run_args(one.string(), 4, layers) + " run.export=" + (one / "export").string());
  ASSERT_EQ(single.exit_code, 0) << single.output;
  const std::string tight = " parallel.zero=2 memory.device=1400KiB memory.host=1300KiB memory.nvme.path=" +
                            (dir_ / "nvme").string() + " memory.nvme.size=16MiB";
  std::vector<fs::path> runs;
  for (const auto& [world, name] : {std::pair{2, "two"}, std::pair{4, "four"}, std::pair{2, "two_again"}}) {
    const fs::path run = dir_ / name;
    auto ranks = launch(world, run_args(run.string(), 4 / world, layers) + tight + " ckpt.every=4 run.export=" +
                                   (run / "export").string(),
                        name);
    ASSERT_TRUE(all_ok(ranks)) << all_output(ranks);
    EXPECT_NE(homes_of(ranks[0].output, "grad").find("(this rank's ranges)"), std::string::npos) << ranks[0].output;
    std::ifstream in(run / "metrics.jsonl");
    std::string line;
    std::getline(in, line);
    EXPECT_GT(nlohmann::json::parse(line)["nvme_bytes"].get<uint64_t>(), 0u) << line;
    expect_trained_as(one, run, name);
    runs.push_back(run);
  }
  EXPECT_EQ(losses_of(runs[0] / "metrics.jsonl"), losses_of(runs[2] / "metrics.jsonl"));
  EXPECT_EQ(compare_exports(runs[0] / "export", runs[2] / "export").max_abs, 0.0);
  // Tied embeddings (their gradients taken at the head and at the embedding, summed once a
  // micro-batch) with evaluations, against one process.
  const std::string tied = ",tie_word_embeddings=true";
  const std::string eval = " data.eval_paths=[" + corpus() + "] train.eval_every=2 train.eval_steps=2";
  const fs::path one_tied = dir_ / "one_tied", two_tied = dir_ / "two_tied";
  CmdResult single_tied = testing::run_strata(run_args(one_tied.string(), 4, tied) + eval + " run.export=" +
                                              (one_tied / "export").string());
  ASSERT_EQ(single_tied.exit_code, 0) << single_tied.output;
  auto w2 = launch(2, run_args(two_tied.string(), 2, tied) + eval + tight + " run.export=" + (two_tied / "export").string(),
                   "tied");
  ASSERT_TRUE(all_ok(w2)) << all_output(w2);
  expect_trained_as(one_tied, two_tied, "tied", /*eval=*/true);
  // The checkpoint of world 4 at ZeRO-2 resumes on 2 ranks at ZeRO-1 for two more steps.
  auto resumed =
      launch(2, run_args(runs[1].string(), 2, layers) + " train.steps=6 parallel.zero=1 --resume auto", "resume");
  ASSERT_TRUE(all_ok(resumed)) << all_output(resumed);
  EXPECT_EQ(losses_of(runs[1] / "metrics.jsonl").size(), 6u);
}

// ZeRO-3: the compute copy is sliced too, each group's whole copy gathered from the ranks into a
// workspace for every batch that computes with it. In the bf16 and fp8 recipes (fp8 matrices are
// owned whole by one rank, which sends them whole), at worlds 2 and 4, with every kind paged
// through host and nvme on every rank, training matches one process within the bound and
// repeats bit for bit; tied embeddings with evaluations too. A checkpoint of 4 ranks at ZeRO-3
// resumes on 3 ranks at ZeRO-3 and on one process.
TEST_F(DataParallelTest, ZeroThreeGathersTheWeightsAndTrainsWhatOneProcessTrains) {
  // Four layers: a rank's share of two would fit the host at world 4 (its slices share chunks).
  const std::string tight = " parallel.zero=3 memory.device=1100KiB memory.host=1000KiB memory.nvme.path=" +
                            (dir_ / "nvme").string() + " memory.nvme.size=16MiB";
  const std::string layers = ",num_hidden_layers=4";
  for (const char* precision : {"bf16", "fp8"}) {
    const std::string recipe = std::string(" train.precision=") + precision;
    const fs::path one = dir_ / (std::string("one_") + precision);
    CmdResult single =
        testing::run_strata(run_args(one.string(), 4, layers) + recipe + " run.export=" + (one / "export").string());
    ASSERT_EQ(single.exit_code, 0) << single.output;
    std::vector<std::pair<int, std::string>> worlds = {{2, "two"}, {2, "two_again"}};
    if (std::string(precision) == "bf16") worlds.push_back({4, "four"});
    std::vector<fs::path> runs;
    for (const auto& [world, name] : worlds) {
      const fs::path run = dir_ / (name + "_" + precision);
      auto ranks = launch(world, run_args(run.string(), 4 / world, layers) + recipe + tight +
                                     " ckpt.every=4 run.export=" + (run / "export").string(),
                          name + precision);
      ASSERT_TRUE(all_ok(ranks)) << all_output(ranks);
      EXPECT_NE(homes_of(ranks[0].output, "param").find("(this rank's ranges)"), std::string::npos) << ranks[0].output;
      std::ifstream in(run / "metrics.jsonl");
      std::string line;
      std::getline(in, line);
      EXPECT_GT(nlohmann::json::parse(line)["nvme_bytes"].get<uint64_t>(), 0u) << line;
      expect_trained_as(one, run, name + " " + precision);
      runs.push_back(run);
    }
    EXPECT_EQ(losses_of(runs[0] / "metrics.jsonl"), losses_of(runs[1] / "metrics.jsonl")) << precision;
    EXPECT_EQ(compare_exports(runs[0] / "export", runs[1] / "export").max_abs, 0.0) << precision;
    if (std::string(precision) != "bf16") continue;
    // The checkpoint of world 4 resumes on 3 ranks at ZeRO-3, and on one process with the same
    // global batch (3 micro-batches), for two more steps.
    const fs::path four = runs[2], three = dir_ / "three";
    fs::copy(four, three, fs::copy_options::recursive);
    auto resumed =
        launch(3, run_args(three.string(), 1, layers) + recipe + tight + " train.steps=6 --resume auto", "resume3");
    ASSERT_TRUE(all_ok(resumed)) << all_output(resumed);
    CmdResult alone = testing::run_strata(run_args(four.string(), 3, layers) + recipe + " train.steps=6 --resume auto");
    ASSERT_EQ(alone.exit_code, 0) << alone.output;
    const std::vector<double> l3 = losses_of(three / "metrics.jsonl"), l1 = losses_of(four / "metrics.jsonl");
    ASSERT_EQ(l3.size(), 6u);
    ASSERT_EQ(l1.size(), 6u);
    expect_close_losses(l1, l3, "resumed at world 3 against world 1");
  }
  // Tied embeddings (gathered at the head and at the embedding) with evaluations of 3
  // micro-batches over 2 ranks: the rank without one of its own in the last round gathers with
  // the other all the same.
  const std::string tied = ",tie_word_embeddings=true";
  const std::string eval = " data.eval_paths=[" + corpus() + "] train.eval_every=2 train.eval_steps=3";
  const fs::path one_tied = dir_ / "one_tied", two_tied = dir_ / "two_tied";
  CmdResult single_tied = testing::run_strata(run_args(one_tied.string(), 4, tied) + eval + " run.export=" +
                                              (one_tied / "export").string());
  ASSERT_EQ(single_tied.exit_code, 0) << single_tied.output;
  auto w2 = launch(2, run_args(two_tied.string(), 2, tied) + eval + tight + " memory.device=1400KiB run.export=" +
                       (two_tied / "export").string(),
                   "tied3");
  ASSERT_TRUE(all_ok(w2)) << all_output(w2);
  expect_trained_as(one_tied, two_tied, "tied", /*eval=*/true);
}


// "1.51M parameters", as the run's log counts them.
std::string fmt_millions(double parameters) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2fM parameters", parameters / 1e6);
  return text;
}

// Every step line of a metrics file, parsed.
std::vector<nlohmann::json> step_lines(const fs::path& metrics) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("step") && j.contains("state_bytes")) out.push_back(std::move(j));
  }
  return out;
}

// Sharding is real at ZeRO-3: a model whose training state (26 MiB in the bf16 recipe) is more
// than one process's memory.host + memory.nvme (10 MiB) trains over four ranks, each holding its
// ranges of every tensor through device, host and nvme; the one process is refused before its
// first step, naming what does not fit.
//
// Each rank writes its own metrics (metrics.jsonl, metrics.rank-N.jsonl). At every step its tiers
// stay inside its budgets and its resident memory inside its planned peak, and the state it holds
// (state_bytes: its chunks, each once wherever it lives) is its share: together the four are the
// whole within 5% (the chunks' padding), and each is a quarter within the bounds below. Why not
// 5% each: a tensor of fewer than 4 x 256 elements (the norms, 64 here) is the last rank's whole,
// which gives it 1.7% more than a quarter at this width, and slices pack into chunks sized for
// whole tensors, where one that does not fit the rest of a chunk leaves that rest empty (at most
// a quarter-tensor per chunk).
TEST_F(DataParallelTest, ZeroThreeOnFourRanksHoldsAQuarterEachOfWhatOneProcessCannotHold) {
  const std::string budgets =
      " train.precision=bf16 memory.device=2MiB memory.host=2MiB memory.nvme.size=8MiB memory.chunk_size=48KiB "
      "run.device=cpu train.steps=2";
  const std::string model = ",num_hidden_layers=48";
  const fs::path one = dir_ / "one", four = dir_ / "four";
  CmdResult single = testing::run_strata(run_args(one.string(), 4, model) + budgets + " memory.nvme.path=" +
                                         (dir_ / "nvme_one").string());
  EXPECT_EQ(single.exit_code, 1) << single.output;
  EXPECT_NE(single.output.find("the state does not fit: the "), std::string::npos) << single.output;
  EXPECT_FALSE(fs::exists(one / "metrics.jsonl"));

  auto ranks = launch(4, run_args(four.string(), 1, model) + budgets + " parallel.zero=3 memory.nvme.path=" +
                             (dir_ / "nvme").string(),
                      "quarter");
  ASSERT_TRUE(all_ok(ranks)) << all_output(ranks);
  // The whole state: 18 bytes a parameter (bf16 copy, fp32 gradient, master and both moments) of
  // 48 layers (two norms of 64, q and o 64 x 64, k and v 32 x 64, three MLP matrices 64 x 96),
  // the embedding and the head (256 x 64 each) and the final norm.
  const double parameters = 48.0 * (2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 96) + 2 * 256 * 64 + 64;
  EXPECT_NE(ranks[0].output.find(fmt_millions(parameters)), std::string::npos) << ranks[0].output;
  const double quarter = parameters * 18 / 4;
  double sum = 0;
  for (int r = 0; r < 4; ++r) {
    const fs::path metrics = four / (r == 0 ? std::string("metrics.jsonl") : "metrics.rank-" + std::to_string(r) + ".jsonl");
    const std::vector<nlohmann::json> steps = step_lines(metrics);
    ASSERT_EQ(steps.size(), 2u) << metrics;
    for (const nlohmann::json& j : steps) {
      EXPECT_LE(j["device_bytes"].get<uint64_t>(), 2u << 20) << "rank " << r << ": " << j.dump();
      EXPECT_LE(j["host_bytes"].get<uint64_t>(), 2u << 20) << "rank " << r << ": " << j.dump();
      EXPECT_LE(j["nvme_bytes"].get<uint64_t>(), 8u << 20) << "rank " << r << ": " << j.dump();
      if (!testing::kSanitized)
        EXPECT_LE(j["rss_bytes"].get<uint64_t>(), j["rss_planned_bytes"].get<uint64_t>()) << "rank " << r << ": " << j.dump();
      const double share = static_cast<double>(j["state_bytes"].get<uint64_t>()) / quarter;
      // The norms (one shard unit each) go round the ranks, and the slices (up to 6 KiB) fill
      // each 48 KiB chunk but for its tail, where a kind moves to another tier, and its end.
      EXPECT_TRUE(share >= 0.99 && share <= 1.05) << "rank " << r << " holds " << share << " of a quarter";
    }
    sum += static_cast<double>(steps.back()["state_bytes"].get<uint64_t>());
  }
  EXPECT_TRUE(sum / (4 * quarter) <= 1.05 && sum / (4 * quarter) >= 1.0)
      << "the ranks hold " << sum / (4 * quarter) << " of the whole";
}

// Sharding is real: with budgets one process cannot fit its state into (no nvme tier), four
// ranks at ZeRO-1 train, each holding a quarter of the master weights and moments. The single
// process is refused before its first step, naming the budget and what it would need; rank 0's
// host tier stays inside that budget at every step.
TEST_F(DataParallelTest, ZeroOneOnFourRanksTrainsWhatOneProcessCannotHoldInTheSameBudgets) {
  const std::string budgets =
      " train.precision=bf16 memory.device=1MiB memory.host=4608KiB memory.nvme.path= run.device=cpu";
  const std::string model = ",num_hidden_layers=8";
  const fs::path one = dir_ / "one", four = dir_ / "four";
  CmdResult single = testing::run_strata(run_args(one.string(), 4, model) + budgets);
  EXPECT_EQ(single.exit_code, 1) << single.output;
  EXPECT_NE(single.output.find("the state does not fit: the host budget 4.50 MiB cannot hold"), std::string::npos)
      << single.output;
  auto w4 = launch(4, run_args(four.string(), 1, model) + budgets, "sharded");
  ASSERT_TRUE(all_ok(w4)) << all_output(w4);
  expect_host_within(four / "metrics.jsonl", 4608u << 10, 4);
}

TEST_F(DataParallelTest, CheckpointOfFourRanksResumesOnOneTwoThreeAndFour) {
  const fs::path four = dir_ / "four";
  auto w4 = launch(4, run_args(four.string(), 1) + " ckpt.every=2", "w4");
  ASSERT_TRUE(all_ok(w4)) << all_output(w4);
  const auto expected = losses_of(four / "metrics.jsonl");
  ASSERT_EQ(expected.size(), 4u);
  const std::string step2 = (four / "checkpoints" / "step-2").string();
  CmdResult verify = testing::run_strata("ckpt verify " + step2);
  ASSERT_EQ(verify.exit_code, 0) << verify.output;
  // Each rank wrote its own share, no rank the whole state, under one manifest.
  for (int r = 0; r < 4; ++r) {
    char name[64];
    std::snprintf(name, sizeof name, "model.rank-%05d-of-00004.safetensors", r);
    EXPECT_TRUE(fs::exists(fs::path(step2) / name)) << name;
    std::snprintf(name, sizeof name, "optimizer.rank-%05d-of-00004.safetensors", r);
    EXPECT_TRUE(fs::exists(fs::path(step2) / name)) << name;
  }
  EXPECT_FALSE(fs::exists(fs::path(step2) / "model.safetensors"));
  CmdResult inspect = testing::run_strata("ckpt inspect " + step2);
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_NE(inspect.output.find("written as       sharded over 4 ranks by element ranges"), std::string::npos)
      << inspect.output;
  // The shares are even: each rank's files within 5% of a quarter of the four together.
  for (const char* stem : {"model", "optimizer"}) {
    const std::vector<uint64_t> bytes = shard_bytes(step2, stem, 4);
    const double quarter = static_cast<double>(bytes[0] + bytes[1] + bytes[2] + bytes[3]) / 4;
    for (uint64_t b : bytes) EXPECT_TRUE(std::fabs(static_cast<double>(b) - quarter) <= 0.05 * quarter) << stem << " " << b;
  }
  // It exports to Hugging Face like any checkpoint, tensor by tensor.
  CmdResult convert = testing::run_strata("convert --from " + step2 + " --to " + (dir_ / "hf").string());
  ASSERT_EQ(convert.exit_code, 0) << convert.output;
  EXPECT_TRUE(fs::exists(dir_ / "hf" / "model.safetensors"));

  // The same world size resumes bit for bit.
  const fs::path again = dir_ / "again";
  auto r4 = launch(4, run_args(again.string(), 1) + " --resume " + step2, "r4");
  ASSERT_TRUE(all_ok(r4)) << all_output(r4);
  const auto l4 = losses_of(again / "metrics.jsonl");
  ASSERT_EQ(l4.size(), 2u);
  EXPECT_EQ(l4[0], expected[2]);
  EXPECT_EQ(l4[1], expected[3]);

  // One process with the same global batch continues it (within the bound: see the file comment).
  const fs::path one = dir_ / "one";
  CmdResult r1 = testing::run_strata(run_args(one.string(), 4) + " --resume " + step2);
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  expect_close_losses({expected[2], expected[3]}, losses_of(one / "metrics.jsonl"), "world 1 from world 4");

  // Three ranks split every tensor in three; 1 x 3 micro-batches of 2 sequences is
  // another global batch (6 sequences), so this only shows that the run continues from the
  // state world 4 left, its loss near world 4's.
  const fs::path three = dir_ / "three";
  auto r3 = launch(3, run_args(three.string(), 1) + " --resume " + step2 + " ckpt.every=1", "r3");
  ASSERT_TRUE(all_ok(r3)) << all_output(r3);
  const auto l3 = losses_of(three / "metrics.jsonl");
  ASSERT_EQ(l3.size(), 2u);
  EXPECT_TRUE(std::fabs(l3[0] - expected[2]) <= 0.05 * expected[2]) << l3[0] << " vs " << expected[2];
  CmdResult verify3 = testing::run_strata("ckpt verify " + (three / "checkpoints" / "step-4").string());
  EXPECT_EQ(verify3.exit_code, 0) << verify3.output;

  // Two ranks of two micro-batches each: the same global batch again.
  const fs::path two = dir_ / "two";
  auto r2 = launch(2, run_args(two.string(), 2) + " --resume " + step2, "r2");
  ASSERT_TRUE(all_ok(r2)) << all_output(r2);
  expect_close_losses({expected[2], expected[3]}, losses_of(two / "metrics.jsonl"), "world 2 from world 4");
}

// A rank that cannot start (here: a budget its node refuses) stops every rank before the first
// step with one error each; rank 0 names the rank, and no run folder is left behind.
TEST_F(DataParallelTest, ARankThatCannotStartStopsTheOthersBeforeTheFirstStep) {
  const fs::path run = dir_ / "run";
  auto results = launch(2, run_args(run.string(), 1), "start", "");
  ASSERT_TRUE(all_ok(results)) << all_output(results);  // the same launch works as given
  fs::remove_all(run);
  // Rank 1 alone gets a device budget too small for one layer.
  std::vector<CmdResult> rs(2);
  std::vector<std::thread> threads;
  const std::string rdzv = (dir_ / "rendezvous").string();
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      const fs::path log = dir_ / ("bad.rank" + std::to_string(r) + ".log");
      const std::string cmd = "RANK=" + std::to_string(r) +
                              " WORLD_SIZE=2 LOCAL_RANK=" + std::to_string(r) +
                              " LOCAL_WORLD_SIZE=2 TORCHELASTIC_RUN_ID=bad " + std::string(STRATA_BINARY_DIR) +
                              "/strata " + run_args(run.string(), 1) + (r == 1 ? " memory.device=64KiB" : "") +
                              " parallel.rendezvous=" + rdzv + " parallel.timeout_s=30 > " + log.string() + " 2>&1";
      const int status = std::system(cmd.c_str());
      rs[static_cast<size_t>(r)].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      rs[static_cast<size_t>(r)].output = read_text(log);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(rs[0].exit_code, 1) << all_output(rs);
  EXPECT_EQ(rs[1].exit_code, 1) << all_output(rs);
  EXPECT_NE(rs[0].output.find("rank 1 failed to start"), std::string::npos) << rs[0].output;
  EXPECT_NE(rs[1].output.find("memory.device"), std::string::npos) << rs[1].output;
  EXPECT_FALSE(fs::exists(run / "metrics.jsonl"));
}

// Two ranks of `args` started in the background, each logging to dir_/NAME.rankR.log; their pids.
std::vector<int> start_two_ranks(const fs::path& dir, const std::string& args, const std::string& name) {
  std::vector<int> pids(2, 0);
  const std::string rdzv = (dir / ("rendezvous-" + name)).string();
  for (int r = 0; r < 2; ++r) {
    const fs::path log = dir / (name + ".rank" + std::to_string(r) + ".log");
    const std::string cmd = "RANK=" + std::to_string(r) + " WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 TORCHELASTIC_RUN_ID=" +
                            name + " " + std::string(STRATA_BINARY_DIR) + "/strata " + args + " parallel.rendezvous=" +
                            rdzv + " parallel.timeout_s=10 > " + log.string() + " 2>&1 & echo $!";
    FILE* p = popen(cmd.c_str(), "r");
    if (p == nullptr || fscanf(p, "%d", &pids[static_cast<size_t>(r)]) != 1) ADD_FAILURE() << "could not start " << cmd;
    if (p != nullptr) pclose(p);
  }
  return pids;
}

// Waits (at most 40 s) for process `pid` to end; the seconds it took.
double wait_for_exit(int pid) {
  const auto start = std::chrono::steady_clock::now();
  for (int waited = 0; kill(pid, 0) == 0 && waited < 400; ++waited) {
    waitpid(pid, nullptr, WNOHANG);
    usleep(100 * 1000);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Once the run in `run` has a checkpoint, `stop` is done to rank 1 (SIGKILL: it dies; SIGSTOP:
// it hangs); rank 0 must exit within the timeout with one error naming itself and rank 1. The
// last committed checkpoint then verifies, and one process resumes from it for a step.
void expect_stopped_rank_stops_the_other(const fs::path& dir, const fs::path& run, const std::string& args,
                                         const std::string& resume_args, const std::string& name, int stop,
                                         const std::vector<std::string>& any_of) {
  const std::vector<int> pids = start_two_ranks(dir, args, name);
  // Whatever fails below, neither rank is left running (or stopped).
  struct KillOnExit {
    const std::vector<int>& pids;
    ~KillOnExit() {
      for (int pid : pids) {
        if (pid <= 0) continue;
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, WNOHANG);
      }
    }
  } kill_on_exit{pids};
  const fs::path latest = run / "checkpoints" / "latest";
  for (int i = 0; i < 600 && !fs::exists(latest); ++i) usleep(100 * 1000);
  const std::string log0_path = (dir / (name + ".rank0.log")).string();
  ASSERT_TRUE(fs::exists(latest)) << read_text(log0_path) << read_text(dir / (name + ".rank1.log"));
  ASSERT_EQ(kill(pids[1], stop), 0);
  const double seconds = wait_for_exit(pids[0]);
  const std::string log0 = read_text(log0_path);
  kill(pids[1], SIGKILL);  // a stopped rank is killed now
  waitpid(pids[1], nullptr, WNOHANG);
  ASSERT_NE(kill(pids[0], 0), 0) << "rank 0 still runs " << seconds << " s after rank 1 was stopped\n" << log0;
  EXPECT_LT(seconds, 30.0) << log0;
  EXPECT_NE(log0.find("rank 0 of 2"), std::string::npos) << log0;
  bool named = false;
  for (const std::string& s : any_of) named = named || log0.find(s) != std::string::npos;
  EXPECT_TRUE(named) << log0;

  std::string checkpoint = read_text(latest);
  while (!checkpoint.empty() && std::isspace(static_cast<unsigned char>(checkpoint.back()))) checkpoint.pop_back();
  const int64_t saved = std::stoll(checkpoint.substr(checkpoint.find('-') + 1));
  CmdResult verify = testing::run_strata("ckpt verify " + (run / "checkpoints" / checkpoint).string());
  EXPECT_EQ(verify.exit_code, 0) << verify.output;
  CmdResult resumed =
      testing::run_strata(resume_args + " train.steps=" + std::to_string(saved + 1) + " ckpt.every=2 --resume auto");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("done: " + std::to_string(saved + 1) + " steps"), std::string::npos) << resumed.output;
}

TEST_F(DataParallelTest, AKilledRankStopsTheOthersWithAMessageAndTheLastCheckpointResumes) {
  const fs::path run = dir_ / "run";
  // One error naming this rank, the collective that failed and the rank that went away.
  expect_stopped_rank_stops_the_other(dir_, run, run_args(run.string(), 1) + " train.steps=100000 ckpt.every=2",
                                      run_args(run.string(), 2), "kill", SIGKILL,
                                      {"rank 1 of 2 closed its connection"});
  EXPECT_NE(read_text(dir_ / "kill.rank0.log").find("see rank 1's log"), std::string::npos);
}

// ZeRO-3 with MoE layers, where most collectives are the weights' gathers (every expert's too):
// a rank killed, then in another run a rank that hangs (stopped), makes the other exit naming
// the operation it was in (a gather, the sums onto the ranks' ranges, or, where the stop falls
// between batches, a checkpoint's or a step's agreement of a few bytes: an all_gather), and the
// last checkpoint resumes on one process.
TEST_F(DataParallelTest, ARankThatDiesOrHangsAtZeroThreeStopsTheOtherNamingTheOperation) {
  const std::string moe = ",model_type=mixtral,num_local_experts=4,num_experts_per_tok=2";
  for (const auto& [stop, name] : {std::pair{SIGKILL, "dies"}, std::pair{SIGSTOP, "hangs"}}) {
    const fs::path run = dir_ / name;
    expect_stopped_rank_stops_the_other(
        dir_, run, run_args(run.string(), 1, moe) + " parallel.zero=3 train.steps=100000 ckpt.every=2",
        run_args(run.string(), 2, moe), name, stop,
        {"gathering the weights of parameter group", "the gradients of parameter group", "checkpoint of step",
         "all_gather of"});
    const std::string log0 = read_text(dir_ / (std::string(name) + ".rank0.log"));
    EXPECT_NE(log0.find(stop == SIGKILL ? "rank 1 of 2 closed its connection" : "rank 1 of 2 may have exited or hung"),
              std::string::npos)
        << log0;
  }
}

// Expert parallelism: most of a step's collectives are its token exchanges, so a rank stopped
// mid-run usually leaves the other inside one (or in a gradient sum or a checkpoint's agreement);
// it exits naming the operation and the rank, the checkpoint verifies and one process resumes it.
TEST_F(DataParallelTest, ARankThatDiesOrHangsInAnExpertExchangeStopsTheOtherNamingTheOperation) {
  const std::string moe = ",model_type=mixtral,num_local_experts=4,num_experts_per_tok=2";
  for (const auto& [stop, name] : {std::pair{SIGKILL, "ep_dies"}, std::pair{SIGSTOP, "ep_hangs"}}) {
    const fs::path run = dir_ / name;
    expect_stopped_rank_stops_the_other(
        dir_, run, run_args(run.string(), 1, moe) + " parallel.expert_parallel=2 train.steps=100000 ckpt.every=2",
        run_args(run.string(), 2, moe), name, stop,
        {"routed tokens to their experts' ranks", "the experts' outputs to their tokens' ranks",
         "output gradients to their experts' ranks", "input gradients to their tokens' ranks",
         "routed rows per expert", "the gradients of parameter group", "the updated weights of parameter group",
         "checkpoint of step", "all_gather of"});
    const std::string log0 = read_text(dir_ / (std::string(name) + ".rank0.log"));
    EXPECT_NE(log0.find(stop == SIGKILL ? "closed its connection" : "may have exited or hung"), std::string::npos)
        << log0;
  }
}

}  // namespace
}  // namespace strata
