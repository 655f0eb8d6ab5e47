// PagedEngine: THE training engine. The decoder (model/decoder.h, dense or MoE) on a backend —
// the CPU (fp32, or the GPU's bf16 recipe emulated with train.precision=bf16) or CUDA (bf16) —
// computing over PagedState, the training state held in chunks across the device, host and
// nvme budgets of a TrainConfig as the planner places them (DESIGN §3.2-3.3). A state that
// fits the device is simply the plan that homes every chunk there.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/io_engine.h"
#include "model/config.h"
#include "model/decoder.h"
#include "offload/plan.h"
#include "train/engine.h"
#include "train/optimizer.h"
#include "train/paged_state.h"
#include "train/train_config.h"

namespace strata {

class PagedEngine final : public TrainEngine {
 public:
  // Plans the placement for the budgets of `t` (memory.*, train.*), then reserves the tiers.
  // OutOfMemory with the planner's suggestions when the state does not fit; IOError naming
  // memory.nvme.path when it cannot be created. The parameters start at zero: fill them
  // through state().
  // cuda: compute on GPU 0 (the bf16 recipe; chunks, activations and the kernels' scratch all
  // in its arena of memory.device); otherwise on the CPU in train.precision.
  static Result<std::unique_ptr<PagedEngine>> create(const model::ModelConfig& mc, const TrainConfig& t,
                                                     const OptimizerConfig& oc, bool cuda = false);
  ~PagedEngine() override;

  const model::ParamLayout& layout() const override { return net_->layout(); }
  SavableState& state() override { return *state_; }
  std::string device_name() const override { return device_->kind() == DeviceKind::kCpu ? "cpu" : device_->name(); }
  std::string memory_summary() const override;

  Status zero_grads() override;
  Result<double> micro_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T, float grad_scale,
                             bool last, float lr) override;
  Result<double> step(float lr) override;
  bool updates_during_backward() const override { return options_.overlap_optimizer; }
  EngineStats stats() const override;
  Status set_comm(parallel::Comm* comm) override;

  // What the engine was planned with, for comparing prediction and measurement: the plan (its
  // per-phase time included; plan() below), the chunk space's counters and the device bytes
  // reserved for the model's activation table beside the chunks.
  ChunkSpaceStats chunk_stats() const { return state_->stats(); }
  uint64_t activation_bytes() const { return activation_bytes_; }

  std::vector<ExtraState> extra_state() const override;
  void set_extra_state(const std::vector<ExtraState>& extra) override;
  std::string step_note() const override;
  std::string recipe() const override;
  const Plan* plan() const override { return &plan_; }
  const PlanInput* plan_input() const override { return &plan_input_; }
  HostRamPlan host_ram(const HostRamData& data) const override;

 private:
  PagedEngine() = default;

  model::ModelConfig mc_;
  Plan plan_;  // its placement carries the groups' owners with several ranks
  PlanInput plan_input_;  // what plan_ was made from
  TrainConfig budgets_;  // the settings with every budget and the chunk size resolved
  bool cuda_ = false;
  PagedStateOptions options_;
  bool keep_activations_ = false;
  uint64_t activation_bytes_ = 0;
  std::string device_split_;  // how memory.device is divided, for the start-up line
  std::string nvme_path_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<IoEngine> io_;
  std::unique_ptr<StateKernels> state_kernels_;  // the device's; null on the CPU
  std::unique_ptr<model::Model> net_;
  std::unique_ptr<PagedState> state_;
  parallel::Comm* comm_ = nullptr;  // data-parallel ranks, or null
};

}  // namespace strata
