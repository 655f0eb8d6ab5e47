// The SVG charts: well-formed documents, data drawn where the axes' labels say, 1-2-5 ticks
// that cover the data, gaps at NaN, escaped text, and thinning that keeps the extremes.
#include "core/svg_chart.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <regex>
#include <string>
#include <vector>

#include "core/units.h"
#include "svg_check.h"

namespace strata::svg {
namespace {

using strata::testing::xml_problem;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

using Path = strata::testing::SvgPath;
Path series_path(const std::string& svg, const std::string& name) {
  return strata::testing::svg_series_path(svg, name);
}

// The pixel coordinate of the tick labelled `label` (y for class "ytick", x for "xtick"),
// NaN when there is none.
double tick_at(const std::string& svg, const std::string& cls, const std::string& label) {
  const size_t end = svg.find("class=\"" + cls + "\">" + label + "</text>");
  if (end == std::string::npos) return kNaN;
  const size_t start = svg.rfind("<text ", end);
  const std::string attribute = cls == "ytick" ? " y=\"" : " x=\"";
  return std::strtod(svg.c_str() + svg.find(attribute, start) + attribute.size(), nullptr);
}

int count(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos; at = haystack.find(needle, at + 1)) ++n;
  return n;
}

LineChart simple_chart() {
  LineChart c;
  c.title = "loss";
  c.x_label = "step";
  c.y_label = "loss";
  c.series.push_back({"loss", {0, 10, 20, 30, 40}, {100, 40, 20, 80, 0}});
  return c;
}

TEST(SvgChart, EveryKindOfChartIsWellFormedXml) {
  LineChart lines = simple_chart();
  lines.markers = {{20, "restart 1"}};
  LineChart stacked;
  stacked.stacked = true;
  stacked.y_unit = Unit::kBytes;
  stacked.series = {{"device", {1, 2, 3}, {1e9, 2e9, 1.5e9}},
                    {"host", {1, 2, 3}, {3e9, kNaN, 3e9}},
                    {"rss", {1, 2, 3}, {5e9, 6e9, 5e9}, Style::kLine},
                    {"skipped", {2}, {4e9}, Style::kPoints}};
  LineChart log = simple_chart();
  log.log_y = true;
  Timeline timeline;
  timeline.title = "step";
  timeline.lanes = {"compute", "h2d"};
  timeline.spans = {{0, 0, 0.01, "forward"}, {1, 0.002, 0.004, "chunk 3", 1}};
  timeline.legend = {"compute", "copy"};
  const std::vector<std::string> docs = {render_line_chart(lines),  render_line_chart(stacked),
                                         render_line_chart(log),    render_line_chart(LineChart{}),
                                         render_timeline(timeline), render_timeline(Timeline{})};
  for (const std::string& doc : docs) EXPECT_EQ(xml_problem(doc), "") << doc;
  const std::string page = stack_vertically(docs);
  EXPECT_EQ(xml_problem(page), "") << page;
  EXPECT_NE(page.find("fill=\"white\""), std::string::npos) << "no white background";
}

TEST(SvgChart, TheCheckerFindsBrokenXml) {
  // The checker is what the other tests stand on: it must refuse what a browser refuses.
  EXPECT_NE(xml_problem("<svg><g></svg>"), "");
  EXPECT_NE(xml_problem("<svg><text>a < b</text></svg>"), "");
  EXPECT_NE(xml_problem("<svg><text>a & b</text></svg>"), "");
  EXPECT_NE(xml_problem("<svg x=\"1\" x=\"2\"/>"), "");
  EXPECT_NE(xml_problem("<svg/><svg/>"), "");
  EXPECT_EQ(xml_problem("<svg a=\"&amp;\"><text>&lt;&#38;</text></svg>"), "");
}

TEST(SvgChart, PointsLandWhereTheAxisLabelsSay) {
  const std::string svg = render_line_chart(simple_chart());
  const Path loss = series_path(svg, "loss");
  ASSERT_EQ(loss.points.size(), 5u) << svg;
  // The point (10, 40) sits at the "10" tick of x and the "40" tick of y; (40, 0) at "40", "0".
  const double x10 = tick_at(svg, "xtick", "10"), y40 = tick_at(svg, "ytick", "40");
  const double x40 = tick_at(svg, "xtick", "40"), y0 = tick_at(svg, "ytick", "0");
  for (double v : {x10, y40, x40, y0}) ASSERT_TRUE(std::isfinite(v)) << svg;
  EXPECT_TRUE(std::abs(loss.points[1].first - x10) <= 0.051) << loss.points[1].first << " vs " << x10;
  EXPECT_TRUE(std::abs(loss.points[1].second - y40) <= 0.051) << loss.points[1].second << " vs " << y40;
  EXPECT_TRUE(std::abs(loss.points[4].first - x40) <= 0.051) << loss.points[4].first << " vs " << x40;
  EXPECT_TRUE(std::abs(loss.points[4].second - y0) <= 0.051) << loss.points[4].second << " vs " << y0;
  EXPECT_LT(y40, y0) << "larger values must be higher up";
}

TEST(SvgChart, StackedBandsSitOnEachOther) {
  LineChart c;
  c.stacked = true;
  c.series = {{"a", {0, 1, 2}, {10, 10, 10}}, {"b", {0, 1, 2}, {20, 20, 20}}};
  const std::string svg = render_line_chart(c);
  ASSERT_EQ(xml_problem(svg), "");
  // b's band spans 10..30: its outline's first point is at the "30" tick.
  const Path b = series_path(svg, "b");
  ASSERT_FALSE(b.points.empty()) << svg;
  const double y30 = tick_at(svg, "ytick", "30"), y10 = tick_at(svg, "ytick", "10");
  ASSERT_TRUE(std::isfinite(y30) && std::isfinite(y10)) << svg;
  EXPECT_TRUE(std::abs(b.points[0].second - y30) <= 0.051) << b.points[0].second << " vs " << y30;
  // Its bottom edge, drawn back from the last point, sits on a's top.
  EXPECT_TRUE(std::abs(b.points.back().second - y10) <= 0.051) << b.points.back().second << " vs " << y10;
}

TEST(SvgChart, FlatBandsTakeFewPoints) {
  // Tiers hold the same bytes for most of a run: 20,000 steps of it are a rectangle or two.
  LineChart c;
  c.stacked = true;
  c.y_unit = Unit::kBytes;
  Series device{"device", {}, {}}, host{"host", {}, {}};
  for (int i = 0; i < 20000; ++i) {
    device.x.push_back(i), host.x.push_back(i);
    device.y.push_back(4.0 * double(kGiB));
    host.y.push_back(i < 10000 ? 8.0 * double(kGiB) : 9.0 * double(kGiB));
  }
  c.series = {device, host};
  const std::string svg = render_line_chart(c);
  ASSERT_EQ(xml_problem(svg), "");
  EXPECT_LE(series_path(svg, "device").points.size(), 4u) << svg;
  EXPECT_LE(series_path(svg, "host").points.size(), 10u) << svg;
  EXPECT_LT(svg.size(), 8000u);
}

TEST(SvgChart, TicksStepOneTwoOrFiveAndCoverTheData) {
  std::srand(7);
  for (int trial = 0; trial < 2000; ++trial) {
    const double scale = std::pow(10.0, std::rand() % 16 - 8);
    double lo = (std::rand() / double(RAND_MAX) - 0.3) * scale;
    double hi = lo + std::rand() / double(RAND_MAX) * scale;
    const int target = 2 + std::rand() % 10;
    const std::vector<double> t = nice_ticks(lo, hi, target);
    ASSERT_GE(t.size(), 2u);
    const double step = t[1] - t[0];
    const double mantissa = step / std::pow(10.0, std::floor(std::log10(step) + 1e-9));
    EXPECT_TRUE(std::abs(mantissa - 1) < 1e-6 || std::abs(mantissa - 2) < 1e-6 || std::abs(mantissa - 5) < 1e-6)
        << "step " << step << " for [" << lo << ", " << hi << "]";
    for (size_t i = 1; i < t.size(); ++i)
      EXPECT_TRUE(std::abs((t[i] - t[i - 1]) - step) <= 1e-6 * step) << "uneven ticks for [" << lo << ", " << hi << "]";
    EXPECT_TRUE(t.front() <= lo + 1e-9 * scale && t.back() >= hi - 1e-9 * scale)
        << "[" << t.front() << ", " << t.back() << "] does not cover [" << lo << ", " << hi << "]";
    EXPECT_LE(static_cast<int>(t.size()), target + 2) << "[" << lo << ", " << hi << "] target " << target;
  }
}

TEST(SvgChart, TickLabelsReadInTheRangesUnit) {
  const std::vector<double> bytes = axis_ticks(0, 3.2 * double(kGiB), Unit::kBytes);
  EXPECT_EQ(format_ticks(bytes, Unit::kBytes), (std::vector<std::string>{"0", "1 GiB", "2 GiB", "3 GiB", "4 GiB"}));
  EXPECT_EQ(format_ticks(axis_ticks(0, 1.5 * double(kMiB), Unit::kBytes), Unit::kBytes),
            (std::vector<std::string>{"0", "0.5 MiB", "1.0 MiB", "1.5 MiB"}));
  // Ticks past 1 GiB for data below it stay in MiB, where they are exact (not "0.5 GiB").
  EXPECT_EQ(format_ticks(axis_ticks(0, 1020 * double(kMiB), Unit::kBytes), Unit::kBytes),
            (std::vector<std::string>{"0", "500 MiB", "1000 MiB", "1500 MiB"}));
  EXPECT_EQ(format_ticks(axis_ticks(0, 0.02, Unit::kSeconds, 5), Unit::kSeconds),
            (std::vector<std::string>{"0", "5 ms", "10 ms", "15 ms", "20 ms"}));
  EXPECT_EQ(format_ticks({0, 200e-6, 400e-6}, Unit::kSeconds), (std::vector<std::string>{"0", "200 us", "400 us"}));
  EXPECT_EQ(format_ticks({0, 20000, 40000}, Unit::kPlain), (std::vector<std::string>{"0", "20k", "40k"}));
  EXPECT_EQ(format_ticks({0, 0.5, 1}, Unit::kPlain), (std::vector<std::string>{"0", "0.5", "1.0"}));
  EXPECT_EQ(format_ticks({0, 50, 100}, Unit::kPercent), (std::vector<std::string>{"0", "50%", "100%"}));
}

TEST(SvgChart, NanMakesAGapInTheLine) {
  LineChart c;
  c.series.push_back({"s", {1, 2, 3, 4, 5, 6}, {1, 2, kNaN, 4, 5, 6}});
  Path p = series_path(render_line_chart(c), "s");
  EXPECT_EQ(p.runs, 2);
  EXPECT_EQ(p.points.size(), 5u);
  // A point alone between gaps is still drawn (as a dot).
  c.series[0].y = {1, kNaN, 3, kNaN, 5, 6};
  const std::string svg = render_line_chart(c);
  p = series_path(svg, "s");
  EXPECT_EQ(p.runs, 3);
  EXPECT_EQ(count(svg, "h0"), 2) << svg;
}

TEST(SvgChart, LogAxisTicksAtPowersOfTenAndSkipsNonPositiveValues) {
  LineChart c;
  c.log_y = true;
  c.series.push_back({"s", {1, 2, 3, 4}, {0.5, 0, 50, 800}});
  const std::string svg = render_line_chart(c);
  ASSERT_EQ(xml_problem(svg), "");
  EXPECT_EQ(series_path(svg, "s").runs, 2) << svg;
  for (const char* label : {"0.1", "1", "10", "100", "1000"})
    EXPECT_TRUE(std::isfinite(tick_at(svg, "ytick", label))) << label << " missing:\n" << svg;
  // Decades are evenly spaced.
  const double d1 = tick_at(svg, "ytick", "1") - tick_at(svg, "ytick", "10");
  const double d2 = tick_at(svg, "ytick", "10") - tick_at(svg, "ytick", "100");
  EXPECT_TRUE(std::abs(d1 - d2) <= 0.11) << d1 << " vs " << d2;
}

TEST(SvgChart, ValuesFromBadFilesNeitherHangNorBreakTheDocument) {
  LineChart c;
  // Steps beyond what doubles count in, and values at the edge of overflow.
  c.series.push_back({"s", {1e17, 1e17 + 32, 1e17 + 64, 5, 6}, {1, 2, 3, 1e308, -INFINITY}});
  c.series.push_back({"t", {1, 2}, {1e-300, 1e300}});
  c.markers = {{INFINITY, "x"}, {1e308, "y"}};
  for (bool log : {false, true}) {
    c.log_y = log;
    const std::string svg = render_line_chart(c);
    EXPECT_EQ(xml_problem(svg), "") << svg;
    EXPECT_FALSE(std::regex_search(svg, std::regex("[^a-z](nan|inf)"))) << svg;
    EXPECT_LT(svg.size(), 20000u);
  }
  Timeline t;
  t.lanes = {"a"};
  t.spans = {{0, 1e17, 1e17 + 1e-3, "far"}, {0, 0, INFINITY, "endless"}};
  const std::string svg = render_timeline(t);
  EXPECT_EQ(xml_problem(svg), "") << svg;
  EXPECT_FALSE(std::regex_search(svg, std::regex("[^a-z](nan|inf)"))) << svg;
}

TEST(SvgChart, TextIsEscaped) {
  LineChart c = simple_chart();
  c.title = "a <b> & \"c\" 'd'";
  c.series[0].name = "x<y";
  c.markers = {{10, "</svg>"}};
  const std::string svg = render_line_chart(c);
  EXPECT_EQ(xml_problem(svg), "") << svg;
  EXPECT_NE(svg.find("a &lt;b&gt; &amp; &quot;c&quot; &apos;d&apos;"), std::string::npos) << svg;
  EXPECT_NE(svg.find("x&lt;y"), std::string::npos);
  EXPECT_EQ(count(svg, "</svg>"), 1);
  Timeline t;
  t.lanes = {"<lane>"};
  t.spans = {{0, 0, 1, "a&b"}};
  t.legend = {"\"q\""};
  EXPECT_EQ(xml_problem(render_timeline(t)), "");
}

TEST(SvgChart, ThinningKeepsTheExtremesAndKeepsFilesSmall) {
  const int n = 50000;
  LineChart c;
  c.y_from_zero = false;
  Series s{"noise", {}, {}};
  for (int i = 0; i < n; ++i) {
    s.x.push_back(i);
    s.y.push_back(std::sin(i * 0.01) * 10);
  }
  s.y[31337] = 1000;  // one spike up, one down, each a single point among 50,000
  s.y[7777] = -1000;
  s.y[20000] = kNaN;  // and a gap, which thinning keeps too
  c.series.push_back(s);
  const int width = 900;
  const std::string svg = render_line_chart(c, width);
  ASSERT_EQ(xml_problem(svg), "");
  EXPECT_LT(svg.size(), 200000u) << "50,000 points should not take " << svg.size() << " bytes";
  const Path p = series_path(svg, "noise");
  EXPECT_LE(p.points.size(), 4u * width);
  EXPECT_EQ(p.runs, 2);
  double top = INFINITY, bottom = -INFINITY;
  for (const auto& [x, y] : p.points) top = std::min(top, y), bottom = std::max(bottom, y);
  const double y1000 = tick_at(svg, "ytick", "1000"), ym1000 = tick_at(svg, "ytick", "-1000");
  ASSERT_TRUE(std::isfinite(y1000) && std::isfinite(ym1000)) << svg;
  EXPECT_TRUE(std::abs(top - y1000) <= 0.051) << "the spike is lost: top " << top << " vs " << y1000;
  EXPECT_TRUE(std::abs(bottom - ym1000) <= 0.051) << "the dip is lost: bottom " << bottom << " vs " << ym1000;
}

TEST(SvgChart, EmptyOrAllNanSeriesSayNoData) {
  LineChart c;
  c.title = "nothing";
  EXPECT_NE(render_line_chart(c).find(">no data<"), std::string::npos);
  c.series.push_back({"s", {1, 2}, {kNaN, kNaN}});
  EXPECT_NE(render_line_chart(c).find(">no data<"), std::string::npos);
  c.stacked = true;
  c.series.push_back({"t", {}, {}});
  c.series[0].style = Style::kLine;
  EXPECT_NE(render_line_chart(c).find(">no data<"), std::string::npos);
  c.log_y = true;
  c.series[0].y = {0, -1};
  EXPECT_NE(render_line_chart(c).find(">no data<"), std::string::npos);
  // A single point has an axis of some length around it.
  LineChart one;
  one.series.push_back({"s", {3}, {7}});
  const std::string svg = render_line_chart(one);
  EXPECT_EQ(svg.find("no data"), std::string::npos);
  EXPECT_FALSE(std::regex_search(svg, std::regex("[^a-z](nan|inf)"))) << svg;
  EXPECT_EQ(series_path(svg, "s").points.size(), 1u);
}

TEST(SvgChart, TimelineDrawsSpansWithTooltipsAndMergesCrowds) {
  Timeline t;
  t.title = "one step";
  t.lanes = {"compute", "copy"};
  t.legend = {"forward", "transfer"};
  t.spans = {{0, 0.0, 0.5, "forward layer 0"}, {1, 0.1, 0.3, "chunk 7", 1}, {5, 0, 1, "no such lane"}};
  std::string svg = render_timeline(t);
  ASSERT_EQ(xml_problem(svg), "");
  EXPECT_NE(svg.find("<title>forward layer 0</title>"), std::string::npos);
  EXPECT_NE(svg.find("<title>chunk 7</title>"), std::string::npos);
  EXPECT_EQ(svg.find("no such lane"), std::string::npos);
  EXPECT_NE(svg.find(">transfer<"), std::string::npos);
  // 20,000 back-to-back spans of 50 us over one second: far narrower than a pixel.
  for (int i = 0; i < 20000; ++i) t.spans.push_back({1, 1 + i * 50e-6, 1 + (i + 1) * 50e-6, "tiny", 1});
  svg = render_timeline(t);
  ASSERT_EQ(xml_problem(svg), "");
  EXPECT_LT(count(svg, "<rect"), 100) << "tiny spans were not merged";
  EXPECT_NE(svg.find("tiny (and "), std::string::npos);
}

TEST(SvgChart, StackingAddsHeightsAndKeepsWidestWidth) {
  const std::string a = render_line_chart(simple_chart(), 900, 300);
  const std::string b = render_line_chart(simple_chart(), 600, 200);
  const std::string page = stack_vertically({a, b});
  ASSERT_EQ(xml_problem(page), "");
  EXPECT_EQ(page.find("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"900\" height=\"500\""), 0u)
      << page.substr(0, 200);
  EXPECT_NE(page.find("<svg y=\"300\""), std::string::npos);
}

}  // namespace
}  // namespace strata::svg
