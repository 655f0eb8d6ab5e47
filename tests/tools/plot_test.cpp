// strata plot end to end: the charts of a real training run, restarts and resumes marked,
// event lines skipped, and bad input refused with the file and line, writing nothing.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "svg_check.h"

#include "tools/cli_util.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using strata::testing::svg_series_path;
using strata::testing::xml_problem;

using strata::testing::CmdResult;
using strata::testing::run_strata;

using strata::testing::read_text;

const std::vector<std::string> kCharts = {"loss.svg", "throughput.svg", "memory.svg", "stalls.svg", "overview.svg"};

// A metrics line as the trainer writes it.
std::string metrics_line(int step, const std::string& loss = "", bool skipped = false) {
  return fmt::format(
      "{{\"ckpt_in_flight\":false,\"device_bytes\":5619712,\"elapsed_s\":{},\"eta_s\":1.0,\"grad_norm\":1.5,"
      "\"host_bytes\":10436608,\"loss\":{},\"lr\":0.003,\"moved_bytes\":15253504,\"ms\":250.0,"
      "\"nvme_bytes\":5619712,\"rss_bytes\":48721920,\"skipped\":{},\"skipped_steps\":{},\"stall_ms\":1.5,"
      "\"step\":{},\"tokens\":{},\"tokens_per_s\":4096.5}}\n",
      step * 0.25, loss.empty() ? fmt::format("{}", 6.0 - 0.1 * step) : loss, skipped, skipped ? 1 : 0, step,
      step * 1024);
}

std::string metrics_lines(int first, int last) {
  std::string s;
  for (int step = first; step <= last; ++step) s += metrics_line(step);
  return s;
}

class PlotCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::testing::fresh_test_dir("strata_plot");
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path write(const std::string& name, const std::string& content) {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary) << content;
    return p;
  }
  // Runs plot on dir_, expects success and well-formed charts, returns loss.svg.
  std::string plot_ok() {
    const CmdResult r = run_strata("plot " + dir_.string());
    EXPECT_EQ(r.exit_code, 0) << r.output;
    for (const std::string& name : kCharts) {
      const std::string svg = read_text(dir_ / "plots" / name);
      EXPECT_EQ(xml_problem(svg), "") << name;
    }
    return read_text(dir_ / "plots" / "loss.svg");
  }
  void expect_refused(const CmdResult& r, const std::vector<std::string>& words) {
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << "not one line:\n" << r.output;
    for (const std::string& w : words)
      EXPECT_NE(r.output.find(w), std::string::npos) << "no '" << w << "' in:\n" << r.output;
  }

  fs::path dir_;
};

TEST_F(PlotCliTest, ChartsARealTrainingRun) {
  const fs::path run = dir_ / "run";
  const CmdResult train = run_strata("train train.steps=4 optim.warmup_steps=1 run.dir=" + run.string());
  ASSERT_EQ(train.exit_code, 0) << train.output;
  const fs::path out = dir_ / "charts";
  const CmdResult r = run_strata("plot " + run.string() + " --out " + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const std::string& name : kCharts) {
    const fs::path path = out / name;
    EXPECT_NE(r.output.find("wrote " + path.string()), std::string::npos) << r.output;
    const std::string svg = read_text(path);
    EXPECT_EQ(xml_problem(svg), "") << path;
    EXPECT_EQ(svg.find("no data"), std::string::npos) << path << " drew no data";
  }
  for (const fs::directory_entry& e : fs::directory_iterator(out))
    EXPECT_NE(e.path().extension(), ".tmp") << "left behind: " << e.path();
  const std::string loss = read_text(out / "loss.svg");
  EXPECT_EQ(svg_series_path(loss, "loss").points.size(), 4u) << loss;
  const std::string overview = read_text(out / "overview.svg");
  for (const char* title : {">Loss<", ">Throughput<", ">Memory per tier", ">Time compute waited", ">Bytes moved"})
    EXPECT_NE(overview.find(title), std::string::npos) << title;
  // Without --out the charts go to RUN_DIR/plots.
  ASSERT_EQ(run_strata("plot " + run.string()).exit_code, 0);
  EXPECT_TRUE(fs::exists(run / "plots" / "overview.svg"));
}

TEST_F(PlotCliTest, RestartsComeFirstAndAreMarked) {
  write("metrics.restart-2.jsonl", metrics_lines(1, 3));
  write("metrics.restart-10.jsonl", metrics_lines(1, 2));  // K orders numerically, not as text
  write("metrics.restart-1.jsonl", metrics_lines(1, 4));
  write("metrics.jsonl", metrics_lines(1, 5));
  const std::string loss = plot_ok();
  const strata::testing::SvgPath path = svg_series_path(loss, "loss");
  EXPECT_EQ(path.points.size(), 14u) << loss;
  // The attempts one after another, left to right, each its own line: 4 + 3 + 2 + 5 steps.
  EXPECT_EQ(path.runs, 4) << loss;
  for (size_t i = 1; i < path.points.size(); ++i)
    EXPECT_GT(path.points[i].first, path.points[i - 1].first) << "point " << i << " goes back";
  for (const char* marker : {">restart 1<", ">restart 2<", ">restart 3<"})
    EXPECT_NE(loss.find(marker), std::string::npos) << marker;
}

