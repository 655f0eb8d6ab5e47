// strata profile end to end: a real run's trace is valid trace-event JSON with the spans,
// copies, nvme requests and counters the report is made from; the report and pictures exist
// and agree with the trace.
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tools/cli_util.h"
#include "trace_check.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::run_strata;

using strata::testing::read_text;

// The trace and report of a finished profile, checked for what every profile must hold.
void expect_valid_profile(const fs::path& out, int steps, bool expect_nvme) {
  for (const char* f : {"trace.json", "report.txt", "report.json", "timeline.svg", "memory.svg"})
    ASSERT_TRUE(fs::exists(out / f)) << f;
  const nlohmann::json trace = nlohmann::json::parse(read_text(out / "trace.json"));
  EXPECT_EQ(testing::check_trace_json(trace), "");
  std::map<int, std::string> thread_names;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "M" && e["name"] == "thread_name") thread_names[e["tid"]] = e["args"]["name"];
  std::set<std::string> spans;
  int step_spans = 0, nvme = 0, counters = 0;
  double copied = 0;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "X") {
      spans.insert(e["name"].get<std::string>());
      if (e["cat"] == "step" && e["name"].get<std::string>().rfind("step ", 0) == 0) ++step_spans;
      if (e["cat"] == "copy" && thread_names[e["tid"]] == "copy host->device") copied += e["args"]["bytes"].get<double>();
    }
    if (e["ph"] == "b" && e["cat"] == "io" && e["name"].get<std::string>().rfind("nvme ", 0) == 0) ++nvme;
    if (e["ph"] == "C" && e["name"] == "device bytes") ++counters;
  }
  EXPECT_EQ(step_spans, steps);
  for (const char* name : {"forward 0", "forward 1", "backward 0", "head", "embedding forward", "embedding backward",
                           "zero gradients", "data"})
    EXPECT_TRUE(spans.count(name)) << "no span '" << name << "'";
  EXPECT_GT(copied, 0) << "no host->device copy with bytes";
  EXPECT_GT(counters, 0);
  if (expect_nvme) EXPECT_GT(nvme, 0) << "no nvme request traced";

  const nlohmann::json report = nlohmann::json::parse(read_text(out / "report.json"));
  EXPECT_EQ(report["steps"], steps);
  double sum = 0;
  for (const auto& [phase, s] : report["phases"].items()) sum += s.get<double>();
  const double step_s = report["step_s"];
  EXPECT_GT(step_s, 0);
  const double err = std::abs(sum - step_s) / step_s;
  EXPECT_TRUE(err <= 1e-6) << "phases sum to " << sum << " s, the step is " << step_s << " s";
  EXPECT_EQ(report["traffic"].size(), 4u);
  EXPECT_GT(report["traffic"][0]["bytes"].get<double>(), 0);
  EXPECT_GE(report["memory"].size(), 2u);
  for (const char* f : {"timeline.svg", "memory.svg"}) {
    const std::string svg = read_text(out / f);
    EXPECT_NE(svg.find("<svg"), std::string::npos) << f;
    EXPECT_NE(svg.rfind("</svg>"), std::string::npos) << f;
  }
}

TEST(ProfileCli, TheEmbeddedDefaultGivesAValidTraceReportAndPictures) {
  const fs::path dir = testing::fresh_test_dir("strata_profile");
  const fs::path run = dir / "run";
  testing::CmdResult r = run_strata("profile run.dir=" + run.string() + " --warmup 1 --steps 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("critical path"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("wrote " + (run / "profile" / "trace.json").string()), std::string::npos) << r.output;
  expect_valid_profile(run / "profile", 2, /*expect_nvme=*/true);
  fs::remove_all(dir);
}

TEST(ProfileCli, AMoeRunWithTightBudgetsIsProfiledToo) {
  const fs::path dir = testing::fresh_test_dir("strata_profile");
  const fs::path out = dir / "out";
  testing::CmdResult r = run_strata(
      "profile model.preset=tiny data.paths=[builtin:licenses] train.micro_batch=2 train.seq_len=64 "
      "'model.set=[num_hidden_layers=2,model_type=mixtral,num_local_experts=4,num_experts_per_tok=2]' "
      "memory.device=16MiB memory.host=20MiB memory.nvme.size=64MiB memory.nvme.path=nvme run.dir=" + (dir / "run").string() +
      " --steps 2 --warmup 1 --out " + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_valid_profile(out, 2, /*expect_nvme=*/false);
  fs::remove_all(dir);
}

TEST(ProfileCli, BadFlagsAreUsageErrorsAndWriteNothing) {
  const fs::path dir = testing::fresh_test_dir("strata_profile");
  const fs::path run = dir / "run";
  for (const std::string flags : {"--steps 0", "--steps x", "--warmup -1", "--bogus", "--out"}) {
    testing::CmdResult r = run_strata("profile run.dir=" + run.string() + " " + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_FALSE(fs::exists(run)) << flags;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
