#include "core/svg_chart.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/check.h"

namespace strata::svg {
namespace {

// Colors that stay apart from each other on white and for the common kinds of color blindness.
constexpr const char* kPalette[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                                    "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};
constexpr int kPaletteSize = static_cast<int>(std::size(kPalette));

// Room right of the plot for half of the last x tick's label ("1.50 GiB", "200 ms").
constexpr double kRightMargin = 32;

const char* color(int index) { return kPalette[((index % kPaletteSize) + kPaletteSize) % kPaletteSize]; }

// Finite and far from overflowing when ranges and sums are taken: values beyond are not drawn
// (they come from files, so anything can be there).
bool drawable(double v) { return std::abs(v) <= 1e300; }

// Coordinates with one decimal: a tenth of a pixel is below what a screen shows.
std::string px(double v) { return fmt::format("{:.1f}", v); }

std::string open_svg(int width, int height) {
  return fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\" fill=\"#222\">\n<rect width=\"{0}\" height=\"{1}\" "
      "fill=\"white\"/>\n",
      width, height);
}

std::string text(double x, double y, const std::string& s, const std::string& extra = "") {
  return fmt::format("<text x=\"{}\" y=\"{}\"{}>{}</text>\n", px(x), px(y), extra.empty() ? "" : " " + extra,
                     xml_escape(s));
}

// The scale a unit's labels read in (1024^k bytes, 1e-3 s, 1e3 plain) for a largest magnitude.
struct Scale {
  double factor = 1;
  const char* suffix = "";
};

Scale scale_for(double magnitude, Unit unit) {
  switch (unit) {
    case Unit::kBytes: {
      static constexpr const char* kNames[] = {" B", " KiB", " MiB", " GiB", " TiB", " PiB"};
      int k = 0;
      double f = 1;
      while (k + 1 < static_cast<int>(std::size(kNames)) && magnitude >= f * 1024) {
        f *= 1024;
        ++k;
      }
      return {f, kNames[k]};
    }
    case Unit::kSeconds:
      if (magnitude < 1e-3) return {1e-6, " us"};
      if (magnitude < 1) return {1e-3, " ms"};
      return {1, " s"};
    case Unit::kPercent:
      return {1, "%"};
    case Unit::kPlain:
      if (magnitude >= 1e9) return {1e9, "G"};
      if (magnitude >= 1e6) return {1e6, "M"};
      if (magnitude >= 1e4) return {1e3, "k"};
      return {1, ""};
  }
  return {};
}

int decimals_for(double step) {
  if (!(step > 0)) return 0;
  return std::clamp(static_cast<int>(std::ceil(-std::log10(step) - 1e-9)), 0, 9);
}

std::string format_in(double value, Scale s, int decimals) {
  if (value == 0) return "0";
  return fmt::format("{:.{}f}{}", value / s.factor, decimals, s.suffix);
}

// A linear or log10 axis from a screen interval onto a value interval.
struct Axis {
  double lo = 0, hi = 1;    // values at the ends (log10 of them on a log axis)
  double from = 0, to = 1;  // pixels at lo and hi
  bool log = false;
  double map(double v) const {
    const double t = log ? std::log10(v) : v;
    return from + (t - lo) / (hi - lo) * (to - from);
  }
};

// Log-axis ticks: each decade, and 2x and 5x within it while the range spans few decades.
std::vector<double> log_ticks(double lo, double hi) {
  const int first = static_cast<int>(std::floor(std::log10(lo) + 1e-9));
  const int last = std::max(first + 1, static_cast<int>(std::ceil(std::log10(hi) - 1e-9)));
  const int every = (last - first + 7) / 8;  // at most about 8 decades labelled
  std::vector<double> ticks;
  for (int e = first; e < last + every; e += every) {
    const double d = std::pow(10.0, e);
    ticks.push_back(d);
    if (last - first <= 2 && e < last) {
      ticks.push_back(2 * d);
      ticks.push_back(5 * d);
    }
  }
  return ticks;
}

constexpr size_t kGap = static_cast<size_t>(-1);

// The indexes of the points of one series to draw, in order, kGap where the line breaks.
// Beyond one point per pixel column, each column keeps its first, lowest, highest and last
// point, so that a spike survives however many points share its column.
std::vector<size_t> decimate(const std::vector<double>& x, const std::vector<double>& y, const Axis& ax, bool log_y) {
  const size_t n = std::min(x.size(), y.size());
  auto usable = [&](size_t i) { return drawable(x[i]) && drawable(y[i]) && (!log_y || y[i] > 0); };
  std::vector<size_t> out;
  if (static_cast<double>(n) <= std::abs(ax.to - ax.from)) {
    for (size_t i = 0; i < n; ++i) out.push_back(usable(i) ? i : kGap);
    return out;
  }
  size_t first = 0, lowest = 0, highest = 0, last = 0;
  bool open = false;
  double column = 0;
  auto flush = [&] {
    if (!open) return;
    size_t keep[] = {first, lowest, highest, last};
    std::sort(std::begin(keep), std::end(keep));
    for (size_t k = 0; k < 4; ++k)
      if (k == 0 || keep[k] != keep[k - 1]) out.push_back(keep[k]);
    open = false;
  };
  for (size_t i = 0; i < n; ++i) {
    if (!usable(i)) {
      flush();
      out.push_back(kGap);
      continue;
    }
    const double c = std::floor(ax.map(x[i]));
    if (open && c != column) flush();
    if (!open) {
      first = lowest = highest = i;
      column = c;
      open = true;
    }
    if (y[i] < y[lowest]) lowest = i;
    if (y[i] > y[highest]) highest = i;
    last = i;
  }
  flush();
  return out;
}

// "M x y L x y ..." per run of points between gaps; a lone point is a dot (a zero-length line
// with round caps).
std::string line_path(const std::vector<size_t>& keep, const std::vector<double>& x, const std::vector<double>& y,
                      const Axis& ax, const Axis& ay) {
  std::string d;
  size_t run = 0;
  for (size_t i : keep) {
    if (i == kGap) {
      if (run == 1) d += "h0";
      run = 0;
      continue;
    }
    d += fmt::format("{}{} {}", run == 0 ? (d.empty() ? "M" : " M") : " L", px(ax.map(x[i])), px(ay.map(y[i])));
    ++run;
  }
  if (run == 1) d += "h0";
  return d;
}

struct Point {
  double x, y;  // pixels
};

// Points rounded as they are printed, less those that change nothing: repeats, and the middle
// of three on one horizontal line. Stacked bands are mostly flat (a tier's bytes change
// rarely), so this keeps their files small.
std::vector<Point> without_flat_middles(const std::vector<Point>& in) {
  std::vector<Point> out;
  for (Point p : in) {
    p = {std::round(p.x * 10) / 10, std::round(p.y * 10) / 10};
    if (!out.empty() && out.back().x == p.x && out.back().y == p.y) continue;
    const size_t n = out.size();
    if (n >= 2 && out[n - 1].y == p.y && out[n - 2].y == p.y &&
        (out[n - 2].x <= out[n - 1].x) == (out[n - 1].x <= p.x)) {
      out.back() = p;
      continue;
    }
    out.push_back(p);
  }
  return out;
}

// "Mx y Lx y ...".
std::string polyline(const std::vector<Point>& pts) {
  std::string d;
  for (const Point& p : pts) d += fmt::format("{}{} {}", d.empty() ? "M" : " L", px(p.x), px(p.y));
  return d;
}

struct Frame {
  double left, top, right, bottom;
};

std::string draw_title_and_legend(const std::string& title,
                                  const std::vector<std::pair<std::string, std::string>>& legend, double left) {
  std::string s = title.empty() ? "" : text(left, 20, title, "font-size=\"15\" font-weight=\"bold\"");
  double x = left;
  for (const auto& [name, swatch] : legend) {
    s += fmt::format("<g transform=\"translate({},{})\">{}</g>\n", px(x), 34, swatch);
    s += text(x + 18, 38, name);
    x += 30 + 7.0 * static_cast<double>(name.size());
  }
  return s;
}

std::string draw_axes(const Frame& f, const Axis& ax, const std::vector<double>& xt, const std::vector<std::string>& xl,
                      const Axis& ay, const std::vector<double>& yt, const std::vector<std::string>& yl,
                      const std::string& x_label, const std::string& y_label) {
  std::string s = "<g stroke=\"#e4e4e4\">\n";
  for (double v : yt) {
    const double y = ay.map(v);
    s += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\"/>\n", px(f.left), px(y), px(f.right), px(y));
  }
  for (double v : xt) {
    const double x = ax.map(v);
    s += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\"/>\n", px(x), px(f.top), px(x), px(f.bottom));
  }
  s += "</g>\n";
  s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888\"/>\n", px(f.left),
                   px(f.top), px(f.right - f.left), px(f.bottom - f.top));
  // Tick labels sit exactly at their tick: y labels centred on it, x labels below it.
  for (size_t i = 0; i < yt.size(); ++i)
    s += text(f.left - 6, ay.map(yt[i]), yl[i], "text-anchor=\"end\" dominant-baseline=\"middle\" class=\"ytick\"");
  for (size_t i = 0; i < xt.size(); ++i)
    s += text(ax.map(xt[i]), f.bottom + 16, xl[i], "text-anchor=\"middle\" class=\"xtick\"");
  if (!x_label.empty()) s += text((f.left + f.right) / 2, f.bottom + 34, x_label, "text-anchor=\"middle\"");
  if (!y_label.empty())
    s += fmt::format("<text transform=\"translate(14,{}) rotate(-90)\" text-anchor=\"middle\">{}</text>\n",
                     px((f.top + f.bottom) / 2), xml_escape(y_label));
  return s;
}

