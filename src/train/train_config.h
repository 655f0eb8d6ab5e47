// The settings of `strata train`: the schema every key is checked against, the embedded
// default run, and the typed struct the trainer reads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "model/lora.h"
#include "offload/state_layout.h"

namespace strata {

struct TrainConfig {
  // model
  std::string model_preset;       // "tiny", ... (used when model_config is empty)
  std::string model_config;       // path to a Hugging Face config.json
  std::string model_init;         // safetensors file with initial weights ("" = random init)
  std::string model_from;         // Hugging Face directory (config.json + weights); "" = unused
  std::vector<std::string> model_overrides;  // "hidden_size=256" style, applied to the config
  // data
  std::vector<std::string> data_paths;
  std::string data_format;
  bool data_allow_empty_loss = false;  // steps whose masks leave no target are trained, not refused
  std::string data_packing = "concat";  // concat | document (data/data.h: Packing)
  int64_t data_eos_id = -1;             // the token that ends a document (document packing); -1: unset
  std::vector<std::string> data_eval_paths;  // held-out token files; empty: no evaluation
  double data_eval_fraction = 0;             // share of data.paths' documents held out for evaluation
  int64_t eval_every = 0;                    // evaluate every N steps and after the last; 0: the last only
  int64_t eval_steps = 16;                   // micro-batches in one evaluation, over all ranks
  // schedule of work
  int64_t micro_batch = 0;
  int64_t seq_len = 0;
  int64_t grad_accum = 0;
  int64_t steps = 0;
  int64_t max_skipped_steps = 5;  // non-finite steps skipped in a row before the run stops
  double mtp_weight = 0.1;        // the multi-token prediction loss's weight (ModelConfig::mtp_loss_weight)
  bool lora = false;              // train.method=lora
  model::LoraConfig lora_config;  // lora.* (ModelConfig::lora when train.method=lora)
  std::string model_adapter;      // a PEFT adapter directory the adapters start from; "" = lora.init
  uint64_t seed = 0;
  // optimizer
  double lr = 0, min_lr_ratio = 0;
  int64_t warmup_steps = 0;
  std::string lr_schedule;
  double beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, grad_clip = 0;
  bool overlap_backward = false;
  // precision recipe (offload/state_layout.h): fp32, or bf16 (the GPU's; emulated on the cpu)
  Precision precision = Precision::kFp32;
  bool precision_auto = true;
  kernels::MomentFormat moments = kernels::MomentFormat::kF32;  // optim.moments
  bool stochastic_rounding = false;                              // optim.moments_rounding=stochastic  // train.precision=auto: the backend's own (bf16 on cuda, fp32 on the cpu)
  // memory tiers (0 = default, see the schema)
  uint64_t memory_device = 0;
  uint64_t memory_host = 0;
  std::string nvme_path;
  uint64_t nvme_size = 0;
  uint64_t chunk_size = 0;  // 0 = auto
  std::string offload_activations;
  std::string keep_activations = "auto";  // keep every layer's intermediates: auto | true | false
  // Tokens per tile of the MLP and shared expert, and rows per tile of the routed experts
  // (Model::set_mlp_tile_tokens); 0: the whole micro-batch;
  // kMlpTileAuto: the planner's choice (planned_mlp_tile, train/planning.h).
  static constexpr int64_t kMlpTileAuto = -1;
  int64_t mlp_tile_tokens = kMlpTileAuto;
  // rates the planner predicts with
  double gpu_flops = 0, h2d_bytes_per_s = 0, d2h_bytes_per_s = 0, disk_read_bytes_per_s = 0,
         disk_write_bytes_per_s = 0, disk_both_bytes_per_s = 0, cpu_adam_params_per_s = 0;
  double both_bytes_per_s = 87e9, copy_overlap = 1, copy_latency_s = 10e-6, device_adam_params_per_s = 150e9, device_memory_bytes_per_s = 4.2e12;
  // hardware.cpu_tflops_by_width: (hidden size, FLOP/s) ascending; a cpu plan's compute rate.
  std::vector<std::pair<int64_t, double>> cpu_flops_by_width;
  std::string hardware_profile;  // hardware.profile: where the rates come from ("" = built-in defaults)
  // plan.experts_reached: the share of an MoE layer's experts a micro-batch reaches, for the
  // planner's traffic: one for every MoE layer, or one per MoE layer (check_experts_reached);
  // empty: uniform routing's expectation (make_plan_input).
  std::vector<double> experts_reached;
  // checkpoints
  int64_t ckpt_every = 0;
  std::string ckpt_dir;     // "" in the config: RUN_DIR/checkpoints (filled in here)
  bool ckpt_dir_named = false;  // ckpt.dir was given (else it follows run.dir)
  int64_t ckpt_keep_last = 3;
  bool ckpt_keep_best = false;  // save the lowest eval loss so far and keep it (CKPT_DIR/best)
  bool ckpt_skip_if_busy = false;
  uint64_t ckpt_staging = 64ull << 20;
  std::string resume;  // --resume: a checkpoint path, "auto" (ckpt_dir if it has one), or ""
  // run
  std::string run_dir;
  // run.dir was given. An unnamed run gets a fresh RUN_DIR/version_N of the default folder, so
  // that the same command can run twice (train/run_dirs.h).
  bool run_dir_named = false;
  std::string run_export;         // Hugging Face export written after the last step; "" = none
  std::string run_export_dtype = "auto";  // f32 | bf16 | f16 | auto (the starting weights' precision)
  bool run_export_merged = false;         // LoRA: export the merged model instead of the adapter
  int64_t log_every = 1;
  std::string device;
  std::string log_level;
  // data parallelism (parallel.*)
  std::string parallel_backend = "auto";
  std::string parallel_rendezvous;
  double parallel_timeout_s = 300;
  bool parallel_overlap_comm = true;  // gradient sums at handover (PagedStateOptions::overlap_reduction)
  int64_t parallel_expert = 1;        // parallel.expert_parallel: ranks per expert group
  int64_t parallel_context = 1;       // parallel.context_parallel: ranks per context group
  // What strata plan plans for (parallel.world_size, .ranks_per_node, .zero with -1 for auto;
  // hardware.intra_node_gbps, .inter_node_gbps); strata train does not read them.
  int64_t plan_world_size = 1, plan_ranks_per_node = 8;
  int plan_zero = -1;
  double intra_node_bytes_per_s = 150e9, inter_node_bytes_per_s = 25e9;
  int cuda_device = 0;  // not a key: the GPU of this process (its local rank when launched as several)
  int dp_rank = 0;      // not keys: this process's data-parallel rank and their number (train/ranks.h)
  int dp_world = 1;

  // The tokens of one micro-batch this rank computes: with context parallelism its share of
  // every sequence (model/context_parallel.h).
  int64_t rank_tokens() const { return micro_batch * seq_len / std::max<int64_t>(parallel_context, 1); }
  // The context group's ranks as the activation table counts them (0: no context parallelism).
  int64_t ring_ranks() const { return parallel_context > 1 ? parallel_context : 0; }
};

// Every key `strata train` accepts.
const ConfigSchema& train_schema();
// The YAML run when `strata train` is given no config file and no model: the demo.
const char* embedded_default_config();
// The config `strata train` and `strata plan` run: CONFIG.yaml when given; without one, the
// embedded demo when the overrides name no model (model.from, .config, .init or .preset), and
// the schema's defaults otherwise, so the demo's tiny budgets never reach a real model.
Result<Config> load_train_config(const std::string& config_path, const std::vector<std::string>& overrides);
// Typed view of a validated Config, plus cross-key checks (e.g. warmup longer than the run).
Result<TrainConfig> make_train_config(const Config& config);

}  // namespace strata
