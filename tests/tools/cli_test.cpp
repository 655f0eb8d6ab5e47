// The strata command end to end: bad inputs fail with one clear line and leave nothing
// half-written; runs are bitwise reproducible; the loss falls.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/units.h"
#include "tools/cli_util.h"
#include "train/planning.h"

namespace {

namespace fs = std::filesystem;

using strata::testing::CmdResult;
using strata::testing::run_strata;

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::testing::fresh_test_dir("strata_cli");
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write_file(const std::string& name, const std::string& content) {
    fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary) << content;
    return p.string();
  }
  // A small text corpus any test can train on.
  std::string corpus() {
    std::string text;
    for (int i = 0; i < 200; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
    return write_file("corpus.txt", text);
  }
  std::string small_run(const std::string& run_dir) {
    return "data.paths=[" + corpus() + "] run.dir=" + run_dir +
           " train.micro_batch=2 train.seq_len=32 train.steps=6 optim.warmup_steps=2 "
           "'model.set=[num_hidden_layers=2,hidden_size=64,intermediate_size=96]'";
  }
  // The failed run left no metrics behind, and said what went wrong on one error line.
  void expect_clean_failure(const CmdResult& r, const std::string& run_dir, const std::vector<std::string>& words) {
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_FALSE(fs::exists(fs::path(run_dir) / "metrics.jsonl")) << "a failed run wrote metrics";
    int error_lines = 0;
    std::istringstream lines(r.output);
    for (std::string line; std::getline(lines, line);)
      if (line.find("error:") != std::string::npos) ++error_lines;
    EXPECT_EQ(error_lines, 1) << r.output;
    for (const auto& w : words) EXPECT_NE(r.output.find(w), std::string::npos) << "missing '" << w << "' in:\n" << r.output;
  }

  fs::path dir_;
};

std::vector<std::string> losses_of(const fs::path& metrics) {
  std::vector<std::string> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("event")) continue;  // not a step (the run's goodput)
    out.push_back(j["loss"].dump());  // the exact digits written
  }
  return out;
}

TEST_F(CliTest, HelpListsCommandsAndSettings) {
  CmdResult top = run_strata("--help");
  EXPECT_EQ(top.exit_code, 0);
  EXPECT_NE(top.output.find("train"), std::string::npos);
  CmdResult train = run_strata("train --help");
  EXPECT_EQ(train.exit_code, 0);
  EXPECT_NE(train.output.find("optim.lr"), std::string::npos) << train.output;
  EXPECT_NE(train.output.find("data.paths"), std::string::npos);
  EXPECT_EQ(run_strata("frobnicate").exit_code, 2);
}

TEST_F(CliTest, MissingDataFileIsNamed) {
  std::string run_dir = (dir_ / "run").string();
  std::string missing = (dir_ / "nope" / "train_000.bin").string();
  CmdResult r = run_strata("train data.paths=[" + missing + "] run.dir=" + run_dir);
  expect_clean_failure(r, run_dir, {missing});
}

TEST_F(CliTest, WrongMagicIsNamed) {
  std::vector<int32_t> header(256, 0);
  header[0] = 12345;
  header[1] = 1;
  header[2] = 10;
  std::string bytes(reinterpret_cast<const char*>(header.data()), header.size() * 4);
  bytes += std::string(20, '\0');
  std::string shard = write_file("bad_magic.bin", bytes);
  std::string run_dir = (dir_ / "run").string();
  CmdResult r = run_strata("train data.format=llmc data.paths=[" + shard + "] run.dir=" + run_dir);
  expect_clean_failure(r, run_dir, {"bad_magic.bin", "magic"});
}

TEST_F(CliTest, TruncatedShardIsNamed) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = 100000;  // claims far more tokens than follow
  std::string bytes(reinterpret_cast<const char*>(header.data()), header.size() * 4);
  bytes += std::string(1000, '\1');
  std::string shard = write_file("short.bin", bytes);
  std::string run_dir = (dir_ / "run").string();
  CmdResult r = run_strata("train data.paths=[" + shard + "] run.dir=" + run_dir);
  expect_clean_failure(r, run_dir, {"short.bin", "truncated"});
}

TEST_F(CliTest, ConfigTypoNamesFileLineAndKey) {
  std::string run_dir = (dir_ / "run").string();
  std::string cfg = write_file("run.yaml", "train:\n  steps: 3\noptim:\n  lrr: 0.1\nrun:\n  dir: " + run_dir + "\n");
  CmdResult r = run_strata("train " + cfg);
  expect_clean_failure(r, run_dir, {"run.yaml:4", "optim.lrr", "optim.lr"});
  EXPECT_FALSE(fs::exists(run_dir));
}