TEST_F(PlotCliTest, EventLinesAreSkipped) {
  write("metrics.jsonl", metrics_lines(1, 3) + "{\"event\":\"goodput\",\"goodput\":0.93,\"wall_s\":12.5}\n");
  const std::string loss = plot_ok();
  EXPECT_EQ(svg_series_path(loss, "loss").points.size(), 3u) << loss;
}

TEST_F(PlotCliTest, SkippedStepsAreMarkedAndResumesBreakTheLine) {
  // Step 3's loss was not finite (JSON null); then the run resumed from a checkpoint at step 2.
  write("metrics.jsonl", metrics_line(1) + metrics_line(2) + metrics_line(3, "null", true) + metrics_line(4) +
                             metrics_line(2) + metrics_line(3) + metrics_line(4));
  const std::string loss = plot_ok();
  const strata::testing::SvgPath path = svg_series_path(loss, "loss");
  EXPECT_EQ(path.points.size(), 6u) << loss;
  EXPECT_EQ(path.runs, 3) << "a gap at the skipped step and one at the resume:\n" << loss;
  EXPECT_EQ(svg_series_path(loss, "skipped step").points.size(), 2u) << "one cross (two strokes):\n" << loss;
  EXPECT_NE(loss.find(">resumed at step 2<"), std::string::npos) << loss;
}

TEST_F(PlotCliTest, AMalformedLineIsRefusedWithItsFileAndLineAndNothingIsWritten) {
  const fs::path out = dir_ / "out";
  write("metrics.jsonl", metrics_lines(1, 2) + "{\"step\": 3, \"loss\": \n" + metrics_lines(4, 5));
  expect_refused(run_strata("plot " + dir_.string() + " --out " + out.string()),
                 {"error:", (dir_ / "metrics.jsonl").string() + ":3:", "not valid JSON"});
  EXPECT_FALSE(fs::exists(out)) << "a refused plot wrote files";

  write("metrics.jsonl", metrics_lines(1, 2) + "{\"step\": 3, \"loss\": \"low\"}\n");
  expect_refused(run_strata("plot " + dir_.string() + " --out " + out.string()),
                 {(dir_ / "metrics.jsonl").string() + ":3:", "\"loss\""});
  write("metrics.jsonl", "{\"stage\": 1}\n");
  expect_refused(run_strata("plot " + dir_.string() + " --out " + out.string()), {"metrics.jsonl:1:", "\"step\""});
  write("metrics.jsonl", "[1, 2]\n");
  expect_refused(run_strata("plot " + dir_.string() + " --out " + out.string()), {"metrics.jsonl:1:", "JSON object"});
  // In a restart file, that file is named.
  write("metrics.jsonl", metrics_lines(1, 2));
  write("metrics.restart-1.jsonl", "garbage\n");
  expect_refused(run_strata("plot " + dir_.string() + " --out " + out.string()), {"metrics.restart-1.jsonl:1:"});
  EXPECT_FALSE(fs::exists(out)) << "a refused plot wrote files";
}

TEST_F(PlotCliTest, AnUnfinishedLastLineIsSkipped) {
  // A run killed while writing a line leaves it without its newline.
  std::string partial = metrics_line(4);
  partial.resize(partial.size() / 2);
  write("metrics.jsonl", metrics_lines(1, 3) + partial);
  const CmdResult r = run_strata("plot " + dir_.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("metrics.jsonl:4: skipping the unfinished last line"), std::string::npos) << r.output;
  EXPECT_EQ(svg_series_path(read_text(dir_ / "plots" / "loss.svg"), "loss").points.size(), 3u);
}

TEST_F(PlotCliTest, AMissingRunOrMetricsFileSaysWhatToDo) {
  expect_refused(run_strata("plot " + (dir_ / "nowhere").string()), {"nowhere", "does not exist", "strata train"});
  fs::create_directories(dir_ / "version_0");
  expect_refused(run_strata("plot " + dir_.string()), {"no metrics.jsonl", "strata train", "version_N"});
  EXPECT_FALSE(fs::exists(dir_ / "plots"));
  EXPECT_EQ(run_strata("plot").exit_code, 2);
  EXPECT_EQ(run_strata("plot " + dir_.string() + " --colour red").exit_code, 2);
}

TEST_F(PlotCliTest, HelpSaysWhatIsDrawn) {
  const CmdResult r = run_strata("plot --help");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* word : {"RUN_DIR", "--out", "metrics.restart-K.jsonl", "overview.svg"})
    EXPECT_NE(r.output.find(word), std::string::npos) << word;
  EXPECT_NE(run_strata("--help").output.find("plot RUN_DIR"), std::string::npos);
}

}  // namespace
