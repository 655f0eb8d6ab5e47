// Charts as standalone SVG text: line and stacked-area charts, lane timelines, and a page of
// several charts one above the other. The output needs no fonts, CSS or scripts from
// elsewhere and has a white background, so a browser and GitHub show it as it is.
// Pure functions; safe for concurrent use.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace strata::svg {

// How tick labels read: kPlain 12k / 3.5, kBytes 512 MiB / 1.5 GiB (binary units, ticks at
// 1-2-5 steps of the unit), kSeconds 250 us / 20 ms / 1.5 s, kPercent 25% (values in percent).
enum class Unit { kPlain, kBytes, kSeconds, kPercent };

// kAuto: a line, or a band of the stack when the chart is stacked. kLine: a line even in a
// stacked chart (drawn over the stack, e.g. RSS above memory per tier). kPoints: a cross at
// each point, no line (events such as skipped steps).
enum class Style { kAuto, kLine, kPoints };

struct Series {
  std::string name;
  std::vector<double> x, y;  // the same length; a NaN y (or x) is a gap in the line
  Style style = Style::kAuto;
};

struct LineChart {
  std::string title, x_label, y_label;
  Unit x_unit = Unit::kPlain, y_unit = Unit::kPlain;
  std::vector<Series> series;
  // Stacked areas (memory per tier), else lines. The kAuto series of a stacked chart must share
  // one x (a programmer error otherwise); a NaN y counts as 0 below the bands above it.
  bool stacked = false;
  // The y axis includes 0 (ignored with log_y).
  bool y_from_zero = true;
  // A log10 y axis; values <= 0 are gaps on it.
  bool log_y = false;
  std::vector<std::pair<double, std::string>> markers;  // vertical lines at x, labelled
};

// A chart `width` x `height` pixels. A series of more points than the plot has pixel columns is
// thinned to the first, lowest, highest and last point of each column, so extremes survive and
// files stay small. With no finite point at all it draws the frame and "no data".
std::string render_line_chart(const LineChart& c, int width = 900, int height = 360);

struct Span {
  int lane;
  double start, end;  // seconds
  std::string label;  // shown as the span's tooltip
  int color = 0;      // index into a fixed palette (wraps around)
};

struct Timeline {
  std::string title, x_label;       // x in seconds
  std::vector<std::string> lanes;   // one row per lane, labelled on the left
  std::vector<Span> spans;          // a span whose lane is not in `lanes` is not drawn
  std::vector<std::string> legend;  // the name of each color index used
};

// A timeline `width` pixels wide; its height follows from the number of lanes. Spans narrower
// than a pixel that follow each other in a lane with the same color merge into one rectangle
// (its tooltip says how many it holds).
std::string render_timeline(const Timeline& t, int width = 1200);

// Several SVG documents made by this file, one above the other in one document as wide as the
// widest.
std::string stack_vertically(const std::vector<std::string>& svgs);

// The building blocks, public for tests and for callers that draw their own axes.

// Tick values at a 1-2-5 step (1, 2 or 5 times a power of ten), at most about `target` of them,
// from the largest multiple of the step <= lo to the smallest >= hi, so they cover [lo, hi].
// REQUIRES: lo <= hi, both finite; target >= 2.
std::vector<double> nice_ticks(double lo, double hi, int target = 6);

// The ticks of an axis in `unit`: 1-2-5 steps of the unit the range reads in (GiB, ms, ...).
std::vector<double> axis_ticks(double lo, double hi, Unit unit, int target = 6);

// Labels for ticks from axis_ticks: one unit for all of them (the one their largest reads in)
// and as many decimals as their spacing needs: {0, 0.5, 1, 1.5} GiB -> "0", "0.5 GiB", ...
std::vector<std::string> format_ticks(const std::vector<double>& ticks, Unit unit);

// `text` with &, <, >, " and ' written as XML entities.
std::string xml_escape(const std::string& text);

}  // namespace strata::svg
