// The training run behind `strata train`: checks every input before writing anything, then
// runs the optimizer steps, printing one line per step and appending metrics.jsonl.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"
#include "model/config.h"
#include "train/paged_engine.h"
#include "train/metrics.h"
#include "train/goodput.h"
#include "train/optimizer.h"
#include "train/train_config.h"

namespace strata {

struct TrainSummary {
  int64_t steps_done = 0;
  double first_loss = 0;
  double last_loss = 0;
  bool interrupted = false;  // stopped early by SIGINT/SIGTERM
  int64_t skipped_steps = 0;  // steps skipped for a NaN/Inf loss or gradient norm
  GoodputReport goodput;      // where the run's wall time went (also metrics.jsonl's last line)
};

// The model's config.json (model.config, or the preset) with model.set overrides applied.
Result<model::ModelConfig> resolve_model_config(const TrainConfig& config);

// `effective_yaml` is the fully resolved configuration, saved as RUN_DIR/config.yaml. The
// engine is the one run.device names: cuda (the CUDA model with the state on the GPU), cpu (the
// CPU model over the paged state), or auto (cuda when this build has it, a GPU is visible and
// the model runs and fits there, logging why not otherwise; then cpu).
// An error leaves no half-written run directory behind: the directory and its files are
// created only after the model, the data and the budgets have been checked.
Result<TrainSummary> run_training(const TrainConfig& config, const std::string& effective_yaml);

// Watches a run from inside the loop (`strata profile` starts and stops tracing with it).
// Called on the training thread; must not throw.
class RunObserver {
 public:
  virtual ~RunObserver() = default;
  // Once the run is prepared: its settings as resolved (run.dir named) and its engine.
  virtual void on_start(const TrainConfig& /*t*/, const PagedEngine& /*engine*/) {}
  // Before a step loads its data, and after its metrics line is written.
  virtual void on_step_begin(int64_t /*step*/) {}
  virtual void on_step_end(const StepMetrics& /*m*/) {}
};
// run_training with `observer` watching the loop (null: none).
Result<TrainSummary> run_training(const TrainConfig& config, const std::string& effective_yaml,
                                  RunObserver* observer);

}  // namespace strata
