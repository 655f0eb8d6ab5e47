#include "train/profile_report.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>

#include <fmt/format.h>

#include "core/units.h"
#include "memory/tier.h"

namespace strata {
namespace {

struct Interval {
  int64_t begin, end;
};

// Sorted, non-overlapping intervals covering the same time as `v`.
std::vector<Interval> merged(std::vector<Interval> v) {
  std::sort(v.begin(), v.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  std::vector<Interval> out;
  for (const Interval& i : v) {
    if (!out.empty() && i.begin <= out.back().end) out.back().end = std::max(out.back().end, i.end);
    else out.push_back(i);
  }
  return out;
}

int64_t length(const std::vector<Interval>& merged_intervals) {
  int64_t n = 0;
  for (const Interval& i : merged_intervals) n += i.end - i.begin;
  return n;
}

// Time covered by both (each merged).
int64_t overlap(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  int64_t n = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const int64_t lo = std::max(a[i].begin, b[j].begin);
    const int64_t hi = std::min(a[i].end, b[j].end);
    if (hi > lo) n += hi - lo;
    (a[i].end < b[j].end) ? ++i : ++j;
  }
  return n;
}

// The time of `a` not in `b` (each merged), merged.
std::vector<Interval> without(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  std::vector<Interval> out;
  size_t j = 0;
  for (Interval i : a) {
    while (j < b.size() && b[j].end <= i.begin) ++j;
    for (size_t k = j; k < b.size() && b[k].begin < i.end; ++k) {
      if (b[k].begin > i.begin) out.push_back(Interval{i.begin, b[k].begin});
      i.begin = std::max(i.begin, b[k].end);
      if (i.begin >= i.end) break;
    }
    if (i.begin < i.end) out.push_back(i);
  }
  return out;
}

double arg_of(const trace::Event& e, const char* key, double fallback = 0) {
  for (int i = 0; i < e.num_args; ++i)
    if (std::strcmp(e.args[i].key, key) == 0) return e.args[i].value;
  return fallback;
}

bool is(const trace::Event& e, const char* category, const char* name = nullptr) {
  return std::strcmp(e.category, category) == 0 && (name == nullptr || std::strcmp(e.name, name) == 0);
}

// Calls visit(span, own_ns, in_step) for every complete span of a thread, where own_ns is its
// duration less its direct children's (a child is clipped to its parent) and in_step says
// whether it lies inside a "step" span. Spans on one thread nest (trace_check.h checks it).
void walk_exclusive(const trace::ThreadEvents& t,
                    const std::function<void(const trace::Event&, int64_t, bool)>& visit) {
  std::vector<const trace::Event*> spans;
  for (const trace::Event& e : t.events)
    if (e.phase == 'X') spans.push_back(&e);
  std::stable_sort(spans.begin(), spans.end(), [](const trace::Event* a, const trace::Event* b) {
    return a->ts_ns != b->ts_ns ? a->ts_ns < b->ts_ns : a->dur_ns > b->dur_ns;
  });
  struct Open {
    const trace::Event* e;
    int64_t children_ns;
    bool in_step;
  };
  std::vector<Open> stack;
  auto close = [&](const Open& o) { visit(*o.e, std::max<int64_t>(0, o.e->dur_ns - o.children_ns), o.in_step); };
  for (const trace::Event* e : spans) {
    while (!stack.empty() && e->ts_ns >= stack.back().e->ts_ns + stack.back().e->dur_ns) {
      close(stack.back());
      stack.pop_back();
    }
    const bool in_step = is(*e, "step", "step") || (!stack.empty() && stack.back().in_step);
    if (!stack.empty()) {
      const int64_t parent_end = stack.back().e->ts_ns + stack.back().e->dur_ns;
      stack.back().children_ns += std::min(e->ts_ns + e->dur_ns, parent_end) - e->ts_ns;
    }
    stack.push_back(Open{e, 0, in_step});
  }
  while (!stack.empty()) {
    close(stack.back());
    stack.pop_back();
  }
}

// The phase a training-thread span's own time belongs to.
const char* phase_of(const trace::Event& e) {
  if (is(e, "compute")) {
    if (is(e, "compute", "forward") || is(e, "compute", "embedding forward")) return "forward";
    if (is(e, "compute", "recompute")) return "recompute";
    if (is(e, "compute", "head")) return "head (LM head + loss)";
    return "backward";
  }
  if (is(e, "stall")) return "memory stalls";
  if (is(e, "communication")) return "communication";
  if (is(e, "optimizer") || is(e, "step", "optimizer step")) return "optimizer";
  if (is(e, "data")) return "data";
  if (is(e, "checkpoint")) return "checkpoint";
  return "other";
}

constexpr const char* kPhaseOrder[] = {"forward", "recompute", "backward", "head (LM head + loss)", "optimizer",
                                       "communication", "memory stalls", "data", "checkpoint", "other"};

KindBytes kind_bytes_from(const std::map<std::string, double>& by_kind) {
  auto get = [&](const char* k) {
    auto it = by_kind.find(k);
    return it == by_kind.end() ? uint64_t{0} : static_cast<uint64_t>(it->second);
  };
  KindBytes b;
  b.param = get("param");
  b.grad = get("grad");
  b.master = get("master");
  b.adam_m = get("adam_m");
  b.adam_v = get("adam_v");
  b.act = get("act");
  return b;
}

std::string seconds(double s) {
  if (s >= 1) return fmt::format("{:.2f} s", s);
  if (s >= 1e-3) return fmt::format("{:.3g} ms", s * 1e3);
  if (s > 0) return fmt::format("{:.3g} us", s * 1e6);
  return "0 s";
}

std::string ratio(double measured, double planned) {
  if (planned <= 0) return measured > 0 ? "unplanned" : "-";
  return fmt::format("{:.2f}x", measured / planned);
}

}  // namespace

ProfileReport analyze_profile(const ProfileInput& in) {
  ProfileReport r;
  r.rates_source = in.rates_source;
  const trace::ThreadEvents* training = nullptr;
  for (const auto& t : in.threads)
    if (t.name == in.training_thread) training = &t;

  // 1. The training thread: steps, and its time split exclusively into phases.
  std::vector<double> step_seconds;
  std::map<std::string, int64_t> phase_ns, stall_ns;
  // Whole spans (stalls inside included), as the plan's phases count them.
  int64_t forward_ns = 0, backward_ns = 0, passes_ns = 0, optimizer_ns = 0;
  std::vector<Interval> stalls;
  // A compute stream's track (ops queued, the host running ahead): its phase spans are the
  // compute's own time. The training thread's waits for it are then split by what the stream
  // ran meanwhile, and the whole-phase sums come from the stream's spans.
  std::vector<const trace::Event*> lane;
  for (const auto& t : in.threads)
    if (t.name == in.compute_stream)
      for (const trace::Event& e : t.events)
        if (e.phase == 'X' && is(e, "compute")) lane.push_back(&e);
  std::sort(lane.begin(), lane.end(), [](const trace::Event* a, const trace::Event* b) { return a->ts_ns < b->ts_ns; });
  std::vector<Interval> steps_at;
  std::vector<Interval> waits;  // the training thread's waits for the compute stream
  auto waited_within = [&](const trace::Event& e) {
    int64_t n = 0;
    for (const Interval& w : waits)
      if (w.begin >= e.ts_ns && w.end <= e.ts_ns + e.dur_ns) n += w.end - w.begin;
    return n;
  };
  if (training != nullptr) {
    walk_exclusive(*training, [&](const trace::Event& e, int64_t own, bool in_step) {
      if (!in_step) return;  // outside the traced steps
      if (is(e, "step", "step")) {
        step_seconds.push_back(static_cast<double>(e.dur_ns) / 1e9);
        steps_at.push_back(Interval{e.ts_ns, e.ts_ns + e.dur_ns});
      }
      if (is(e, "wait", "compute stream")) {
        // Spans on one thread nest, so the wait has no children: own is all of it.
        const int64_t begin = e.ts_ns, end = e.ts_ns + e.dur_ns;
        int64_t attributed = 0;
        for (const trace::Event* c : lane) {
          if (c->ts_ns >= end) break;
          const int64_t o = std::min(end, c->ts_ns + c->dur_ns) - std::max(begin, c->ts_ns);
          if (o <= 0) continue;
          phase_ns[phase_of(*c)] += o;
          attributed += o;
        }
        phase_ns["other"] += std::max<int64_t>(0, own - attributed);
        waits.push_back(Interval{begin, end});
        return;
      }
      const std::string phase = phase_of(e);
      if (is(e, "compute") && lane.empty())
        (phase == "forward" || phase == "head (LM head + loss)" ? forward_ns : backward_ns) += e.dur_ns;
      // Whole spans less the waits for the compute stream inside them (already visited: children
      // close first), which belong to the compute that ran meanwhile.
      const int64_t span_ns = e.dur_ns - waited_within(e);
      if (is(e, "optimizer", "zero gradients") || is(e, "optimizer", "gradient norm")) passes_ns += span_ns;
      if (is(e, "optimizer", "gradient norm")) optimizer_ns -= span_ns;  // inside the optimizer step
      if (is(e, "step", "optimizer step")) optimizer_ns += span_ns;
      phase_ns[phase_of(e)] += own;
      if (is(e, "stall")) {
        stall_ns[e.name] += own;
        stalls.push_back(Interval{e.ts_ns, e.ts_ns + e.dur_ns});
      }
    });
  }
  for (const trace::Event* c : lane) {
    const bool in_step = std::any_of(steps_at.begin(), steps_at.end(),
                                     [&](const Interval& i) { return c->ts_ns >= i.begin && c->ts_ns < i.end; });
    if (!in_step) continue;
    const std::string phase = phase_of(*c);
    (phase == "forward" || phase == "head (LM head + loss)" ? forward_ns : backward_ns) += c->dur_ns;
  }
  r.steps = static_cast<int64_t>(step_seconds.size());
  const double steps = std::max<double>(1, static_cast<double>(r.steps));
  double total = 0;
  for (double s : step_seconds) total += s;
  r.step_s = total / steps;
  if (!step_seconds.empty()) {
    std::vector<double> sorted = step_seconds;
    std::sort(sorted.begin(), sorted.end());
    const size_t n = sorted.size();
    r.median_step_s = n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
  }
  for (const char* p : kPhaseOrder) r.phases.emplace_back(p, static_cast<double>(phase_ns[p]) / 1e9 / steps);
  for (const auto& [name, ns] : stall_ns) r.stalls.emplace_back(name, static_cast<double>(ns) / 1e9 / steps);
  const std::vector<Interval> stall_time = merged(stalls);

  // 2. Transfers and the other tracks.
  struct Flow {
    uint64_t bytes = 0;
    std::vector<Interval> busy;
  };
  std::map<std::string, Flow> flows;
  std::map<std::string, std::vector<Interval>> track_busy, track_waits;
  double host_adam_ns = 0;
  for (const auto& t : in.threads) {
    // AdamW on host memory: its own time, without the nvme stalls of fetching its state.
    walk_exclusive(t, [&](const trace::Event& e, int64_t own, bool) {
      if (is(e, "optimizer", "adamw group") && arg_of(e, "tier") != 0) host_adam_ns += static_cast<double>(own);
    });
    const bool copy_track = t.name.rfind("copy ", 0) == 0;
    for (size_t i = 0; i < t.events.size(); ++i) {
      const trace::Event& e = t.events[i];
      if (e.phase == 'X' && copy_track && is(e, "copy")) {
        // Bytes of moves between tiers ("copy"); the stream is busy with its zero fills and
        // checkpoint reads too.
        Flow& f = flows[t.name.substr(5)];
        if (is(e, "copy", "copy")) f.bytes += static_cast<uint64_t>(arg_of(e, "bytes"));
        f.busy.push_back(Interval{e.ts_ns, e.ts_ns + e.dur_ns});
      }
      if (e.phase == 'b' && i + 1 < t.events.size() && t.events[i + 1].phase == 'e' && t.events[i + 1].id == e.id) {
        Flow& f = flows[e.name];
        f.bytes += static_cast<uint64_t>(arg_of(e, "bytes"));
        f.busy.push_back(Interval{e.ts_ns, t.events[i + 1].ts_ns});
      }
      if (e.phase == 'X' && &t != training && !copy_track)
        (is(e, "wait") ? track_waits : track_busy)[t.name].push_back(Interval{e.ts_ns, e.ts_ns + e.dur_ns});
    }
  }
  // A stream's waits for events inside its spans (the phases a compute stream marks) are not
  // its work.
  for (auto& [name, busy] : track_busy) busy = without(merged(busy), merged(track_waits[name]));
  const Plan* plan = in.plan;
  const std::pair<const char*, uint64_t> directions[] = {
      {"host->device", plan ? plan->h2d_bytes : 0},
      {"device->host", plan ? plan->d2h_bytes : 0},
      {"nvme read", plan ? plan->disk_read_bytes : 0},
      {"nvme write", plan ? plan->disk_write_bytes : 0}};
  std::vector<Interval> disk;
  for (const auto& [name, planned] : directions) {
    ProfileReport::Traffic tr;
    tr.name = name;
    tr.planned_bytes = planned;
    const Flow& f = flows[name];
    const std::vector<Interval> busy = merged(f.busy);
    tr.bytes = static_cast<uint64_t>(static_cast<double>(f.bytes) / steps);
    const int64_t busy_ns = length(busy);
    tr.busy_s = static_cast<double>(busy_ns) / 1e9 / steps;
    tr.hidden_share = busy_ns > 0 ? 1.0 - static_cast<double>(overlap(busy, stall_time)) / static_cast<double>(busy_ns) : 1.0;
    if (tr.name.rfind("nvme", 0) == 0) disk.insert(disk.end(), busy.begin(), busy.end());
    r.traffic.push_back(tr);
  }
  for (auto& [name, busy] : track_busy)
    r.tracks.emplace_back(name, static_cast<double>(length(merged(busy))) / 1e9 / steps);

  // Collectives between the ranks, inside the traced steps: exposed where the training thread
  // ran them itself or waited for another thread's (the gradient sums at handover), and where
  // another thread's (a communication stream's) ran while neither the compute stream nor the
  // optimizer ran.
  // The compute stream's work, less its waits; and the optimizer's group updates on the training
  // thread, beside which the updated weights' gathers run (ZeRO-1 and 2).
  std::vector<Interval> lane_busy;
  if (auto it = track_busy.find(in.compute_stream); it != track_busy.end()) lane_busy = it->second;
  if (training != nullptr) {
    // (Less the training thread's stalls and waits inside them: a chunk waiting for a gather.)
    std::vector<Interval> updates, waiting;
    for (const trace::Event& e : training->events) {
      if (e.phase != 'X') continue;
      const Interval span{e.ts_ns, e.ts_ns + e.dur_ns};
      if (is(e, "optimizer", "adamw group")) updates.push_back(span);
      else if (is(e, "stall") || is(e, "wait")) waiting.push_back(span);
    }
    for (const Interval& i : without(merged(updates), merged(waiting))) lane_busy.push_back(i);
    lane_busy = merged(lane_busy);
  }
  auto exposed_beside_lane = [&](const Interval& span, std::vector<Interval>& out) {
    for (const Interval& i : without({span}, lane_busy)) out.push_back(i);
  };
  std::vector<Interval> comm_busy, comm_waited;
  for (const auto& t : in.threads) {
    for (const trace::Event& e : t.events) {
      if (e.phase != 'X') continue;
      const bool in_step = std::any_of(steps_at.begin(), steps_at.end(),
                                       [&](const Interval& i) { return e.ts_ns >= i.begin && e.ts_ns < i.end; });
      if (!in_step) continue;
      const Interval span{e.ts_ns, e.ts_ns + e.dur_ns};
      if (is(e, "communication")) comm_busy.push_back(span);
      if (&t == training && (is(e, "communication") || is(e, "optimizer", "wait for gradient sums")))
        comm_waited.push_back(span);
      else if (is(e, "communication") && !lane.empty())
        exposed_beside_lane(span, comm_waited);
    }
  }
  if (!comm_busy.empty()) {
    const std::vector<Interval> busy = merged(comm_busy);
    const int64_t busy_ns = length(busy);
    ProfileReport::Communication& c = r.communication;
    c.traced = true;
    c.busy_s = static_cast<double>(busy_ns) / 1e9 / steps;
    c.hidden_share =
        busy_ns > 0 ? 1.0 - static_cast<double>(overlap(busy, merged(comm_waited))) / static_cast<double>(busy_ns) : 0;
    if (in.plan != nullptr) {
      c.planned_s = in.plan->comm_s;
      c.planned_hidden_share = in.plan->comm_s > 0 ? in.plan->comm_hidden_s / in.plan->comm_s : 0;
    }
  }
  for (auto& [name, f] : flows)  // other I/O: checkpoint reads and writes
    if (name.rfind("checkpoint", 0) == 0)
      r.tracks.emplace_back(name + " I/O", static_cast<double>(length(merged(f.busy))) / 1e9 / steps);

  // 3. Memory: the counters' latest value per tier and kind, and the peaks.
  std::vector<const trace::Event*> counters;
  for (const auto& t : in.threads)
    for (const trace::Event& e : t.events)
      if (e.phase == 'C') counters.push_back(&e);
  std::stable_sort(counters.begin(), counters.end(),
                   [](const trace::Event* a, const trace::Event* b) { return a->ts_ns < b->ts_ns; });
  static constexpr const char* kTiers[kNumTiers] = {"device", "host", "nvme"};
  for (int tier = 0; tier < kNumTiers; ++tier) {
    const std::string counter = std::string(kTiers[tier]) + " bytes";
    std::map<std::string, double> now, peak;
    uint64_t peak_total = 0;
    bool seen = false;
    for (const trace::Event* e : counters) {
      if (counter != e->name) continue;
      seen = true;
      for (int i = 0; i < e->num_args; ++i) {
        now[e->args[i].key] = e->args[i].value;
        peak[e->args[i].key] = std::max(peak[e->args[i].key], e->args[i].value);
      }
      double sum = 0;
      for (const auto& [kind, v] : now) sum += v;
      peak_total = std::max(peak_total, static_cast<uint64_t>(sum));
    }
    const KindBytes planned = plan ? (tier == 0 ? plan->device : tier == 1 ? plan->host : plan->nvme) : KindBytes{};
    if (!seen && planned.total() == 0) continue;
    ProfileReport::TierMemory m;
    m.tier = kTiers[tier];
    m.planned = planned;
    m.peak = kind_bytes_from(peak);
    m.peak_total = peak_total;
    r.memory.push_back(m);
  }

  // 4. The prediction beside the measurement.
  auto phase = [&](const char* name) {
    for (const auto& [p, s] : r.phases)
      if (p == name) return s;
    return 0.0;
  };
  const bool host_time = in.backend == "cuda";
  if (host_time) {
    // The GPU's copies are not traced; the rows would read as nothing moved.
    r.traffic[0].traced = r.traffic[1].traced = false;
  }
  if (plan != nullptr) {
    r.predicted_bound = plan->bottleneck;
    const double compute = phase("forward") + phase("recompute") + phase("backward") + phase("head (LM head + loss)");
    if (!host_time) {
      r.terms = {{"compute", plan->compute_s, compute},
                 {"host->device copies", plan->h2d_s, r.traffic[0].busy_s},
                 {"device->host copies", plan->d2h_s, r.traffic[1].busy_s}};
    }
    r.terms.push_back({"CPU AdamW", plan->cpu_adam_s, host_adam_ns / 1e9 / steps});
    r.terms.push_back({"disk", plan->disk_s, static_cast<double>(length(merged(disk))) / 1e9 / steps});
    r.terms.push_back({"step", plan->step_s, r.step_s});
    const StepPhases& ph = plan->phases;
    const double m = static_cast<double>(ph.micro_batches);
    const auto per_step = [&](int64_t ns) { return static_cast<double>(ns) / 1e9 / steps; };
    r.phase_terms = {{"forward (with the head)", m * ph.forward.total_s(), per_step(forward_ns)},
                     {"recompute + backward", m * ph.backward.total_s(), per_step(backward_ns)},
                     {"gradient passes", ph.grad_passes_s, per_step(passes_ns)},
                     {"optimizer", ph.optimizer_s - ph.optimizer_hidden_s, per_step(optimizer_ns)},
                     {"step", ph.step_s(), r.step_s}};
  }
  if (host_time)
    r.notes.push_back(
        "cuda backend: spans are host time; the GPU's kernels and copies are not traced, so the phases show "
        "where the host waited for the GPU (the loss read-back, stalls, the optimizer), not the GPU's own time, and "
        "the copy rows and compute are left out");
  r.notes.push_back(
      "memory counts chunks: device activations and kernel scratch come from the device arena outside them "
      "(the plan's device 'act' column), host 'act' is offloaded saved activations");
  r.notes.push_back(
      "the training thread is the critical path: transfers, nvme I/O, the overlapped optimizer and the checkpoint "
      "writer run beside it and cost step time only through its stalls");
  return r;
}

std::string format_profile_report(const ProfileReport& r) {
  std::ostringstream os;
  os << fmt::format("profile of {} step{}: {} per step (median {})\n\n", r.steps, r.steps == 1 ? "" : "s",
                    seconds(r.step_s), seconds(r.median_step_s));
  os << "memory per tier, planned -> peak measured:\n";
  os << fmt::format("  {:<7} {:>23} {:>23} {:>23} {:>23} {:>23} {:>23} | {:>11}\n", "tier", "param", "grad", "master",
                    "adam_m", "adam_v", "act", "peak total");
  for (const auto& m : r.memory) {
    auto cell = [](uint64_t planned, uint64_t peak) {
      return fmt::format("{} -> {}", format_bytes(planned), format_bytes(peak));
    };
    os << fmt::format("  {:<7} {:>23} {:>23} {:>23} {:>23} {:>23} {:>23} | {:>11}\n", m.tier,
                      cell(m.planned.param, m.peak.param), cell(m.planned.grad, m.peak.grad),
                      cell(m.planned.master, m.peak.master), cell(m.planned.adam_m, m.peak.adam_m),
                      cell(m.planned.adam_v, m.peak.adam_v), cell(m.planned.act, m.peak.act),
                      format_bytes(m.peak_total));
  }
  os << "\ntraffic per step:\n";
  os << fmt::format("  {:<13} {:>11} {:>11} {:>10} {:>10} {:>8}\n", "direction", "planned", "measured", "ratio", "busy",
                    "hidden");
  for (const auto& t : r.traffic)
    if (!t.traced)
      os << fmt::format("  {:<13} {:>11} {:>11}\n", t.name, format_bytes(t.planned_bytes), "not traced");
    else
      os << fmt::format("  {:<13} {:>11} {:>11} {:>10} {:>10} {:>7.0f}%\n", t.name, format_bytes(t.planned_bytes),
                        format_bytes(t.bytes), ratio(static_cast<double>(t.bytes), static_cast<double>(t.planned_bytes)),
                        seconds(t.busy_s), 100 * t.hidden_share);
  if (r.communication.traced) {
    const ProfileReport::Communication& c = r.communication;
    os << fmt::format("\ncollectives between the ranks per step: planned {}, busy {}; hidden behind compute: planned "
                      "{:.0f}%, measured {:.0f}%\n",
                      seconds(c.planned_s), seconds(c.busy_s), 100 * c.planned_hidden_share, 100 * c.hidden_share);
  }
  os << "\nthe step's critical path (the training thread), per step:\n";
  for (const auto& [name, s] : r.phases) {
    if (s <= 0) continue;
    os << fmt::format("  {:<24} {:>10} {:>6.1f}%\n", name, seconds(s), r.step_s > 0 ? 100 * s / r.step_s : 0.0);
    if (name == "memory stalls")
      for (const auto& [stall, ss] : r.stalls) os << fmt::format("    {:<22} {:>10}\n", stall, seconds(ss));
  }
  if (!r.tracks.empty()) {
    os << "\nbeside it, busy per step:\n";
    for (const auto& [name, s] : r.tracks) os << fmt::format("  {:<24} {:>10}\n", name, seconds(s));
  }
  if (!r.terms.empty()) {
    os << fmt::format("\npredicted -> measured per step (machine rates: {}):\n",
                      r.rates_source.empty() ? "hardware.* keys" : r.rates_source);
    for (const auto& t : r.terms)
      os << fmt::format("  {:<20} {:>10} -> {:>10} {:>10}\n", t.name, seconds(t.predicted_s), seconds(t.measured_s),
                        ratio(t.measured_s, t.predicted_s));
    os << fmt::format("  the plan says the step is bound by {}\n", r.predicted_bound);
  }
  if (!r.phase_terms.empty()) {
    os << "\npredicted -> measured per step, by phase (stalls inside each phase included):\n";
    for (const auto& t : r.phase_terms)
      os << fmt::format("  {:<24} {:>10} -> {:>10} {:>10}\n", t.name, seconds(t.predicted_s), seconds(t.measured_s),
                        ratio(t.measured_s, t.predicted_s));
  }
  os << "\nnotes:\n";
  for (const auto& n : r.notes) os << "  - " << n << "\n";
  return os.str();
}

nlohmann::json profile_report_json(const ProfileReport& r) {
  auto kinds = [](const KindBytes& k) {
    return nlohmann::json{{"param", k.param}, {"grad", k.grad},     {"master", k.master},
                          {"adam_m", k.adam_m}, {"adam_v", k.adam_v}, {"act", k.act}};
  };
  nlohmann::json j;
  j["steps"] = r.steps;
  j["step_s"] = r.step_s;
  j["median_step_s"] = r.median_step_s;
  j["memory"] = nlohmann::json::array();
  for (const auto& m : r.memory)
    j["memory"].push_back(
        {{"tier", m.tier}, {"planned", kinds(m.planned)}, {"peak", kinds(m.peak)}, {"peak_total", m.peak_total}});
  j["traffic"] = nlohmann::json::array();
  for (const auto& t : r.traffic)
    j["traffic"].push_back({{"direction", t.name},
                            {"traced", t.traced},
                            {"planned_bytes", t.planned_bytes},
                            {"bytes", t.bytes},
                            {"busy_s", t.busy_s},
                            {"hidden_share", t.hidden_share}});
  if (r.communication.traced)
    j["communication"] = {{"busy_s", r.communication.busy_s},
                          {"hidden_share", r.communication.hidden_share},
                          {"planned_s", r.communication.planned_s},
                          {"planned_hidden_share", r.communication.planned_hidden_share}};
  j["phases"] = nlohmann::json::object();
  for (const auto& [name, s] : r.phases) j["phases"][name] = s;
  j["stalls"] = nlohmann::json::object();
  for (const auto& [name, s] : r.stalls) j["stalls"][name] = s;
  j["tracks"] = nlohmann::json::object();
  for (const auto& [name, s] : r.tracks) j["tracks"][name] = s;
  j["predicted"] = nlohmann::json::array();
  for (const auto& t : r.terms)
    j["predicted"].push_back({{"term", t.name}, {"predicted_s", t.predicted_s}, {"measured_s", t.measured_s}});
  j["predicted_phases"] = nlohmann::json::array();
  for (const auto& t : r.phase_terms)
    j["predicted_phases"].push_back({{"phase", t.name}, {"predicted_s", t.predicted_s}, {"measured_s", t.measured_s}});
  j["predicted_bound"] = r.predicted_bound;
  j["rates_source"] = r.rates_source;
  j["notes"] = r.notes;
  return j;
}

}  // namespace strata
