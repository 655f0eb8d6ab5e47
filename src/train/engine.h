// TrainEngine: the model and its training state on one backend, as the training loop drives
// them. PagedEngine (paged_engine.h) is the one implementation: the decoder on the CPU or CUDA
// backend over PagedState, the state in chunks across device, host and nvme budgets (all on the
// device when the plan homes it there). The interface keeps the loop (trainer.cpp) testable
// with engines of its own.
// The loop owns data, schedule, metrics, checkpoints and export; an engine owns how a step is
// computed and where the state is. Not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "memory/tier.h"
#include "model/params.h"
#include "offload/plan.h"
#include "parallel/comm.h"
#include "train/host_ram.h"
#include "train/savable_state.h"

namespace strata {

// Memory and traffic of an engine, read before and after each step for the metrics.
struct EngineStats {
  uint64_t tier_bytes[kNumTiers] = {};  // state bytes in use on device, host, nvme
  uint64_t stall_ns = 0;                // compute waiting for state to arrive, cumulative
  uint64_t moved_bytes = 0;             // bytes moved between tiers, cumulative
};

class TrainEngine {
 public:
  virtual ~TrainEngine() = default;

  virtual const model::ParamLayout& layout() const = 0;
  virtual SavableState& state() = 0;
  // "cpu", "cuda:0 (NVIDIA H200)": where the steps compute.
  virtual std::string device_name() const = 0;
  // One line for the run's start: where the state lives and in what sizes.
  virtual std::string memory_summary() const = 0;

  // One optimizer step: zero_grads(), micro_batch() for each micro-batch (`last` for the step's
  // final one, with the step's learning rate), then step(lr).
  virtual Status zero_grads() = 0;
  // Returns the SUM of token NLLs over targets >= 0 and accumulates grad_scale times its
  // gradient. inputs and targets are host (B, T) arrays.
  virtual Result<double> micro_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                                     float grad_scale, bool last, float lr) = 0;
  // Clips the global gradient norm and applies AdamW at `lr`; returns the pre-clip norm. A norm
  // that is not finite is returned with nothing changed (the loop skips the step), unless the
  // engine updates during backward, where it is an error: the step cannot be undone.
  virtual Result<double> step(float lr) = 0;
  // True when micro_batch() may already change parameters (AdamW overlapped with the last
  // backward): a step with a non-finite loss can then no longer be skipped cleanly.
  virtual bool updates_during_backward() const { return false; }

  virtual EngineStats stats() const = 0;

  // Data parallelism: from now on step() sums the gradients (and what else a step shares, such
  // as MoE expert counts) over the ranks of `comm`, which outlives the engine. An engine that
  // cannot returns Unimplemented for a world larger than 1.
  virtual Status set_comm(parallel::Comm* comm) {
    if (comm == nullptr || comm->world_size() == 1) return Status::OK();
    return Status::Unimplemented("this engine trains in one process only");
  }

  // Training state besides the tensors that a resume needs (MoE routers' balancing bias).
  virtual std::vector<ExtraState> extra_state() const { return {}; }
  virtual void set_extra_state(const std::vector<ExtraState>& /*extra*/) {}
  // A second log line for a step, empty when there is nothing to add (MoE load balance).
  virtual std::string step_note() const { return {}; }
  // The precision recipe and moment format the step line names, e.g. "fp8" or "bf16, int8 moments".
  virtual std::string recipe() const { return {}; }
  // The planner's placement of the state and what it was planned from (reports compare the
  // measured run with it); null when the engine was not planned.
  virtual const Plan* plan() const { return nullptr; }
  virtual const PlanInput* plan_input() const { return nullptr; }

  // The host memory a run on this engine holds (host_ram.h), given the data as opened; empty
  // for an engine that does not plan its memory.
  virtual HostRamPlan host_ram(const HostRamData& /*data*/) const { return {}; }
};

}  // namespace strata