std::string no_data(const Frame& f) {
  return fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888\"/>\n", px(f.left),
                     px(f.top), px(f.right - f.left), px(f.bottom - f.top)) +
         text((f.left + f.right) / 2, (f.top + f.bottom) / 2, "no data",
              "text-anchor=\"middle\" font-size=\"16\" fill=\"#888\"");
}

// Equal, NaN matching NaN (a gap shared by all bands).
bool same_x(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
  return true;
}

// Widens [lo, hi] when it is a single value, so that an axis has a length.
void widen(double* lo, double* hi) {
  if (*hi > *lo) return;
  const double pad = *lo == 0 ? 1 : std::abs(*lo) * 0.1;
  *lo -= pad;
  *hi += pad;
}

}  // namespace

std::string xml_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // Control characters other than tab and newline are not allowed in XML 1.0 at all.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n')
          out += ' ';
        else
          out += c;
    }
  }
  return out;
}

std::vector<double> nice_ticks(double lo, double hi, int target) {
  CHECK(std::isfinite(lo) && std::isfinite(hi) && lo <= hi && target >= 2);
  widen(&lo, &hi);
  const double rough = (hi - lo) / (target - 1);
  const double magnitude = std::pow(10.0, std::floor(std::log10(rough)));
  double step = 10 * magnitude;
  for (double m : {1.0, 2.0, 5.0})
    if (m * magnitude >= rough * (1 - 1e-9)) {
      step = m * magnitude;
      break;
    }
  const double first = std::floor(lo / step + 1e-9);
  const double last = std::ceil(hi / step - 1e-9);
  // Where doubles cannot count in steps (a range tiny beside its values, 1e17 + 32), the ends
  // are the ticks.
  if (!(std::abs(first) < 0x1p52 && std::abs(last) < 0x1p52 && last - first <= 4.0 * target)) return {lo, hi};
  std::vector<double> ticks;
  for (double k = first; k <= last; k += 1) ticks.push_back(k == 0 ? 0.0 : k * step);
  return ticks;
}

