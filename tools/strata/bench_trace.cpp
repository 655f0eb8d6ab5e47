// strata bench trace: what tracing costs. One training run whose steps alternate between
// tracing on and off (so both halves see the same machine, caches and data), and the cost of a
// span while tracing is off measured apart, times the spans a step records.
#include "tools/strata/bench_trace.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/check.h"
#include "core/config.h"
#include "core/log.h"
#include "core/trace.h"
#include "tools/strata/run_args.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace strata::tools {
namespace {

constexpr const char* kUsage = R"(Usage: strata bench trace [CONFIG.yaml] [key=value ...] [--steps N]

What tracing (`strata profile`) costs. Trains CONFIG (default: the embedded demo) for --steps
steps (default 40) with tracing on in every other step, and compares the median step time of the
traced steps with that of the untraced ones in the same run. Tracing off is measured apart: the
time of a span while tracing is off, times the spans a traced step records, against the step.
)";

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Tracing on in about half the steps after the first two (start-up), chosen by a hash of the
// step so that no periodicity of the run (steps alternate in what they move) lines up with it;
// counts the events a traced step makes.
class Alternator final : public RunObserver {
 public:
  void on_step_begin(int64_t step) override {
    if (step > 2 && ((static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull) >> 63) == 1) trace::start();
  }
  void on_step_end(const StepMetrics& m) override {
    if (m.step <= 2) return;
    if (trace::enabled()) {
      trace::stop();
      size_t n = 0;
      for (const auto& t : trace::collect()) n += t.events.size();
      events_.push_back(static_cast<double>(n));
      on_ms_.push_back(m.ms);
    } else {
      off_ms_.push_back(m.ms);
    }
  }
  std::vector<double> on_ms_, off_ms_, events_;
};

// Nanoseconds a span with an argument costs, with tracing on or off. On, the spans are
// recorded into this thread's buffer (cleared by the next start()).
double span_ns(bool on, int spans) {
  if (on) trace::start();
  else trace::stop();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < spans; ++i) {
    trace::Span span("compute", "forward", i);
    span.arg("bytes", i);
  }
  const auto t1 = std::chrono::steady_clock::now();
  trace::stop();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / spans;
}

}  // namespace

int bench_trace_command(const std::vector<std::string>& args) {
  RunArgs run_args;
  run_args.steps = 40;
  if (const int rc = parse_run_args(args, "strata bench trace", kUsage, 6, &run_args); rc >= 0) return rc;
  const int64_t steps = run_args.steps;
  Result<Config> config = load_train_config(run_args.config_path, run_args.overrides);
  if (!config.ok()) {
    std::fprintf(stderr, "strata bench trace: error: %s\n", config.status().message().c_str());
    return 1;
  }
  Result<TrainConfig> tc = make_train_config(*config);
  if (!tc.ok()) {
    std::fprintf(stderr, "strata bench trace: error: %s\n", tc.status().message().c_str());
    return 1;
  }
  tc->steps = steps;
  tc->run_export.clear();
  tc->resume.clear();
  LogOptions lo;
  lo.level = LogLevel::kWarn;  // the table is the output
  init_logging(lo);
  Alternator alternator;
  Result<TrainSummary> run = run_training(*tc, config->to_yaml(), &alternator);
  if (!run.ok()) {
    std::fprintf(stderr, "strata bench trace: error: %s\n", run.status().message().c_str());
    return 1;
  }
  const double on = median(alternator.on_ms_), off = median(alternator.off_ms_);
  const double events = median(alternator.events_);
  const double off_ns = span_ns(false, 20'000'000);
  const double on_ns = span_ns(true, 1'000'000);
  trace::start();  // drops the spans just recorded
  trace::stop();
  // A step records about `events` events: each costs a span's check with tracing off and a
  // recorded span with it on.
  const double off_cost_ms = events * off_ns / 1e6, on_cost_ms = events * on_ns / 1e6;
  const double pct = off > 0 ? 100.0 / off : 0.0;
  std::printf("tracing cost over %zu traced and %zu untraced steps of one run (medians)\n", alternator.on_ms_.size(),
              alternator.off_ms_.size());
  std::printf("  %-36s %12s\n", "", "per step");
  std::printf("  %-36s %9.3f ms   (reference)\n", "step, tracing off", off);
  std::printf("  %-36s %9.3f ms   %+.2f%% (within this machine's step-to-step noise)\n", "step, tracing on", on,
              pct * (on - off));
  std::printf("  %-36s %9.0f\n", "events a traced step records", events);
  std::printf("  %-36s %9.2f ns\n", "a span, tracing off", off_ns);
  std::printf("  %-36s %9.2f ns\n", "a span, tracing on", on_ns);
  std::printf("  %-36s %9.6f ms   %.5f%% of the step\n", "a step's spans, tracing off", off_cost_ms, pct * off_cost_ms);
  std::printf("  %-36s %9.6f ms   %.5f%% of the step\n", "a step's spans, tracing on", on_cost_ms, pct * on_cost_ms);
  return 0;
}

}  // namespace strata::tools
