// PagedEngine: THE training engine. The decoder (model/decoder.h, dense or MoE) on a backend —
// the CPU (fp32, or the GPU's bf16 recipe emulated with train.precision=bf16) or CUDA (bf16) —
// computing over PagedState, the training state held in chunks across the device, host and
// nvme budgets of a TrainConfig as the planner places them (DESIGN §3.2-3.3). A state that
// fits the device is simply the plan that homes every chunk there.
// The training loop (trainer.cpp) owns data, schedule, metrics, checkpoints and export; the
// engine owns how a step is computed and where the state is. Not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/io_engine.h"
#include "memory/tier.h"
#include "model/config.h"
#include "model/decoder.h"
#include "offload/plan.h"
#include "parallel/comm.h"
#include "train/host_ram.h"
#include "train/optimizer.h"
#include "train/paged_state.h"
#include "train/savable_state.h"
#include "train/train_config.h"

namespace strata {

// Memory and traffic of an engine, read before and after each step for the metrics.
struct EngineStats {
  uint64_t tier_bytes[kNumTiers] = {};  // state bytes in use on device, host, nvme
  uint64_t stall_ns = 0;                // compute waiting for state to arrive, cumulative
  uint64_t moved_bytes = 0;             // bytes moved between tiers, cumulative
  // The chunks of the training state this process holds, each once wherever it lives (padding
  // included; a data-parallel rank's slices of the sliced kinds).
  uint64_t state_bytes = 0;
};

// The name a checkpoint gives layer `layer`'s router selection bias (a kState tensor).
std::string selection_bias_state_name(int64_t layer);

class PagedEngine {
 public:
  // Plans the placement for the budgets of `t` (memory.*, train.*), then reserves the tiers.
  // OutOfMemory with the planner's suggestions when the state does not fit; IOError naming
  // memory.nvme.path when it cannot be created. The parameters start at zero: fill them
  // through state().
  // backend kCuda: compute on GPU t.cuda_device (the bf16 recipe unless fp8 is asked for;
  // chunks, activations and the kernels' scratch all in its arena of memory.device); kCpu: on
  // the CPU in train.precision.
  static Result<std::unique_ptr<PagedEngine>> create(const model::ModelConfig& mc, const TrainConfig& t,
                                                     const OptimizerConfig& oc,
                                                     DeviceKind backend = DeviceKind::kCpu);
  ~PagedEngine();
  PagedEngine(const PagedEngine&) = delete;
  PagedEngine& operator=(const PagedEngine&) = delete;

  const model::ParamLayout& layout() const { return net_->layout(); }
  SavableState& state() { return *state_; }
  // The fp8 recipe's compute copies straight from an FP8 checkpoint (PagedState::fill_quantized_copies).
  Status load_quantized_copies(const PagedState::CopyFill& fill) { return state_->fill_quantized_copies(fill); }
  // "cpu", "cuda:0 (NVIDIA H200)": where the steps compute.
  std::string device_name() const { return device_->kind() == DeviceKind::kCpu ? "cpu" : device_->name(); }
  // One line for the run's start: where the state lives and in what sizes.
  std::string memory_summary() const;