TEST_F(CliTest, HeadsNotDividingHiddenSizeIsNamed) {
  std::string run_dir = (dir_ / "run").string();
  std::string model = write_file("config.json", R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 256,
    "hidden_size": 100, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 3,
    "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0})");
  CmdResult r = run_strata("train model.config=" + model + " data.paths=[" + corpus() + "] run.dir=" + run_dir);
  expect_clean_failure(r, run_dir, {"config.json", "num_attention_heads"});
  EXPECT_FALSE(fs::exists(run_dir));
}

TEST_F(CliTest, SameSeedGivesBitwiseIdenticalLosses) {
  std::string a = (dir_ / "a").string(), b = (dir_ / "b").string();
  CmdResult ra = run_strata("train " + small_run(a));
  ASSERT_EQ(ra.exit_code, 0) << ra.output;
  CmdResult rb = run_strata("train " + small_run(b));
  ASSERT_EQ(rb.exit_code, 0) << rb.output;
  auto la = losses_of(fs::path(a) / "metrics.jsonl");
  auto lb = losses_of(fs::path(b) / "metrics.jsonl");
  ASSERT_EQ(la.size(), 6u);
  EXPECT_EQ(la, lb);
  // A different seed is a different run (the comparison above is not vacuous).
  std::string c = (dir_ / "c").string();
  CmdResult rc = run_strata("train " + small_run(c) + " train.seed=7");
  ASSERT_EQ(rc.exit_code, 0) << rc.output;
  EXPECT_NE(losses_of(fs::path(c) / "metrics.jsonl"), la);
}

// Every reduction in strata's own kernels has a fixed order, and STRATA_DETERMINISTIC_GEMM=1
// swaps OpenBLAS (whose order depends on the CPU) for strata's fixed-order GEMM: the run is then
// bitwise the same at any thread count, as it is on any x86-64 machine.
TEST_F(CliTest, FixedOrderGemmGivesBitwiseTheSameRunAtEveryThreadCount) {
  std::vector<std::vector<std::string>> losses, norms;
  for (int threads : {1, 2, 3}) {
    const std::string run_dir = (dir_ / ("threads" + std::to_string(threads))).string();
    CmdResult r = run_strata("train " + small_run(run_dir), {},
                             "STRATA_DETERMINISTIC_GEMM=1 OMP_NUM_THREADS=" + std::to_string(threads));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    losses.push_back(losses_of(fs::path(run_dir) / "metrics.jsonl"));
    norms.emplace_back();
    std::ifstream in(fs::path(run_dir) / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      if (!j.contains("event")) norms.back().push_back(j["grad_norm"].dump());
    }
  }
  ASSERT_EQ(losses[0].size(), 6u);
  ASSERT_EQ(norms[0].size(), 6u);
  for (size_t i = 1; i < losses.size(); ++i) {
    EXPECT_EQ(losses[i], losses[0]) << "thread count changed the losses";
    EXPECT_EQ(norms[i], norms[0]) << "thread count changed the gradient norms";
  }
}

TEST_F(CliTest, AMalformedDeterministicGemmSettingIsRefused) {
  CmdResult r = run_strata("train " + small_run((dir_ / "run").string()), {}, "STRATA_DETERMINISTIC_GEMM=yes");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("STRATA_DETERMINISTIC_GEMM='yes'"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "run"));
}

