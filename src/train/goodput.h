// Goodput: where the wall time of a training run went. The run's wall time (the start of
// run_training to its return) is split into parts that sum to it:
//   compute      steps whose work is new (their time minus the engine's memory stalls)
//   memory       compute waiting for state to arrive (EngineStats::stall_ns)
//   checkpoint   the loop blocked on saves: starting one, waiting for the previous one, the
//                final save and the waits at the end
//   startup      config checks, model load or init, engine creation, the resume read
//   restart      steps a previous run had already done after the checkpoint this run resumed
//                from (the work is done twice; their whole time counts here)
//   data         waiting for the data loader
//   export       run.export
//   eval         evaluations on data.eval_paths (train.eval_every)
//   idle         the rest: logging, metrics writes, teardown, anything not timed
// Goodput is compute over wall time.
//
// The accountant keeps one total per part; the training loop adds to them through scoped
// timers, and anyone (the profiler, a test) can read a report at any time. Adding and reading
// are safe from any thread.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace strata {

enum class GoodputPart { kCompute, kMemoryStall, kCheckpoint, kStartup, kRestart, kData, kExport, kEval, kIdle };
inline constexpr int kNumGoodputParts = 9;

// "compute", "memory_stall", ...: the part's key in metrics.jsonl (with "_s" appended).
const char* goodput_part_key(GoodputPart part);

struct GoodputReport {
  double wall_s = 0;
  std::array<double, kNumGoodputParts> seconds{};  // by GoodputPart; they sum to wall_s
  double operator[](GoodputPart part) const { return seconds[static_cast<size_t>(part)]; }
  // Compute over wall time, in [0, 1]; 0 for an empty run.
  double goodput() const;
};

class GoodputAccountant {
 public:
  using Clock = std::chrono::steady_clock;

  // The wall clock starts now.
  GoodputAccountant() : start_(Clock::now()) {}
  GoodputAccountant(const GoodputAccountant&) = delete;
  GoodputAccountant& operator=(const GoodputAccountant&) = delete;

  // Adds seconds to a part; negative or NaN amounts are a bug. Idle is never added to: it is
  // what the other parts leave of the wall time.
  void add(GoodputPart part, double seconds);

  // Adds the time from its construction to its destruction (or stop()) to `part`.
  class Timer {
   public:
    Timer(GoodputAccountant& accountant, GoodputPart part)
        : accountant_(&accountant), part_(part), start_(Clock::now()) {}
    Timer(const Timer&) = delete;
    Timer& operator=(const Timer&) = delete;
    ~Timer() { stop(); }
    // Adds the time so far and stops; returns it (0 when already stopped).
    double stop();

   private:
    GoodputAccountant* accountant_;
    GoodputPart part_;
    Clock::time_point start_;
  };
  [[nodiscard]] Timer time(GoodputPart part) { return Timer(*this, part); }

  // The parts so far; the wall time runs to now and idle is the remainder. When the timed parts
  // exceed the wall time (a stall measured on another thread overlapping), idle is 0 and the
  // wall time is their sum, so that the parts still sum to it.
  GoodputReport report() const;

 private:
  Clock::time_point start_;
  std::array<std::atomic<int64_t>, kNumGoodputParts> ns_{};
};

// "goodput 87.3%: compute 41.2 s, memory stalls 3.1 s, checkpoints 1.0 s, start-up 2.2 s,
//  restart 0 s, data 0.1 s, export 0 s, idle 0.4 s of 48.0 s"
std::string format_goodput_line(const GoodputReport& report);

// {"event":"goodput","wall_s":...,"goodput":...,"compute_s":...,...}: the last line of
// metrics.jsonl. It has no "step" key; readers of metrics.jsonl skip lines with "event".
nlohmann::json goodput_json(const GoodputReport& report);

// The highest "step" recorded in a metrics.jsonl (lines with "event" and lines that do not
// parse, such as one cut short by a crash, are skipped); 0 when there is none or the file
// cannot be read.
int64_t highest_recorded_step(const std::string& metrics_path);

}  // namespace strata