std::vector<double> axis_ticks(double lo, double hi, Unit unit, int target) {
  const Scale s = scale_for(std::max(std::abs(lo), std::abs(hi)), unit);
  std::vector<double> ticks = nice_ticks(lo / s.factor, hi / s.factor, target);
  for (double& t : ticks) t *= s.factor;
  return ticks;
}

std::vector<std::string> format_ticks(const std::vector<double>& ticks, Unit unit) {
  double magnitude = 0;
  for (double t : ticks) magnitude = std::max(magnitude, std::abs(t));
  // A lone tick (a log axis labels each on its own) needs the decimals of its own value.
  const double spacing = ticks.size() >= 2 ? std::abs(ticks[1] - ticks[0]) : magnitude;
  Scale s = scale_for(magnitude, unit);
  // The largest unit in which every label is exact: ticks from 0 to 1200 MiB at 200 MiB read
  // "1200 MiB", not "0.2 GiB" for 195.3 MiB.
  for (;;) {
    const double step = spacing / s.factor, scale = std::pow(10.0, decimals_for(step));
    bool exact = true;
    for (double t : ticks) exact &= std::abs(std::round(t / s.factor * scale) / scale - t / s.factor) <= 1e-6 * step;
    const Scale lower = scale_for(s.factor * 0.999, unit);
    if (exact || lower.factor >= s.factor) break;
    s = lower;
  }
  std::vector<std::string> labels;
  for (double t : ticks) labels.push_back(format_in(t, s, decimals_for(spacing / s.factor)));
  return labels;
}