// A sequence too long for the device budget is refused before anything is written, naming the
// longest train.seq_len that fits; strata plan agrees that it fits and one token more does not.
TEST_F(CliTest, ASequenceTooLongIsRefusedNamingTheLongestThatFits) {
  const std::string budgets = " model.preset=tiny run.device=cpu memory.device=20MiB train.micro_batch=2";
  CmdResult r = run_strata("train" + budgets + " train.seq_len=4096 train.steps=1 optim.warmup_steps=0 run.dir=" +
                           (dir_ / "long").string());
  EXPECT_NE(r.exit_code, 0) << r.output;
  const std::string key = "lower train.seq_len to at most ";
  const size_t at = r.output.find(key);
  ASSERT_NE(at, std::string::npos) << r.output;
  const int64_t longest = std::stoll(r.output.substr(at + key.size()));
  ASSERT_GT(longest, 0);
  ASSERT_LT(longest, 4096);
  EXPECT_FALSE(fs::exists(dir_ / "long" / "metrics.jsonl"));
  EXPECT_EQ(run_strata("plan" + budgets + " train.seq_len=" + std::to_string(longest)).exit_code, 0);
  EXPECT_EQ(run_strata("plan" + budgets + " train.seq_len=" + std::to_string(longest + 1)).exit_code, 1);
  CmdResult plan = run_strata("plan" + budgets + " train.seq_len=64");
  EXPECT_NE(plan.output.find("longest train.seq_len that fits these budgets: "), std::string::npos) << plan.output;
  // With context parallelism over four ranks, the longest with and without it side by side; a
  // length a group cannot split is refused naming the key.
  CmdResult cp = run_strata("plan" + budgets + " train.seq_len=64 parallel.world_size=4 parallel.context_parallel=4");
  EXPECT_EQ(cp.exit_code, 0) << cp.output;
  const std::string line = "at micro-batch 1: ";
  const size_t cp_at = cp.output.find(line);
  ASSERT_NE(cp_at, std::string::npos) << cp.output;
  ASSERT_TRUE(std::isdigit(static_cast<unsigned char>(cp.output[cp_at + line.size()]))) << cp.output;
  const int64_t without = std::stoll(cp.output.substr(cp_at + line.size()));
  const std::string with_key = "tokens without context parallelism, ";
  const size_t with_at = cp.output.find(with_key, cp_at);
  ASSERT_NE(with_at, std::string::npos) << cp.output;
  ASSERT_TRUE(std::isdigit(static_cast<unsigned char>(cp.output[with_at + with_key.size()]))) << cp.output;
  const int64_t with = std::stoll(cp.output.substr(with_at + with_key.size()));
  EXPECT_GT(with, 2 * without) << cp.output;
  EXPECT_EQ(with % 8, 0) << cp.output;
  CmdResult odd = run_strata("plan" + budgets + " train.seq_len=60 parallel.world_size=4 parallel.context_parallel=4");
  EXPECT_NE(odd.exit_code, 0);
  EXPECT_NE(odd.output.find("train.seq_len=60 must be a multiple of 8"), std::string::npos) << odd.output;
}

TEST_F(CliTest, PagingThroughHostAndNvmeChangesNoBit) {
  // The same run with roomy budgets and with budgets that push parameters, gradients and Adam
  // moments through every tier: bitwise the same losses.
  std::string roomy = (dir_ / "roomy").string(), tight = (dir_ / "tight").string();
  const std::string common = small_run(roomy) + " train.grad_accum=2";
  CmdResult a = run_strata("train " + common + " memory.device=256MiB memory.host=256MiB");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  CmdResult b = run_strata("train data.paths=[" + corpus() + "] run.dir=" + tight +
                           " train.micro_batch=2 train.seq_len=32 train.steps=6 optim.warmup_steps=2 "
                           "'model.set=[num_hidden_layers=2,hidden_size=64,intermediate_size=96]' train.grad_accum=2"
                           " memory.device=1200KiB memory.host=1300KiB memory.nvme.path=" + (dir_ / "nvme").string() +
                           " memory.nvme.size=16MiB memory.offload_activations=true");
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_EQ(losses_of(fs::path(roomy) / "metrics.jsonl"), losses_of(fs::path(tight) / "metrics.jsonl"));
  // The tight run really paged: its metrics show bytes on nvme and bytes moved every step.
  std::ifstream in(fs::path(tight) / "metrics.jsonl");
  std::string line;
  std::getline(in, line);
  auto j = nlohmann::json::parse(line);
  EXPECT_GT(j["nvme_bytes"].get<uint64_t>(), 0u) << line;
  EXPECT_GT(j["moved_bytes"].get<uint64_t>(), 0u) << line;
}