  // One optimizer step: zero_grads(), micro_batch() for each micro-batch (`last` for the step's
  // final one, with the step's learning rate), then step(lr).
  Status zero_grads();
  // Returns the SUM of token NLLs over targets >= 0 and accumulates grad_scale times its
  // gradient. inputs and targets are host (B, T) arrays; positions, host (B, T) or null, the
  // document positions of packed documents (model::Model::compute).
  Result<double> micro_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T, float grad_scale,
                             bool last, float lr, const int32_t* positions = nullptr);
  // Evaluation: the SUM of token NLLs over targets >= 0 of one micro-batch, forward only. The
  // weights page in as for training, under the same budgets; no gradient, optimizer state or
  // router statistic changes, so a run's training is the same with evaluations or without.
  Result<double> eval_micro_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                                  const int32_t* positions = nullptr);
  // Clips the global gradient norm and applies AdamW at `lr`; returns the pre-clip norm. A norm
  // that is not finite is returned with nothing changed (the loop skips the step), unless the
  // engine updates during backward, where it is an error: the step cannot be undone.
  Result<double> step(float lr);
  // True when micro_batch() may already change parameters (AdamW overlapped with the last
  // backward): a step with a non-finite loss can then no longer be skipped cleanly.
  bool updates_during_backward() const { return options_.overlap_optimizer; }
  EngineStats stats() const;
  // Data parallelism: from now on the gradients (and MoE expert counts) are summed over the
  // ranks of `comm`; with parallel.overlap_comm the gradients through `handover` (another Comm
  // of the same ranks) as backward hands each layer over. Expert parallelism
  // (parallel.expert_parallel, model/expert_parallel.h): `experts` is this rank's expert group,
  // which exchanges routed tokens, and `expert_holders` the ranks holding the same experts as
  // this one, which sum their gradients and gather their weights (with parallel.overlap_comm,
  // through `expert_handover`, another Comm of those ranks, on the communication stream);
  // InvalidArgument when the group is not the size the engine was made for. All outlive the
  // engine.
  Status set_comm(parallel::Comm* comm, parallel::Comm* handover = nullptr, parallel::Comm* experts = nullptr,
                  parallel::Comm* expert_holders = nullptr, parallel::Comm* expert_handover = nullptr);
  // Context parallelism (parallel.context_parallel = N > 1, model/context_parallel.h): this rank's
  // context group. micro_batch() and eval_micro_batch() then take the rank's share of each
  // sequence, B = 2S rows of seq_len / 2N tokens for S sequences, and every rank of the group
  // calls them in step. Call after set_comm. InvalidArgument when the group's size is not the
  // one the engine was planned for.
  Status set_context_comm(parallel::Comm* context);
  // Device bytes beside the chunks and the activation table for whole groups the ranks hold
  // slices of: ZeRO-2's gradient workspace, ZeRO-3's gathered weights (the plan keeps them free).
  uint64_t workspace_bytes() const;

  // What the engine was planned with, for comparing prediction and measurement: the plan (its
  // per-phase time included; plan() below), the chunk space's counters and the device bytes
  // reserved for the model's activation table beside the chunks.
  ChunkSpaceStats chunk_stats() const { return state_->stats(); }
  uint64_t activation_bytes() const { return activation_bytes_; }

  // Training state besides the tensors that a resume needs (MoE routers' balancing bias).
  std::vector<ExtraState> extra_state() const;
  // The MoE routers' selection biases (blocks x E; ModelConfig::has_selection_bias), as exports and
  // loads of Hugging Face weights hold them (model/hf_io.h).
  const std::vector<float>& selection_bias() const;
  void set_selection_bias(const std::vector<float>& bias);
  void set_extra_state(const std::vector<ExtraState>& extra);
  // A second log line for a step, empty when there is nothing to add (MoE load balance, the MTP
  // module's loss).
  std::string step_note() const;
  // MoE models: per MoE layer (in order), the share of its experts that this rank's training
  // micro-batches reached (gave at least one token) since zero_grads(), over the micro-batches:
  // what plan.experts_reached takes. Empty for a dense model or before the first micro-batch.
  std::vector<double> experts_reached_by_layer() const;
  // Their mean over the layers; -1 when that is empty.
  double experts_reached() const;
  // The precision recipe and moment format the step line names, e.g. "fp8" or "bf16, int8 moments".
  std::string recipe() const;
  // The planner's placement of the state (with several ranks, this rank's share) and what it
  // was planned from: reports compare the measured run with it.
  const Plan& plan() const { return plan_; }
  // ZeRO-3 overlapped: how many groups' gathers this rank's plan runs ahead (Plan::gather_ahead),
  // and running `ahead` (at most that: the fewest over the ranks) instead.
  int gather_ahead() const { return std::max(plan_.gather_ahead, 1); }
  void run_gathers_ahead(int ahead);
  const PlanInput& plan_input() const { return plan_input_; }
  // The host memory a run on this engine holds (host_ram.h), given the data as opened. Its
  // process item was measured before the tiers were reserved: pinned chunks are resident and
  // would count twice.
  HostRamPlan host_ram(const HostRamData& data) const;
  // The backend the steps compute on.
  DeviceKind backend() const { return backend_; }

 private:
  PagedEngine() = default;
  // create()'s steps, in order; each reads what the ones before it set.
  Status open_backend(const TrainConfig& t);
  Status resolve_budgets();
  Status plan_placement(const TrainConfig& t);
  Status open_nvme(const TrainConfig& t);
  Status size_activations(const TrainConfig& t);
  Status create_state(const TrainConfig& t, const OptimizerConfig& oc);

  model::ModelConfig mc_;
  uint64_t process_bytes_ = 0;  // process_baseline_bytes before the tiers were reserved
  Plan plan_;  // its placement shares the tensors out over the ranks
  PlanInput plan_input_;  // what plan_ was made from
  TrainConfig budgets_;  // the settings with every budget and the chunk size resolved
  double train_aux_loss_ = 0;  // the MoE aux loss of the last training micro-batch (step_note)
  double mtp_nll_ = 0;         // the MTP module's NLL sum and targets since zero_grads() (step_note)
  int64_t mtp_targets_ = 0;
  // LoRA dropout's masks: a seed per micro-batch from the run's seed, this rank, the optimizer
  // step and the micro-batch's place in it (a resumed run draws the same ones).
  uint64_t dropout_seed_ = 0;
  int64_t micro_in_step_ = 0;
  std::vector<int64_t> reached_by_layer_;  // experts given tokens, per MoE layer, since zero_grads
  int64_t reach_batches_ = 0;               // the micro-batches they count over
  std::vector<int64_t> counts_before_;               // the expert counts before a micro-batch
  DeviceKind backend_ = DeviceKind::kCpu;
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
  // memory.keep_activations agreed over the ranks of `comm` (all keep, or none).
  Status agree_keep_activations(parallel::Comm& comm);
  parallel::Comm* comm_ = nullptr;  // data-parallel ranks, or null
};

}  // namespace strata
