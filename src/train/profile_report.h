// What `strata profile` reports: a trace of a few training steps (core/trace.h) read back and
// set beside the planner's placement and prediction.
//
// - Memory: for each tier and kind of state, the planned bytes against the peak the chunk
//   space's counters reached during the traced steps.
// - Traffic: bytes moved per step in each direction (host->device and device->host copies,
//   nvme reads and writes), planned against measured, with the time the copy engine or disk was
//   busy and the share of that time hidden behind the training thread's work (not spent with
//   the training thread waiting in a stall).
// - Time: the training thread is the step's critical path (copies, nvme I/O, the overlapped
//   optimizer and the checkpoint writer run beside it and only cost time through its stalls);
//   its time is split exclusively into phases that sum to the step: forward, recompute,
//   backward, head (LM head and loss), optimizer, memory stalls, data, checkpoint, other.
//   When the model's ops are queued on a compute stream, the host runs ahead and waits for the
//   stream at read-backs (the loss, the optimizer): each wait is split by the phases the
//   stream's own track shows it ran meanwhile, so the phases still say where the step went.
// - Prediction: the plan's step time and terms against the measured ones.
// Pure computation over recorded events; thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/trace.h"
#include "offload/plan.h"

namespace strata {

struct ProfileReport {
  int64_t steps = 0;           // traced steps
  double step_s = 0;           // mean step time (the phases sum to it)
  double median_step_s = 0;
  // Memory per tier: planned bytes per kind, and the peak per kind and of the tier's total.
  struct TierMemory {
    std::string tier;
    KindBytes planned;
    KindBytes peak;
    uint64_t peak_total = 0;
  };
  std::vector<TierMemory> memory;
  // Traffic per step in one direction.
  struct Traffic {
    std::string name;         // "host->device", "device->host", "nvme read", "nvme write"
    uint64_t planned_bytes = 0;
    uint64_t bytes = 0;       // measured, per step
    double busy_s = 0;        // per step: time at least one such transfer ran
    double hidden_share = 1;  // of busy time, the part the training thread did not wait through
    bool traced = true;       // false: the backend does not trace these (cuda copies)
  };
  std::vector<Traffic> traffic;
  // Collectives between the ranks per step (the "communication" spans of every thread): the
  // time at least one ran, and the share of it the training thread did not wait through (it
  // ran on another thread beside compute: the sums at handover), beside the plan's. traced
  // false: no collective was traced (one process).
  struct Communication {
    double busy_s = 0;
    double hidden_share = 0;
    double planned_s = 0, planned_hidden_share = 0;
    bool traced = false;
  };
  Communication communication;
  // The training thread's time per step by phase, and each phase's parts (stall kinds,
  // optimizer parts); both sum to step_s.
  std::vector<std::pair<std::string, double>> phases;
  std::vector<std::pair<std::string, double>> stalls;
  // Busy time per step of the other tracks (copy streams, overlapped optimizer, writer).
  std::vector<std::pair<std::string, double>> tracks;
  // The plan's prediction beside what was measured, per step.
  struct Term {
    std::string name;
    double predicted_s = 0;
    double measured_s = 0;
  };
  std::vector<Term> terms;
  // The plan's step phases (StepPhases) against the training thread's spans, each counted
  // whole with the stalls inside it.
  std::vector<Term> phase_terms;
  std::string predicted_bound;  // the plan's bottleneck
  std::string rates_source;     // where the planner's machine rates came from
  std::vector<std::string> notes;
};

struct ProfileInput {
  std::vector<trace::ThreadEvents> threads;
  const Plan* plan = nullptr;             // may be null: no plan columns
  const PlanInput* plan_input = nullptr;  // with plan
  std::string rates_source;
  std::string training_thread = "training";
  // The track of the model's compute stream (kernels/cpu/queued_ops.h), when its ops are queued.
  std::string compute_stream = "compute stream";
  std::string backend = "cpu";  // "cuda": spans are host time, copies are not traced
};

ProfileReport analyze_profile(const ProfileInput& in);

// The report as text for people, and as JSON (report.json) for scripts and tests.
std::string format_profile_report(const ProfileReport& r);
nlohmann::json profile_report_json(const ProfileReport& r);

}  // namespace strata