// run.device=auto plans where strata train would run: the GPU layout only where this build sees
// a CUDA device, whatever the budgets; the plan says which it chose and why.
TEST_F(CliTest, PlanResolvesAutoAsTrainDoes) {
  CmdResult r = run_strata("plan memory.device=24MiB memory.host=10MiB");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  if (strata::cuda_device_visible()) {
    EXPECT_NE(r.output.find("GPU layout"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("run.device=auto: a CUDA device is visible here"), std::string::npos) << r.output;
  } else {
    EXPECT_NE(r.output.find("CPU layout (fp32 recipe"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("run.device=auto: no CUDA device is visible here"), std::string::npos) << r.output;
  }
  CmdResult gpu = run_strata("plan run.device=cuda memory.device=24GiB memory.host=10GiB");
  EXPECT_EQ(gpu.exit_code, 0) << gpu.output;
  EXPECT_NE(gpu.output.find("GPU layout"), std::string::npos) << gpu.output;
  EXPECT_EQ(gpu.output.find("run.device=auto"), std::string::npos) << gpu.output;
}

// The same keys give the same host memory in strata plan and strata train: every item of the
// run's state (chunks, staging, the cpu device, compute temporaries, checkpoints, I/O, weights)
// byte for byte. The process item is each process's own resident peak measured before the tiers
// are reserved; train has built the decoder and opened the data by then, so it may be a little
// larger (32 MiB leaves room for allocator arenas on other machines), never the tiers again.
// Data items differ as plan cannot see the built-in corpus before train writes it.
TEST_F(CliTest, PlanAndTrainPrintTheSameHostMemory) {
  const std::string keys =
      "model.preset=tiny 'model.set=[hidden_size=256,num_hidden_layers=4,intermediate_size=768,vocab_size=4096]' "
      "train.micro_batch=2 train.seq_len=128 memory.device=48MiB memory.host=0 train.steps=1 optim.warmup_steps=0 "
      "data.paths=[builtin:licenses] run.device=cpu ckpt.every=0";
  // The items of the "host RAM: peak ...: name SIZE, name SIZE, ..." line, in bytes.
  auto items = [](const std::string& out) {
    std::map<std::string, uint64_t> m;
    const size_t at = out.find("host RAM: peak ");
    if (at == std::string::npos) return m;
    const size_t colon = out.find("):", at);
    std::stringstream line(out.substr(colon + 2, out.find('\n', colon) - colon - 2));
    for (std::string item; std::getline(line, item, ',');) {
      item.erase(0, item.find_first_not_of(' '));
      const size_t unit = item.rfind(' '), value = item.rfind(' ', unit - 1);
      strata::Result<uint64_t> b = strata::parse_bytes(item.substr(value + 1));
      if (b.ok()) m[item.substr(0, value)] = *b;
    }
    return m;
  };
  const CmdResult plan = run_strata("plan " + keys);
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  const CmdResult train = run_strata("train " + keys + " run.dir=" + (dir_ / "run").string());
  ASSERT_EQ(train.exit_code, 0) << train.output;
  const std::map<std::string, uint64_t> planned = items(plan.output), trained = items(train.output);
  for (const char* name : {"chunks", "staging", "device", "compute", "checkpoint", "io", "weights"}) {
    ASSERT_TRUE(planned.count(name) && trained.count(name)) << name << "\n" << plan.output << train.output;
    EXPECT_EQ(planned.at(name), trained.at(name)) << name;
  }
  ASSERT_TRUE(planned.count("process") && trained.count("process")) << plan.output << train.output;
  const double process_gap =
      static_cast<double>(trained.at("process")) - static_cast<double>(planned.at("process"));
  EXPECT_TRUE(std::abs(process_gap) <= 32.0 * (1 << 20))
      << "process: plan " << planned.at("process") << " B, train " << trained.at("process") << " B";
}

// strata plan in the CPU layout plans the chunks strata train will make, and refuses a chunk
// size that cannot hold the largest tensor as train does, naming the tensor and the size.
TEST_F(CliTest, PlanUsesTrainsChunksAndRefusesAChunkSmallerThanATensor) {
  CmdResult ok = run_strata("plan run.device=cpu memory.device=24MiB memory.host=10MiB");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("CPU layout (fp32 recipe, fp32 Adam moments)"), std::string::npos) << ok.output;
  CmdResult small = run_strata("plan run.device=cpu memory.device=24MiB memory.chunk_size=64KiB");
  EXPECT_EQ(small.exit_code, 1) << small.output;
  EXPECT_NE(small.output.find("'model.embed_tokens.weight' (128.00 KiB) is larger than a chunk (64.00 KiB)"),
            std::string::npos)
      << small.output;
  EXPECT_NE(small.output.find("memory.chunk_size to at least 128.00 KiB"), std::string::npos) << small.output;
}

// strata plan for many ranks: a section naming the world, the nodes, the ZeRO level and a row
// per level; one rank prints none of it.
TEST_F(CliTest, PlanForManyRanksComparesTheZeroLevels) {
  const std::string base = "plan model.preset=llama3-8b run.device=cuda memory.device=24GiB memory.host=64GiB "
                           "train.micro_batch=1 train.seq_len=2048 train.grad_accum=8";
  CmdResult many = run_strata(base + " parallel.world_size=64");
  EXPECT_EQ(many.exit_code, 0) << many.output;
  EXPECT_NE(many.output.find("data parallel: 64 ranks, 8 per node (8 nodes), ZeRO-"), std::string::npos) << many.output;
  EXPECT_NE(many.output.find("collectives at 25 GB/s bus bandwidth (between nodes"), std::string::npos) << many.output;
  for (const char* row : {"\n  0", "\n  1", "\n  2", "\n  3"})
    EXPECT_NE(many.output.find(row), std::string::npos) << row;
  EXPECT_NE(many.output.find("tokens/s for the 64 ranks"), std::string::npos) << many.output;
  // A given level is planned as given; one node talks at the node's bandwidth.
  CmdResult given = run_strata(base + " parallel.world_size=8 parallel.zero=3 hardware.intra_node_gbps=20");
  EXPECT_EQ(given.exit_code, 0) << given.output;
  EXPECT_NE(given.output.find("ZeRO-3 (as given); collectives at 20 GB/s"), std::string::npos) << given.output;
  EXPECT_NE(given.output.find("per rank at ZeRO-3"), std::string::npos) << given.output;
  // One rank holds the whole state, which 64 GiB of host cannot (64 ranks shard it: exit 0 above).
  CmdResult one = run_strata(base);
  EXPECT_EQ(one.exit_code, 1) << one.output;
  EXPECT_NE(one.output.find("does not fit: the host budget 64.00 GiB"), std::string::npos) << one.output;
  EXPECT_EQ(one.output.find("data parallel"), std::string::npos) << one.output;
  EXPECT_EQ(one.output.find("collectives"), std::string::npos) << one.output;
  CmdResult bad = run_strata(base + " parallel.world_size=8 parallel.zero=4");
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.output.find("parallel.zero"), std::string::npos) << bad.output;
}