std::string render_line_chart(const LineChart& c, int width, int height) {
  CHECK(width >= 200 && height >= 120);
  const Frame f{72, 52, static_cast<double>(width) - kRightMargin, static_cast<double>(height) - 44};
  auto stacks = [&](const Series& s) { return c.stacked && s.style == Style::kAuto; };
  for (const Series& s : c.series)
    CHECK_MSG(s.x.size() == s.y.size(), "series '" + s.name + "': x and y differ in length");

  // The bands of a stacked chart: running totals over the kAuto series, which share one x.
  const Series* stack_x = nullptr;
  std::vector<std::vector<double>> base;  // base[k][i]: the bottom of band k at point i
  std::vector<double> total;
  for (const Series& s : c.series) {
    if (!stacks(s)) continue;
    if (stack_x == nullptr) {
      stack_x = &s;
      total.assign(s.x.size(), 0.0);
    }
    CHECK_MSG(same_x(s.x, stack_x->x), "stacked series '" + s.name + "' does not share the first band's x");
    base.push_back(total);
    for (size_t i = 0; i < s.y.size(); ++i)
      if (drawable(s.y[i])) total[i] += s.y[i];
  }

  // The data's extent.
  double x_lo = INFINITY, x_hi = -INFINITY, y_lo = INFINITY, y_hi = -INFINITY;
  auto take = [&](double x, double y) {
    if (!drawable(x) || !drawable(y) || (c.log_y && !(y > 0))) return;
    x_lo = std::min(x_lo, x), x_hi = std::max(x_hi, x);
    y_lo = std::min(y_lo, y), y_hi = std::max(y_hi, y);
  };
  size_t band = 0;
  for (const Series& s : c.series) {
    if (stacks(s)) {
      for (size_t i = 0; i < s.y.size(); ++i)
        if (drawable(s.y[i])) take(s.x[i], base[band][i] + s.y[i]), take(s.x[i], base[band][i]);
      ++band;
    } else {
      for (size_t i = 0; i < s.y.size(); ++i) take(s.x[i], s.y[i]);
    }
  }

  std::vector<std::pair<std::string, std::string>> legend;
  for (size_t k = 0; k < c.series.size(); ++k) {
    const Series& s = c.series[k];
    if (s.name.empty()) continue;
    const char* col = color(static_cast<int>(k));
    std::string swatch =
        stacks(s) ? fmt::format("<rect width=\"14\" height=\"8\" fill=\"{}\" fill-opacity=\"0.6\"/>", col)
        : s.style == Style::kPoints
            ? fmt::format("<path d=\"M4 0l6 8M4 8l6 -8\" stroke=\"{}\" stroke-width=\"1.5\"/>", col)
            : fmt::format("<line x1=\"0\" y1=\"4\" x2=\"14\" y2=\"4\" stroke=\"{}\" stroke-width=\"2\"/>", col);
    legend.emplace_back(s.name, swatch);
  }

  std::string out = open_svg(width, height);
  out += draw_title_and_legend(c.title, legend, f.left);
  if (!(x_lo <= x_hi)) {
    out += no_data(f);
    return out + "</svg>\n";
  }
  for (const auto& [mx, label] : c.markers)
    if (drawable(mx)) x_lo = std::min(x_lo, mx), x_hi = std::max(x_hi, mx);
  if (c.y_from_zero && !c.log_y) y_lo = std::min(y_lo, 0.0), y_hi = std::max(y_hi, 0.0);

  widen(&x_lo, &x_hi);
  std::vector<double> xt = axis_ticks(x_lo, x_hi, c.x_unit, std::max(2, (width - 100) / 90));
  Axis ax{std::min(xt.front(), x_lo), std::max(xt.back(), x_hi), f.left, f.right, false};
  std::vector<double> yt;
  std::vector<std::string> yl;
  Axis ay;
  if (c.log_y) {
    yt = log_ticks(y_lo, y_hi);
    for (double t : yt) yl.push_back(format_ticks({t}, c.y_unit).front());
    ay = {std::log10(yt.front()), std::log10(yt.back()), f.bottom, f.top, true};
  } else {
    widen(&y_lo, &y_hi);
    yt = axis_ticks(y_lo, y_hi, c.y_unit, std::max(2, (height - 96) / 40));
    yl = format_ticks(yt, c.y_unit);
    ay = {std::min(yt.front(), y_lo), std::max(yt.back(), y_hi), f.bottom, f.top, false};
  }
  out += draw_axes(f, ax, xt, format_ticks(xt, c.x_unit), ay, yt, yl, c.x_label, c.y_label);

  // Bands first, lines and points over them.
  if (stack_x != nullptr) {
    // One set of kept indexes for all bands: those that keep the extremes of the stack's top.
    const std::vector<size_t> keep = decimate(stack_x->x, total, ax, false);
    band = 0;
    for (size_t k = 0; k < c.series.size(); ++k) {
      const Series& s = c.series[k];
      if (!stacks(s)) continue;
      const std::vector<double>& b = base[band++];
      std::string area, top;
      // One closed shape per run of points where the band is defined: its top edge forward,
      // its bottom edge (the top of the band below) back.
      std::vector<size_t> run;
      auto close_run = [&] {
        if (!run.empty()) {
          std::vector<Point> upper, lower;
          for (size_t i : run) upper.push_back({ax.map(s.x[i]), ay.map(b[i] + s.y[i])});
          for (auto it = run.rbegin(); it != run.rend(); ++it) lower.push_back({ax.map(s.x[*it]), ay.map(b[*it])});
          upper = without_flat_middles(upper);
          lower = without_flat_middles(lower);
          const std::string edge = polyline(upper);
          top += edge + (upper.size() == 1 ? "h0 " : " ");
          area += edge + " L" + polyline(lower).substr(1) + " Z ";
        }
        run.clear();
      };
      for (size_t i : keep) {
        if (i != kGap && drawable(s.y[i]))
          run.push_back(i);
        else
          close_run();
      }
      close_run();
      out += fmt::format("<g><title>{}</title><path d=\"{}\" fill=\"{}\" fill-opacity=\"0.55\" stroke=\"none\"/>",
                         xml_escape(s.name), area, color(static_cast<int>(k)));
      out += fmt::format(
          "<path d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" stroke-linecap=\"round\"/></g>\n", top,
          color(static_cast<int>(k)));
    }
  }
  for (size_t k = 0; k < c.series.size(); ++k) {
    const Series& s = c.series[k];
    if (stacks(s)) continue;
    const char* col = color(static_cast<int>(k));
    if (s.style == Style::kPoints) {
      std::string d;
      for (size_t i = 0; i < s.x.size(); ++i) {
        if (!drawable(s.x[i]) || !drawable(s.y[i]) || (c.log_y && !(s.y[i] > 0))) continue;
        const double x = ax.map(s.x[i]), y = ay.map(s.y[i]);
        d += fmt::format("M{} {}l7 7M{} {}l7 -7", px(x - 3.5), px(y - 3.5), px(x - 3.5), px(y + 3.5));
      }
      out += fmt::format("<g><title>{}</title><path d=\"{}\" stroke=\"{}\" stroke-width=\"2\"/></g>\n",
                         xml_escape(s.name), d, col);
      continue;
    }
    out += fmt::format(
        "<g><title>{}</title><path class=\"series\" d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" "
        "stroke-linejoin=\"round\" stroke-linecap=\"round\"/></g>\n",
        xml_escape(s.name), line_path(decimate(s.x, s.y, ax, c.log_y), s.x, s.y, ax, ay), col);
  }
  for (const auto& [mx, label] : c.markers) {
    if (!drawable(mx)) continue;
    const double x = ax.map(mx);
    out += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#555\" stroke-dasharray=\"4 3\"/>\n",
                       px(x), px(f.top), px(f.bottom));
    out += text(x + 3, f.top + 11, label, "font-size=\"10\" fill=\"#555\"");
  }
  return out + "</svg>\n";
}

