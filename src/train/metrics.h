// Per-step metrics: one human line on stderr (through the logger) and one JSON object per
// line in RUN_DIR/metrics.jsonl, written and flushed as each step ends so that a crash loses
// at most the line being written.
#pragma once

#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "core/progress.h"  // format_duration
#include "core/status.h"

namespace strata {

struct StepMetrics {
  int64_t step = 0;
  int64_t total_steps = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double tokens_per_s = 0;
  // Model FLOP/s of the step in units of 10^12: 6N + 12*L*H*T FLOPs per token (DESIGN §2,
  // train/planning.h), recomputation not counted, times tokens_per_s.
  double model_tflops = 0;
  double ms = 0;
  int64_t tokens = 0;          // tokens seen so far
  uint64_t tier_bytes[3] = {0, 0, 0};  // chunk bytes in use on device, host, nvme
  uint64_t state_bytes = 0;    // the training state's chunks this process holds (EngineStats)
  uint64_t moved_bytes = 0;    // bytes moved between tiers during the step
  int world = 1;               // data-parallel ranks
  double comm_bytes = 0;       // bytes each rank sent to the others during the step (mean over ranks)
  // MoE: PagedEngine::experts_reached_by_layer() over the step (empty: dense), and their mean.
  std::vector<double> experts_reached_by_layer;
  double experts_reached = -1;
  double stall_ms = 0;         // time compute waited for data during the step
  uint64_t rss_bytes = 0;      // resident memory of the process
  uint64_t rss_peak_bytes = 0;  // the most it has been resident so far (VmHWM)
  uint64_t rss_planned_bytes = 0;  // the planned peak of host memory (host_ram.h); 0 when unknown
  // Seconds since the first step of this run began, at the end of this step's compute: wall
  // time between two steps includes everything in between (checkpoint starts, logging).
  double elapsed_s = 0;
  bool ckpt_in_flight = false;  // a checkpoint save was being written when the step began
  // The step's loss or gradient norm was NaN/Inf: nothing was updated. skipped_steps counts
  // such steps in this run so far (this one included).
  bool skipped = false;
  int64_t skipped_steps = 0;
  // Seconds until the last step at the run's average pace so far; negative when unknown.
  double eta_s = -1;
  // The precision recipe ("fp8", "bf16, int8 moments"); empty: not shown.
  std::string recipe;
  // The mean NLL per predicted token on data.eval_paths after this step, when `evaluated` (it may
  // then be NaN or Inf, shown as such).
  bool evaluated = false;
  double eval_loss = std::numeric_limits<double>::quiet_NaN();
};

// "step  10/200 | loss 3.2113 | lr 1.50e-03 | gnorm 0.912 | 5.1k tok/s | 199 ms | eta 38s |
//  dev 4.0 MiB host 6.0 MiB nvme 8.0 MiB | moved 12.0 MiB stall 3 ms | rss 61.0 MiB / 80.0 MiB planned"
// (without the planned part when it is unknown); "| eval 3.1002 ppl 22.20" after the loss on a step
// that was evaluated; once a step
// was skipped, "| skipped 2" follows ("| SKIPPED (2)" on the skipped step itself).
std::string format_step_line(const StepMetrics& m);

// Appends JSON lines to a file: one per step, then event lines ({"event": ...}). Not thread-safe. Closes on destruction.
class MetricsWriter {
 public:
  // append: continue the file of a resumed run instead of starting it anew.
  static Result<MetricsWriter> open(const std::string& path, bool append = false);
  MetricsWriter(MetricsWriter&& other) noexcept : file_(other.file_), path_(std::move(other.path_)) { other.file_ = nullptr; }
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  ~MetricsWriter();
  Status write(const StepMetrics& m);
  // Appends one line that is not a step's: a JSON object with an "event" key and no "step"
  // (readers of metrics.jsonl skip such lines), e.g. the run's goodput at its end.
  Status append(const std::string& json_object);

 private:
  MetricsWriter(std::FILE* f, std::string path) : file_(f), path_(std::move(path)) {}
  std::FILE* file_ = nullptr;
  std::string path_;
};

// Resident set size of this process, 0 when /proc is unavailable.
uint64_t resident_bytes();
// The largest resident set this process has had so far (VmHWM), 0 when /proc is unavailable.
uint64_t peak_resident_bytes();

}  // namespace strata