// run.device=cuda takes the bf16 and fp8 recipes; fp32 is refused by name, pointing at the cpu.
// Where no GPU answers (CI), the fp8 run fails for the device, not for its recipe; where one
// does, it trains.
TEST_F(CliTest, TheCudaBackendTakesTheFp8RecipeAndRefusesFp32) {
  const std::string run_dir = (dir_ / "cuda").string();
  CmdResult fp32 = run_strata("train " + small_run(run_dir) + " run.device=cuda train.precision=fp32");
  expect_clean_failure(fp32, run_dir, {"train.precision=fp32 runs on the cpu (run.device=cpu)"});
  CmdResult fp8 = run_strata("train " + small_run(run_dir) + " run.device=cuda train.precision=fp8");
  if (fp8.exit_code == 0) return;  // a GPU trained it
  expect_clean_failure(fp8, run_dir, {"run.device=cuda"});
  EXPECT_EQ(fp8.output.find("precision"), std::string::npos) << "the fp8 recipe was refused on CUDA:\n" << fp8.output;
}

// A second run without --resume in the same run.dir is refused before it writes anything: the
// first run's metrics and checkpoints stay as they were; --resume auto continues it instead.
TEST_F(CliTest, ANewRunNeverOverwritesAnotherRunsDirectory) {
  const std::string run_dir = (dir_ / "run").string();
  CmdResult first = run_strata("train " + small_run(run_dir) + " ckpt.every=3");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto metrics = losses_of(fs::path(run_dir) / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 6u);
  CmdResult again = run_strata("train " + small_run(run_dir) + " ckpt.every=1");
  EXPECT_EQ(again.exit_code, 1) << again.output;
  EXPECT_NE(again.output.find("already holds checkpoints of a run (latest: step-6)"), std::string::npos)
      << again.output;
  EXPECT_NE(again.output.find("--resume auto"), std::string::npos) << again.output;
  EXPECT_EQ(losses_of(fs::path(run_dir) / "metrics.jsonl"), metrics);
  EXPECT_FALSE(fs::exists(fs::path(run_dir) / "checkpoints" / "step-1")) << again.output;
  // Metrics alone (a run without checkpoints) are kept the same way.
  const std::string bare = (dir_ / "bare").string();
  ASSERT_EQ(run_strata("train " + small_run(bare)).exit_code, 0);
  const auto bare_metrics = losses_of(fs::path(bare) / "metrics.jsonl");
  // (--resume auto would start it again, keeping these metrics aside: run_lifecycle_test.)
  CmdResult bare_again = run_strata("train " + small_run(bare));
  EXPECT_EQ(bare_again.exit_code, 1) << bare_again.output;
  EXPECT_NE(bare_again.output.find("already holds a run's metrics"), std::string::npos) << bare_again.output;
  EXPECT_EQ(losses_of(fs::path(bare) / "metrics.jsonl"), bare_metrics);
  // Continuing the first run is what --resume auto is for: it has nothing left to do at step 6.
  CmdResult resumed = run_strata("train " + small_run(run_dir) + " ckpt.every=3 --resume auto");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  // Checkpoints without `latest` are not silently skipped by --resume auto either.
  fs::remove(fs::path(run_dir) / "checkpoints" / "latest");
  CmdResult no_latest = run_strata("train " + small_run(run_dir) + " --resume auto");
  EXPECT_EQ(no_latest.exit_code, 1) << no_latest.output;
  EXPECT_NE(no_latest.output.find("but no 'latest'"), std::string::npos) << no_latest.output;
  // A crash before the first commit leaves only step-N.tmp: nothing to protect, a new run starts.
  const std::string crashed = (dir_ / "crashed").string();
  fs::create_directories(fs::path(crashed) / "checkpoints" / "step-3.tmp");
  CmdResult fresh = run_strata("train " + small_run(crashed));
  EXPECT_EQ(fresh.exit_code, 0) << fresh.output;
}

