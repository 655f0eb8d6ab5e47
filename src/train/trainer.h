// The training run behind `strata train`: checks every input before writing anything, then
// runs the optimizer steps, printing one line per step and appending metrics.jsonl.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"
#include "model/config.h"
#include "train/train_config.h"

namespace strata {

struct TrainSummary {
  int64_t steps_done = 0;
  double first_loss = 0;
  double last_loss = 0;
  bool interrupted = false;  // stopped early by SIGINT/SIGTERM
};

// The model's config.json (model.config, or the preset) with model.set overrides applied.
Result<model::ModelConfig> resolve_model_config(const TrainConfig& config);

// `effective_yaml` is the fully resolved configuration, saved as RUN_DIR/config.yaml.
// An error leaves no half-written run directory behind: the directory and its files are
// created only after the model, the data and the budgets have been checked.
Result<TrainSummary> run_training(const TrainConfig& config, const std::string& effective_yaml);

}  // namespace strata
