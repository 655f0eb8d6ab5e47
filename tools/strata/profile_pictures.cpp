#include "tools/strata/profile_pictures.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include <fmt/format.h>

#include "core/svg_chart.h"

namespace strata::tools {
namespace {

// Colors of the timeline, in the legend's order.
enum Color { kForward, kRecompute, kBackward, kHead, kOptimizer, kStall, kCopy, kNvme, kCheckpoint, kData };
const std::vector<std::string> kLegend = {"forward", "recompute", "backward", "head + loss", "optimizer",
                                          "stall",   "copy",      "disk I/O", "checkpoint",  "data"};

int color_of(const trace::Event& e) {
  const std::string cat = e.category;
  if (cat == "compute") {
    const std::string name = e.name;
    if (name == "forward" || name == "embedding forward") return kForward;
    if (name == "recompute") return kRecompute;
    if (name == "head") return kHead;
    return kBackward;
  }
  if (cat == "optimizer") return kOptimizer;
  if (cat == "stall") return kStall;
  if (cat == "copy") return kCopy;
  if (cat == "nvme") return kNvme;
  if (cat == "checkpoint") return kCheckpoint;
  if (cat == "data") return kData;
  return -1;  // step and micro-batch frames: not drawn
}

std::string span_label(const trace::Event& e, double seconds) {
  std::string label = trace::display_name(e);
  for (int i = 0; i < e.num_args; ++i) label += fmt::format(", {} {:g}", e.args[i].key, e.args[i].value);
  if (seconds >= 1e-3) return label + fmt::format(" ({:.3g} ms)", seconds * 1e3);
  return label + fmt::format(" ({:.3g} us)", seconds * 1e6);
}

}  // namespace

bool pick_step(const std::vector<trace::ThreadEvents>& threads, const std::string& training_thread, int64_t* start_ns,
               int64_t* end_ns, int64_t* step) {
  std::vector<const trace::Event*> steps;
  for (const auto& t : threads)
    if (t.name == training_thread)
      for (const trace::Event& e : t.events)
        if (e.phase == 'X' && std::strcmp(e.category, "step") == 0 && std::strcmp(e.name, "step") == 0)
          steps.push_back(&e);
  if (steps.empty()) return false;
  std::vector<const trace::Event*> by_length = steps;
  std::sort(by_length.begin(), by_length.end(),
            [](const trace::Event* a, const trace::Event* b) { return a->dur_ns < b->dur_ns; });
  const trace::Event* pick = by_length[by_length.size() / 2];
  *start_ns = pick->ts_ns;
  *end_ns = pick->ts_ns + pick->dur_ns;
  *step = pick->index;
  return true;
}

std::string timeline_svg(const std::vector<trace::ThreadEvents>& threads, const std::string& training_thread,
                         int64_t start_ns, int64_t end_ns, int64_t step) {
  svg::Timeline t;
  t.title = fmt::format("step {}: what each thread and stream did", step);
  t.x_label = "seconds since the step began";
  t.legend = kLegend;
  std::map<std::string, int> lanes;
  auto lane = [&](const std::string& name) {
    auto it = lanes.find(name);
    if (it != lanes.end()) return it->second;
    const int id = static_cast<int>(t.lanes.size());
    t.lanes.push_back(name);
    lanes[name] = id;
    return id;
  };
  lane(training_thread);  // first
  const double origin = static_cast<double>(start_ns);
  auto clip = [&](int64_t ns) { return (static_cast<double>(std::clamp(ns, start_ns, end_ns)) - origin) / 1e9; };
  for (const auto& th : threads) {
    // Parents before children, so that nested spans are drawn over their parents.
    std::vector<const trace::Event*> spans;
    for (size_t i = 0; i < th.events.size(); ++i) {
      const trace::Event& e = th.events[i];
      if (e.phase == 'b' && i + 1 < th.events.size() && th.events[i + 1].phase == 'e') {
        const int64_t b = e.ts_ns, en = th.events[i + 1].ts_ns;
        if (en < start_ns || b > end_ns) continue;
        t.spans.push_back(svg::Span{lane("disk I/O"), clip(b), clip(en),
                                    span_label(e, static_cast<double>(en - b) / 1e9), kNvme});
        continue;
      }
      if (e.phase != 'X' || color_of(e) < 0) continue;
      if (e.ts_ns + e.dur_ns < start_ns || e.ts_ns > end_ns) continue;
      spans.push_back(&e);
    }
    std::stable_sort(spans.begin(), spans.end(), [](const trace::Event* a, const trace::Event* b) {
      return a->ts_ns != b->ts_ns ? a->ts_ns < b->ts_ns : a->dur_ns > b->dur_ns;
    });
    if (spans.empty()) continue;
    const int id = lane(th.name);
    for (const trace::Event* e : spans)
      t.spans.push_back(svg::Span{id, clip(e->ts_ns), clip(e->ts_ns + e->dur_ns),
                                  span_label(*e, static_cast<double>(e->dur_ns) / 1e9), color_of(*e)});
  }
  return svg::render_timeline(t);
}

std::string memory_svg(const std::vector<trace::ThreadEvents>& threads, int64_t start_ns, int64_t end_ns,
                       int64_t step) {
  std::vector<const trace::Event*> counters;
  for (const auto& th : threads)
    for (const trace::Event& e : th.events)
      if (e.phase == 'C' && e.ts_ns <= end_ns) counters.push_back(&e);
  std::stable_sort(counters.begin(), counters.end(),
                   [](const trace::Event* a, const trace::Event* b) { return a->ts_ns < b->ts_ns; });
  const double origin = static_cast<double>(start_ns);
  svg::LineChart tiers;
  tiers.title = fmt::format("memory per tier during step {} (chunks in use)", step);
  tiers.x_label = "seconds since the step began";
  tiers.x_unit = svg::Unit::kSeconds;
  tiers.y_unit = svg::Unit::kBytes;
  std::vector<std::string> charts;
  for (const char* tier : {"device", "host", "nvme"}) {
    const std::string name = std::string(tier) + " bytes";
    std::map<std::string, double> now;
    svg::Series total{tier, {}, {}};
    std::map<std::string, svg::Series> kinds;
    std::vector<std::string> kind_order;
    // A counter holds its value until the next one: each change is drawn as a step.
    auto sample = [&](double x) {
      double sum = 0;
      for (const auto& [k, v] : now) sum += v;
      total.x.push_back(x);
      total.y.push_back(sum);
      for (const std::string& k : kind_order) {
        kinds[k].x.push_back(x);
        kinds[k].y.push_back(now[k]);
      }
    };
    bool started = false;
    for (const trace::Event* e : counters) {
      if (name != e->name) continue;
      const double x = (static_cast<double>(std::max(e->ts_ns, start_ns)) - origin) / 1e9;
      if (e->ts_ns >= start_ns) {
        if (!started) {
          sample(0);  // the value the step began with
          started = true;
        }
        sample(x);  // the old value up to now
      }
      for (int i = 0; i < e->num_args; ++i) {
        const std::string k = e->args[i].key;
        if (!kinds.count(k)) {
          kinds[k] = svg::Series{k, {}, {}};
          kind_order.push_back(k);
        }
        now[k] = e->args[i].value;
      }
      if (e->ts_ns >= start_ns) sample(x);
    }
    if (now.empty()) continue;
    if (!started) sample(0);
    sample((static_cast<double>(end_ns) - origin) / 1e9);
    tiers.series.push_back(total);
    svg::LineChart by_kind;
    by_kind.title = fmt::format("{} tier by kind of state, step {}", tier, step);
    by_kind.x_label = tiers.x_label;
    by_kind.x_unit = svg::Unit::kSeconds;
    by_kind.y_unit = svg::Unit::kBytes;
    by_kind.stacked = true;
    for (const std::string& k : kind_order) {
      const auto& s = kinds[k];
      if (std::any_of(s.y.begin(), s.y.end(), [](double v) { return v > 0; })) by_kind.series.push_back(s);
    }
    if (!by_kind.series.empty()) charts.push_back(svg::render_line_chart(by_kind));
  }
  charts.insert(charts.begin(), svg::render_line_chart(tiers));
  return svg::stack_vertically(charts);
}

}  // namespace strata::tools