// A vocabulary in row blocks (2000 x 64 against a largest layer tensor of 96 x 64) goes through
// checkpoints whole: a run resumed from step 3 under budgets that page everything ends bitwise
// where the uninterrupted run ends, and the export holds the whole embedding.
TEST_F(CliTest, VocabularyInRowBlocksResumesBitExactlyAndExportsWhole) {
  auto run = [&](const std::string& dir) {
    return "data.paths=[" + corpus() + "] run.dir=" + dir +
           " train.micro_batch=2 train.seq_len=32 train.steps=6 optim.warmup_steps=2 "
           "'model.set=[num_hidden_layers=2,hidden_size=64,intermediate_size=96,vocab_size=2000]'";
  };
  const std::string full = (dir_ / "full").string();
  CmdResult a = run_strata("train " + run(full) + " ckpt.every=3 run.export=" + (dir_ / "export").string());
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const auto expected = losses_of(fs::path(full) / "metrics.jsonl");
  ASSERT_EQ(expected.size(), 6u);
  const std::string resumed = (dir_ / "resumed").string();
  CmdResult b = run_strata("train " + run(resumed) + " --resume " + (fs::path(full) / "checkpoints" / "step-3").string() +
                           " memory.device=4MiB memory.host=3700KiB memory.nvme.path=" + (dir_ / "nvme").string() +
                           " memory.nvme.size=64MiB");
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_EQ(losses_of(fs::path(resumed) / "metrics.jsonl"), std::vector<std::string>(expected.begin() + 3, expected.end()))
      << b.output;
  std::ifstream in(fs::path(resumed) / "metrics.jsonl");
  std::string line;
  std::getline(in, line);
  EXPECT_GT(nlohmann::json::parse(line)["nvme_bytes"].get<uint64_t>(), 0u) << "the resumed run did not page: " << line;
  CmdResult inspect = run_strata("ckpt inspect " + (fs::path(full) / "checkpoints").string());
  EXPECT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_TRUE(fs::file_size(dir_ / "export" / "model.safetensors") > uint64_t{2000} * 64 * 4);
}

TEST_F(CliTest, ChunkSmallerThanATensorIsRefusedNamingIt) {
  const std::string run_dir = (dir_ / "run").string();
  CmdResult r = run_strata("train " + small_run(run_dir) + " memory.chunk_size=4KiB");
  expect_clean_failure(r, run_dir, {"memory.chunk_size 4.00 KiB cannot hold tensor 'model.embed_tokens.weight' in blocks of",
                                    "raise memory.chunk_size to at least"});
}

TEST_F(CliTest, BudgetsTooSmallAreRefusedWithTheMinimum) {
  std::string run_dir = (dir_ / "run").string();
  CmdResult r = run_strata("train data.paths=[" + corpus() + "] run.dir=" + run_dir + " memory.device=1MiB");
  expect_clean_failure(r, run_dir, {"memory.device to at least"});
}

TEST_F(CliTest, ResumeIsBitExactEvenWithOtherBudgets) {
  std::string full = (dir_ / "full").string();
  CmdResult a = run_strata("train " + small_run(full) + " ckpt.every=3 train.grad_accum=2");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const auto expected = losses_of(fs::path(full) / "metrics.jsonl");
  ASSERT_EQ(expected.size(), 6u);
  const std::string step3 = (fs::path(full) / "checkpoints" / "step-3").string();
  ASSERT_TRUE(fs::exists(step3)) << a.output;
  // Same budgets, and budgets that page everything through host and nvme.
  for (const std::string& budgets :
       {std::string(""), " memory.device=1200KiB memory.host=1300KiB memory.nvme.path=" + (dir_ / "nvme").string() +
                             " memory.nvme.size=16MiB"}) {
    std::string resumed = (dir_ / ("resumed" + std::to_string(budgets.size()))).string();
    CmdResult b = run_strata("train " + small_run(resumed) + " train.grad_accum=2 --resume " + step3 + budgets);
    ASSERT_EQ(b.exit_code, 0) << b.output;
    const auto got = losses_of(fs::path(resumed) / "metrics.jsonl");
    EXPECT_EQ(got, std::vector<std::string>(expected.begin() + 3, expected.end())) << b.output;
  }
}

