// The step line and metrics.jsonl: durations read as a person would write them, and the
// estimated time left appears in both.
#include "train/metrics.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace strata {
namespace {

TEST(MetricsTest, DurationsReadLikeClockTime) {
  EXPECT_EQ(format_duration(0), "0s");
  EXPECT_EQ(format_duration(44.6), "45s");
  EXPECT_EQ(format_duration(59.4), "59s");
  EXPECT_EQ(format_duration(60), "1m00s");
  EXPECT_EQ(format_duration(725), "12m05s");
  EXPECT_EQ(format_duration(3599), "59m59s");
  EXPECT_EQ(format_duration(3600), "1h00m");
  EXPECT_EQ(format_duration(11220), "3h07m");
  EXPECT_EQ(format_duration(-5), "0s");
}

TEST(MetricsTest, EtaIsInTheStepLineAndTheJsonWhenKnown) {
  StepMetrics m;
  m.step = 10;
  m.total_steps = 200;
  m.eta_s = 95;
  EXPECT_NE(format_step_line(m).find(" | eta 1m35s | "), std::string::npos) << format_step_line(m);
  m.eta_s = -1;
  EXPECT_EQ(format_step_line(m).find("eta"), std::string::npos) << format_step_line(m);

  const std::filesystem::path path =
      std::filesystem::path(::testing::TempDir()) / ("strata_metrics_" + std::to_string(::getpid()) + ".jsonl");
  {
    Result<MetricsWriter> w = MetricsWriter::open(path.string());
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    m.eta_s = 12.5;
    ASSERT_TRUE(w->write(m).ok());
  }
  std::ifstream in(path);
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  EXPECT_EQ(nlohmann::json::parse(line)["eta_s"].get<double>(), 12.5) << line;
  std::filesystem::remove(path);
}

TEST(MetricsTest, RssIsShownAgainstThePlannedPeakAndEventsFollowTheSteps) {
  StepMetrics m;
  m.step = 1;
  m.total_steps = 2;
  m.rss_bytes = 61ull << 20;
  EXPECT_EQ(format_step_line(m).find("planned"), std::string::npos) << "no plan, no comparison";
  m.rss_planned_bytes = 80ull << 20;
  EXPECT_NE(format_step_line(m).find("| rss 61.00 MiB / 80.00 MiB planned"), std::string::npos) << format_step_line(m);

  const std::filesystem::path path =
      std::filesystem::path(::testing::TempDir()) / ("strata_metrics_rss_" + std::to_string(::getpid()) + ".jsonl");
  {
    Result<MetricsWriter> w = MetricsWriter::open(path.string());
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    ASSERT_TRUE(w->write(m).ok());
    ASSERT_TRUE(w->append(R"({"event":"goodput","wall_s":1.5})").ok());
  }
  std::ifstream in(path);
  std::string step, event;
  ASSERT_TRUE(std::getline(in, step));
  ASSERT_TRUE(std::getline(in, event));
  EXPECT_EQ(nlohmann::json::parse(step)["rss_planned_bytes"].get<uint64_t>(), 80ull << 20) << step;
  EXPECT_EQ(nlohmann::json::parse(event)["event"], "goodput") << event;
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace strata
