// The fp8 recipe learns as the bf16 recipe does: the embedded demo (8 x 128 tokens a step)
// trained for 200 steps under each, on the same data and seed. The fp8 recipe's mean loss over
// the last 10% of steps is no more than 0.25% above the bf16 recipe's (DeepSeek-V3's criterion
// for its fp8 recipe, which asks that fp8 lose no accuracy), and within 2% of it either way. At
// this scale two recipes that round differently end about 1% apart in either direction (their
// trajectories part: the fp32 recipe lands 0.4% from bf16, and fp8 has landed from 0.01% to
// 1.1% below it as the bf16 rounding of unrelated ops changed), so a two-sided 0.25% would
// measure the trajectory, not the recipe; a loss above bf16's is what a faulty recipe shows.
// The runs are bitwise reproducible, so the outcome is fixed for a given build and machine. The
// curves are printed every 20 steps. Compact moments are compared on whole runs by
// tools/fp8_loss_bench.sh and bounded per update by tests/kernels/moments_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/cli_util.h"

namespace {

namespace fs = std::filesystem;
using strata::testing::CmdResult;
using strata::testing::run_strata;

constexpr int kSteps = 200;

std::vector<double> losses_of(const fs::path& metrics) {
  std::vector<double> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("step")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

double tail_mean(const std::vector<double>& losses) {
  const size_t from = losses.size() - losses.size() / 10;
  double sum = 0;
  for (size_t i = from; i < losses.size(); ++i) sum += losses[i];
  return sum / static_cast<double>(losses.size() - from);
}

TEST(RecipeLoss, Fp8LosesNoMoreThanAQuarterPercentToBf16) {
  const fs::path dir = strata::testing::fresh_test_dir("strata_recipe_loss");
  struct RunSpec {
    std::string name, settings;
  };
  const std::vector<RunSpec> specs = {{"bf16", "train.precision=bf16"}, {"fp8", "train.precision=fp8"}};
  std::vector<std::vector<double>> curves;
  for (size_t i = 0; i < specs.size(); ++i) {
    const fs::path run_dir = dir / ("run" + std::to_string(i));
    CmdResult r = run_strata("train run.dir=" + run_dir.string() + " train.steps=" + std::to_string(kSteps) +
                             " run.log_every=50 " + specs[i].settings);
    ASSERT_EQ(r.exit_code, 0) << specs[i].name << "\n" << r.output;
    curves.push_back(losses_of(run_dir / "metrics.jsonl"));
    ASSERT_EQ(curves.back().size(), static_cast<size_t>(kSteps)) << specs[i].name;
  }
  std::printf("%6s", "step");
  for (const RunSpec& s : specs) std::printf(" %18s", s.name.c_str());
  std::printf("\n");
  for (int step = 0; step < kSteps; step += 20) {
    std::printf("%6d", step + 1);
    for (const auto& c : curves) std::printf(" %18.4f", c[static_cast<size_t>(step)]);
    std::printf("\n");
  }
  std::printf("%6s", "last10");
  std::vector<double> tails;
  for (const auto& c : curves) tails.push_back(tail_mean(c)), std::printf(" %18.4f", tails.back());
  std::printf("\n");
  // Signed: above zero, fp8's loss is higher than bf16's.
  auto rel = [&](size_t i) { return (tails[i] - tails[0]) / tails[0]; };
  for (size_t i = 1; i < specs.size(); ++i)
    std::printf("%s vs bf16: %+.3f%%\n", specs[i].name.c_str(), 100 * rel(i));
  for (double t : tails) ASSERT_TRUE(std::isfinite(t));
  EXPECT_LT(tails[0], curves[0].front() - 1.5) << "the bf16 run did not learn";
  EXPECT_LE(rel(1), 0.0025) << "fp8 loses more than 0.25% against bf16";
  EXPECT_LE(std::fabs(rel(1)), 0.02) << "fp8 and bf16 part by more than 2%";
  fs::remove_all(dir);
}

}  // namespace