// The bf16 recipe (the GPU's, emulated on the CPU) resumes bit-exactly too, under budgets that
// page every kind through host and nvme: the checkpoint holds the fp32 master, and the bf16
// compute copy is rounded from it again. A checkpoint of either recipe resumes under the other.
TEST_F(CliTest, Bf16RecipeResumesBitExactlyAndAcrossRecipes) {
  std::string full = (dir_ / "full").string();
  CmdResult a = run_strata("train " + small_run(full) + " ckpt.every=3 train.precision=bf16");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_NE(a.output.find("precision bf16"), std::string::npos) << a.output;
  const auto expected = losses_of(fs::path(full) / "metrics.jsonl");
  ASSERT_EQ(expected.size(), 6u);
  const std::string step3 = (fs::path(full) / "checkpoints" / "step-3").string();
  std::string resumed = (dir_ / "resumed").string();
  CmdResult b = run_strata("train " + small_run(resumed) + " train.precision=bf16 --resume " + step3 +
                           " memory.device=1200KiB memory.host=1300KiB memory.nvme.path=" + (dir_ / "nvme").string() +
                           " memory.nvme.size=16MiB");
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_EQ(losses_of(fs::path(resumed) / "metrics.jsonl"), std::vector<std::string>(expected.begin() + 3, expected.end()))
      << b.output;
  // Across recipes: the bf16 run's checkpoint continues in fp32 (and learns on), and differs
  // from the bf16 continuation, since the arithmetic does.
  std::string fp32 = (dir_ / "fp32").string();
  CmdResult c = run_strata("train " + small_run(fp32) + " train.precision=fp32 --resume " + step3);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  const auto across = losses_of(fs::path(fp32) / "metrics.jsonl");
  ASSERT_EQ(across.size(), 3u);
  EXPECT_NE(across, std::vector<std::string>(expected.begin() + 3, expected.end()));
}

// The fp8 recipe with 8-bit Adam moments resumes bit-exactly under budgets that page every kind:
// the checkpoint holds the fp32 master (the E4M3 copies are quantised from it again) and the
// decoded moments (which encode back to the same bytes); the manifest records both, and the step
// line names them. Resumed with fp32 moments instead, the run converts them and says so.
TEST_F(CliTest, Fp8RecipeWithInt8MomentsResumesBitExactly) {
  std::string full = (dir_ / "full").string();
  const std::string recipe = " train.precision=fp8 optim.moments=int8";
  CmdResult a = run_strata("train " + small_run(full) + " ckpt.every=3" + recipe);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_NE(a.output.find("| fp8, int8 moments"), std::string::npos) << a.output;
  const auto expected = losses_of(fs::path(full) / "metrics.jsonl");
  ASSERT_EQ(expected.size(), 6u);
  const fs::path step3 = fs::path(full) / "checkpoints" / "step-3";
  std::ifstream manifest(step3 / "manifest.json");
  const nlohmann::json m = nlohmann::json::parse(manifest);
  EXPECT_EQ(m["precision"]["moments"], "int8") << m.dump();
  CmdResult inspect = run_strata("ckpt inspect " + step3.string());
  EXPECT_NE(inspect.output.find("Adam moments stored as int8"), std::string::npos) << inspect.output;
  std::string resumed = (dir_ / "resumed").string();
  CmdResult b = run_strata("train " + small_run(resumed) + recipe + " --resume " + step3.string() +
                           " memory.device=1200KiB memory.host=1300KiB memory.nvme.path=" + (dir_ / "nvme").string() +
                           " memory.nvme.size=16MiB");
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_EQ(losses_of(fs::path(resumed) / "metrics.jsonl"), std::vector<std::string>(expected.begin() + 3, expected.end()))
      << b.output;
  std::string wide = (dir_ / "wide").string();
  CmdResult c = run_strata("train " + small_run(wide) + " train.precision=fp8 --resume " + step3.string());
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("moments were stored as int8; this run stores them as fp32"), std::string::npos) << c.output;
}