std::string render_timeline(const Timeline& t, int width) {
  CHECK(width >= 200);
  const double lane_h = 18, lane_gap = 4;
  size_t longest = 0;
  for (const std::string& l : t.lanes) longest = std::max(longest, l.size());
  const double left = std::clamp(16 + 7.0 * static_cast<double>(longest), 60.0, 240.0);
  const double top = t.legend.empty() ? 34 : 52;
  const double lanes_h = std::max<double>(1, static_cast<double>(t.lanes.size())) * (lane_h + lane_gap);
  const Frame f{left, top, static_cast<double>(width) - kRightMargin, top + lanes_h};
  const int height = static_cast<int>(std::ceil(f.bottom + 44));

  std::vector<std::pair<std::string, std::string>> legend;
  for (size_t i = 0; i < t.legend.size(); ++i)
    legend.emplace_back(t.legend[i],
                        fmt::format("<rect width=\"14\" height=\"8\" fill=\"{}\"/>", color(static_cast<int>(i))));
  std::string out = open_svg(width, height);
  out += draw_title_and_legend(t.title, legend, f.left);

  double lo = INFINITY, hi = -INFINITY;
  const int lanes = static_cast<int>(t.lanes.size());
  for (const Span& s : t.spans)
    if (s.lane >= 0 && s.lane < lanes && drawable(s.start) && drawable(s.end))
      lo = std::min({lo, s.start, s.end}), hi = std::max({hi, s.start, s.end});
  if (!(lo <= hi)) {
    out += no_data(f);
    return out + "</svg>\n";
  }
  lo = std::min(lo, 0.0);
  widen(&lo, &hi);
  const std::vector<double> xt = axis_ticks(lo, hi, Unit::kSeconds, std::max(2, (width - 100) / 90));
  const Axis ax{xt.front(), xt.back(), f.left, f.right, false};

  std::string s;
  for (int l = 0; l < lanes; ++l) {
    const double y = f.top + l * (lane_h + lane_gap) + lane_gap / 2;
    if (l % 2 == 1)
      s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#f4f4f4\"/>\n", px(f.left),
                       px(y - lane_gap / 2), px(f.right - f.left), px(lane_h + lane_gap));
    s += text(f.left - 6, y + lane_h / 2, t.lanes[static_cast<size_t>(l)],
              "text-anchor=\"end\" dominant-baseline=\"middle\"");
  }
  out += s;
  out +=
      draw_axes(f, ax, xt, format_ticks(xt, Unit::kSeconds), Axis{0, 1, f.bottom, f.top, false}, {}, {}, t.x_label, "");

  // Per lane in time order; runs of sub-pixel spans of one color merge into one rectangle.
  std::vector<const Span*> order;
  for (const Span& sp : t.spans)
    if (sp.lane >= 0 && sp.lane < lanes && drawable(sp.start) && drawable(sp.end)) order.push_back(&sp);
  std::stable_sort(order.begin(), order.end(), [](const Span* a, const Span* b) {
    return a->lane != b->lane ? a->lane < b->lane : a->start < b->start;
  });
  struct Box {
    int lane, color;
    double x0, x1;
    std::string label;
    int merged;
  };
  std::vector<Box> boxes;
  for (const Span* sp : order) {
    const double x0 = ax.map(std::min(sp->start, sp->end)), x1 = ax.map(std::max(sp->start, sp->end));
    if (!boxes.empty()) {
      Box& b = boxes.back();
      if (b.lane == sp->lane && b.color == sp->color && x1 - x0 < 1 && x0 - b.x1 < 1) {
        b.x1 = std::max(b.x1, x1);
        ++b.merged;
        continue;
      }
    }
    boxes.push_back({sp->lane, sp->color, x0, x1, sp->label, 0});
  }
  for (const Box& b : boxes) {
    const double y = f.top + b.lane * (lane_h + lane_gap) + lane_gap / 2;
    const std::string tip = b.merged > 0 ? fmt::format("{} (and {} more)", b.label, b.merged) : b.label;
    out += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"><title>{}</title></rect>\n",
                       px(b.x0), px(y), px(std::max(b.x1 - b.x0, 0.5)), px(lane_h), color(b.color), xml_escape(tip));
  }
  return out + "</svg>\n";
}

std::string stack_vertically(const std::vector<std::string>& svgs) {
  struct Part {
    std::string body;  // from "<svg" on
    int width, height;
  };
  std::vector<Part> parts;
  int width = 0, height = 0;
  for (const std::string& s : svgs) {
    const size_t open = s.find("<svg");
    CHECK_MSG(open != std::string::npos, "stack_vertically: not an SVG document");
    const size_t end = s.find('>', open);
    const std::string tag = s.substr(open, end - open);
    auto attribute = [&](const std::string& name) {
      const size_t at = tag.find(" " + name + "=\"");
      CHECK_MSG(at != std::string::npos, "stack_vertically: the root element has no " + name);
      return std::atoi(tag.c_str() + at + name.size() + 3);
    };
    parts.push_back({s.substr(open), attribute("width"), attribute("height")});
    width = std::max(width, parts.back().width);
    height += parts.back().height;
  }
  std::string out = open_svg(std::max(width, 1), std::max(height, 1));
  int y = 0;
  for (const Part& p : parts) {
    out += "<svg y=\"" + std::to_string(y) + "\"" + p.body.substr(4);
    if (out.back() != '\n') out += '\n';
    y += p.height;
  }
  return out + "</svg>\n";
}

}  // namespace strata::svg