// A MoE run with auxiliary-loss-free balancing keeps a per-expert bias outside the tensors;
// the checkpoint carries it (state/...selection_bias), so the resumed run is bit-exact too.
TEST_F(CliTest, ResumeOfLossFreeBalancedMoeIsBitExact) {
  auto moe_run = [&](const std::string& run_dir) {
    return "data.paths=[" + corpus() + "] run.dir=" + run_dir +
           " train.micro_batch=2 train.seq_len=32 train.steps=6 optim.warmup_steps=2 "
           "'model.set=[num_hidden_layers=2,hidden_size=64,intermediate_size=96,model_type=mixtral,"
           "num_local_experts=4,num_experts_per_tok=2,router_bias_update_rate=0.05]'";
  };
  std::string full = (dir_ / "full").string();
  CmdResult a = run_strata("train " + moe_run(full) + " ckpt.every=3");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const auto expected = losses_of(fs::path(full) / "metrics.jsonl");
  ASSERT_EQ(expected.size(), 6u);
  const std::string step3 = (fs::path(full) / "checkpoints" / "step-3").string();
  CmdResult inspect = run_strata("ckpt inspect " + step3);
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_NE(inspect.output.find("state           2"), std::string::npos) << inspect.output;
  std::string resumed = (dir_ / "resumed").string();
  CmdResult b = run_strata("train " + moe_run(resumed) + " --resume " + step3);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_EQ(losses_of(fs::path(resumed) / "metrics.jsonl"),
            std::vector<std::string>(expected.begin() + 3, expected.end()))
      << b.output;
}

TEST_F(CliTest, SigtermWritesAFinalCheckpointAndExitsZero) {
  std::string run_dir = (dir_ / "run").string();
  const std::string cmd = std::string(STRATA_BINARY_DIR) + "/strata train " + small_run(run_dir) +
                          " train.steps=100000 > " + (dir_ / "log.txt").string() + " 2>&1 & echo $!";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  int pid = 0;
  ASSERT_EQ(fscanf(p, "%d", &pid), 1);
  pclose(p);
  // Wait for a few steps, then ask it to stop.
  const fs::path metrics = fs::path(run_dir) / "metrics.jsonl";
  for (int i = 0; i < 600 && losses_of(metrics).size() < 3; ++i) usleep(100 * 1000);
  ASSERT_GE(losses_of(metrics).size(), 3u) << "training did not start";
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  int waited = 0;
  while (kill(pid, 0) == 0 && waited++ < 600) usleep(100 * 1000);
  std::ifstream log(dir_ / "log.txt");
  std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("interrupted"), std::string::npos) << text;
  const auto steps = losses_of(metrics).size();
  EXPECT_TRUE(fs::exists(fs::path(run_dir) / "checkpoints" / ("step-" + std::to_string(steps)))) << text;
  // The interrupted run still ends its metrics with its goodput, the final save counted.
  std::ifstream in(metrics);
  std::string line, last;
  while (std::getline(in, line)) last = line;
  const nlohmann::json goodput = nlohmann::json::parse(last, nullptr, false);
  ASSERT_TRUE(goodput.is_object() && goodput.value("event", "") == "goodput") << last;
  EXPECT_GT(goodput["checkpoint_s"].get<double>(), 0.0) << last;
  EXPECT_NE(text.find("goodput "), std::string::npos) << text;
  CmdResult verify = run_strata("ckpt verify " + run_dir + "/checkpoints");
  EXPECT_EQ(verify.exit_code, 0) << verify.output;
}

// 40 steps of the default run learn (5.5 -> about 2.9). Run with the fixed-order GEMM, so that
// the trajectory is the same on every machine, not only one whose OpenBLAS kernels it was seen on.
TEST_F(CliTest, LossFallsOnTheDefaultCorpus) {
  std::string run_dir = (dir_ / "run").string();
  CmdResult r = run_strata("train run.dir=" + run_dir + " train.steps=40 train.seq_len=64 run.log_every=10", {},
                           "STRATA_DETERMINISTIC_GEMM=1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto losses = losses_of(fs::path(run_dir) / "metrics.jsonl");
  ASSERT_EQ(losses.size(), 40u);
  double first = std::stod(losses.front()), last = std::stod(losses.back());
  EXPECT_TRUE(first > 4.5 && first < 6.5) << "byte-level loss should start near ln(256) = 5.55, got " << first;
  EXPECT_TRUE(last < first - 1.5) << "loss " << first << " -> " << last << "\n" << r.output;
}

}  // namespace
