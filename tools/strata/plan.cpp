// strata plan [CONFIG.yaml] [key=value ...]: memory per tier, traffic and predicted step time
// for a training config, without training.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/config.h"
#include "core/host_memory.h"
#include "data/data.h"
#include "core/units.h"
#include "memory/chunk.h"
#include "offload/plan.h"
#include "tools/strata/commands.h"
#include "train/hardware_profile.h"
#include "train/host_ram.h"
#include "train/paged_state.h"
#include "train/planning.h"
#include "train/machine_bench.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace strata::tools {
namespace {

constexpr const char* kPlanUsage = R"(Usage: strata plan [CONFIG.yaml] [key=value ...] [--hardware FILE]

Answers "will this fit, and how fast?" for a training config (the same file and keys as
`strata train`) without training: bytes of parameters, gradients, master weights, Adam states
and activations on each tier (device, pinned host, nvme), bytes moved over PCIe and to disk
per step, the predicted step time and what bounds it, the largest micro-batch that fits, the
longest train.seq_len that fits, the smallest memory.host that fits the other budgets, and
the run's peak host memory, itemised (chunks, staging, checkpoint staging, data, ...).
An infeasible config is refused with the smallest change that would make it fit (exit 1). A
peak host memory beyond what this machine has available is flagged (`strata train` would refuse
the run here); the plan still stands for a machine with the memory, so the exit code is 0.

Budgets come from memory.device, memory.host and memory.nvme.*; rates from hardware.*: the
defaults are an H200 box; `strata bench machine --save` measures this machine and keeps its
profile, which plans for runs on that device then use; --hardware FILE reads a profile written
with --out FILE instead, --hardware builtin the defaults (key=value on the command line still
wins). The report names where the rates came from. run.device=cuda plans the GPU's bf16 recipe (a bf16 compute
copy of the weights and bf16 activations; fp32 master weights, gradients and Adam states), as
does auto where this build sees a CUDA device (as `strata train` resolves it), or the fp8
recipe with train.precision=fp8; cpu, and auto on a machine without a GPU, plan the CPU backend
in train.precision (fp32 by default, or the bf16 or fp8 recipe emulated). To plan a GPU run
from a machine without one, say run.device=cuda. optim.moments=bf16|int8 plans compact Adam
moments. `strata train` pages the state as planned on either backend.

After the plan, two tables compare the choices under the same budgets: each precision recipe
(bytes of the compute copy, all state, traffic over PCIe and to disk per step, step time), and
each Adam moment format (bytes per parameter and the largest model of this width that fits).

The step time is predicted phase by phase as the engine schedules it: per micro-batch the
forward and the (recompute and) backward, each its compute plus the copies that cannot hide
behind it (the first layer's, and whatever the copy streams need beyond the compute; on the
cpu backend copies share the cores with compute, hardware.copy_overlap); then the passes
over the gradients and the optimizer (AdamW on the device and on the CPU, nvme reads and
writes), less what of it ran during backward with optim.overlap_backward.

Data parallelism: parallel.world_size=N plans one of N ranks (parallel.ranks_per_node, 8 by
default, share a node): each rank's budgets are memory.* as given and its step train.* as
given. parallel.zero=auto|0|1|2|3 says what is sharded over the ranks (1: master weights and
Adam moments, 2: also gradients, 3: also the compute copy; auto: the fastest level that fits).
A table then compares the four levels: bytes per rank on each tier, whether it fits, the bytes
each rank sends per step (ring collectives), their time at hardware.intra_node_gbps (a world
within one node) or hardware.inter_node_gbps, the step time and the world's tokens/s; the
gradient reduction is counted after backward in full, ZeRO-3's parameter gathers beside compute.
`strata train` runs ZeRO-0 and ZeRO-1 (each rank owning its range of every tensor) and takes its
world from the launcher, not from parallel.world_size.

Example:
  strata plan model.preset=llama3-8b memory.device=24GiB memory.host=100GiB \
      run.device=cuda train.micro_batch=4 train.seq_len=2048 train.grad_accum=8
)";

// The host memory of the planned run, with the data files as they would be opened (a built-in
// corpus, or files that cannot be opened, count as none).
HostRamPlan plan_run_host_ram(const model::ModelConfig& mc, TrainConfig t, const Plan& plan, DeviceKind device) {
  if (t.memory_host == 0) t.memory_host = default_host_budget();
  // The training data and the eval data (data.eval_paths), as strata train counts them.
  HostRamData data;
  for (const std::vector<std::string>* paths : {&t.data_paths, &t.data_eval_paths}) {
    DataConfig dc;
    dc.format = t.data_format;
    for (const std::string& p : *paths)
      if (p.rfind("builtin:", 0) != 0) dc.paths.push_back(p);
    if (dc.paths.empty()) continue;
    Result<std::unique_ptr<TokenDataset>> dataset = open_dataset(dc);
    if (!dataset.ok()) continue;
    const int64_t windows = (*dataset)->num_tokens() / std::max<int64_t>(t.seq_len, 1);
    data += host_ram_data(**dataset, windows);
  }
  return plan_host_ram(mc, t, plan, device, data);
}

// "3.21 s", "52.1 ms"; "8.03B", "410.2M".
std::string seconds_text(double s) { return s >= 1 ? fmt::format("{:.2f} s", s) : fmt::format("{:.3g} ms", s * 1e3); }
std::string count_text(double n) {
  if (n >= 1e12) return fmt::format("{:.2f}T", n / 1e12);
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  return fmt::format("{:.1f}M", n / 1e6);
}

// Each recipe's and each moment format's plan under the same budgets, side by side.
std::string format_recipe_comparison(const model::ModelConfig& mc, const TrainConfig& tc, DeviceKind device) {
  const model::ParamLayout layout(mc);
  std::string out = "  recipes side by side (these budgets and moments";
  out += "):\n";
  out += fmt::format("    {:<7} {:>12} {:>12} {:>12} {:>12} {:>12} {:>10}  {}\n", "recipe", "copy", "all state",
                     "h2d/step", "d2h/step", "disk/step", "step", "fits");
  std::vector<Precision> recipes = {Precision::kBf16, Precision::kFp8};
  if (device != DeviceKind::kCuda) recipes.insert(recipes.begin(), Precision::kFp32);
  for (Precision p : recipes) {
    TrainConfig t = tc;
    t.precision = p;
    t.precision_auto = false;
    const StateLayout state = StateLayout::of(p, t.moments);
    t.chunk_size = PagedState::auto_chunk_bytes(layout, state);
    const PlanInput in = make_plan_input(mc, t, device);
    const Plan plan = make_plan(in);
    uint64_t all = 0;
    for (StateKind k : state.kinds()) all += PagedState::state_bytes(layout, state, k);
    out += fmt::format("    {:<7} {:>12} {:>12} {:>12} {:>12} {:>12} {:>10}  {}\n", precision_name(p),
                       format_bytes(PagedState::state_bytes(layout, state, StateKind::kParam)), format_bytes(all),
                       plan.fits ? format_bytes(plan.h2d_bytes) : "-", plan.fits ? format_bytes(plan.d2h_bytes) : "-",
                       plan.fits ? format_bytes(plan.disk_read_bytes + plan.disk_write_bytes) : "-",
                       plan.fits ? seconds_text(plan.step_s) : "-", plan.fits ? "yes" : "no");
  }
  out += fmt::format("  Adam moment formats ({} recipe; the largest model of this width that fits, chunk padding aside):\n",
                     precision_name(planned_precision(tc, device)));
  out += fmt::format("    {:<7} {:>14} {:>8} {:>12}\n", "moments", "state/param", "layers", "parameters");
  for (kernels::MomentFormat f : {kernels::MomentFormat::kF32, kernels::MomentFormat::kBf16, kernels::MomentFormat::kInt8}) {
    TrainConfig t = tc;
    t.moments = f;
    const StateLayout state = StateLayout::of(planned_precision(t, device), f);
    uint64_t all = 0;
    for (StateKind k : state.kinds()) all += PagedState::state_bytes(layout, state, k);
    const int64_t layers = largest_layer_count(mc, t, device);
    model::ModelConfig largest = mc;
    largest.num_hidden_layers = std::max<int64_t>(layers, 1);
    std::erase_if(largest.mlp_only_layers, [&](int64_t l) { return l >= largest.num_hidden_layers; });
    out += fmt::format("    {:<7} {:>14} {:>8} {:>12}\n", kernels::moment_format_name(f),
                       fmt::format("{:.2f} bytes", static_cast<double>(all) / static_cast<double>(mc.num_parameters())),
                       layers, layers > 0 ? count_text(static_cast<double>(largest.num_parameters())) : "-");
  }
  return out;
}

// Full fine-tuning and LoRA (lora.* as given) under the same budgets and recipe, side by side:
// what is trained, the bytes on each tier, the traffic and the step time.
std::string format_method_comparison(const model::ModelConfig& mc, const TrainConfig& tc, DeviceKind device) {
  std::string out = fmt::format(
      "  full fine-tuning and LoRA side by side (these budgets, the {} recipe; LoRA rank {} on [{}]):\n",
      precision_name(planned_precision(tc, device)), tc.lora_config.rank,
      fmt::join(model::lora_target_names(tc.lora_config.targets), ", "));
  out += fmt::format("    {:<6} {:>10} {:>11} {:>11} {:>11} {:>11} {:>11} {:>10} {:>10}  {}\n", "method", "trained",
                     "device", "host", "nvme", "h2d/step", "disk/step", "step", "tokens/s", "fits");
  for (const bool lora : {false, true}) {
    model::ModelConfig m = mc;
    m.lora = lora ? tc.lora_config : model::LoraConfig{};
    if (!m.validate("lora.*").ok()) {
      out += fmt::format("    {:<6} {}\n", "lora", m.validate("lora.*").message());
      continue;
    }
    const model::ParamLayout layout(m);
    TrainConfig t = tc;
    t.chunk_size = PagedState::auto_chunk_bytes(layout, StateLayout::of(planned_precision(t, device), t.moments));
    const Plan plan = make_plan(make_plan_input(m, t, device));
    double trained = 0;
    for (const model::TensorSpec& s : layout.tensors()) trained += s.frozen ? 0 : static_cast<double>(s.numel);
    const double tokens = static_cast<double>(t.micro_batch * t.seq_len * t.grad_accum);
    out += fmt::format("    {:<6} {:>10} {:>11} {:>11} {:>11} {:>11} {:>11} {:>10} {:>10}  {}\n", lora ? "lora" : "full",
                       count_text(trained), format_bytes(plan.device.total()), format_bytes(plan.host.total()),
                       format_bytes(plan.nvme.total()), plan.fits ? format_bytes(plan.h2d_bytes) : "-",
                       plan.fits ? format_bytes(plan.disk_read_bytes + plan.disk_write_bytes) : "-",
                       plan.fits ? seconds_text(plan.step_s) : "-",
                       plan.fits ? fmt::format("{:.0f}", tokens / plan.step_s) : "-", plan.fits ? "yes" : "no");
  }
  return out;
}

}  // namespace

int plan_command(const std::vector<std::string>& args) {
  std::string config_path;
  std::vector<std::string> overrides;
  std::string hardware;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kPlanUsage);
      return 0;
    } else if (a == "--hardware") {
      if (i + 1 >= args.size()) {
        std::fprintf(stderr, "strata plan: error: --hardware needs a profile file (strata bench machine --out FILE)\n");
        return 2;
      }
      hardware = args[++i];
    } else if (a.find('=') != std::string::npos) {
      overrides.push_back(a);
    } else if (config_path.empty() && !a.empty() && a[0] != '-') {
      config_path = a;
    } else {
      std::fprintf(stderr, "strata plan: error: unexpected argument '%s' (see strata plan --help)\n", a.c_str());
      return 2;
    }
  }
  // The hardware profile's keys (--hardware's, else this machine's saved one) go first, so that
  // key=value on the command line still wins.
  {
    Result<std::vector<std::string>> keys = hardware_keys(hardware, config_path, overrides);
    if (!keys.ok()) {
      std::fprintf(stderr, "strata %s: error: %s\n", "plan", keys.status().message().c_str());
      return 1;
    }
    overrides.insert(overrides.begin(), keys->begin(), keys->end());
  }
  Result<Config> config = load_train_config(config_path, overrides);
  if (!config.ok()) {
    std::fprintf(stderr, "strata plan: error: %s\n", config.status().message().c_str());
    return 1;
  }
  Result<TrainConfig> tc = make_train_config(*config);
  if (!tc.ok()) {
    std::fprintf(stderr, "strata plan: error: %s\n", tc.status().message().c_str());
    return 1;
  }
  Result<model::ModelConfig> mc = resolve_model_config(*tc);
  if (!mc.ok()) {
    std::fprintf(stderr, "strata plan: error: %s\n", mc.status().message().c_str());
    return 1;
  }
  if (Status ep = check_expert_parallel(*mc, tc->parallel_expert, tc->plan_world_size, tc->plan_zero); !ep.ok()) {
    std::fprintf(stderr, "strata plan: error: %s\n", ep.message().c_str());
    return 1;
  }
  if (Status er = check_experts_reached(*mc, tc->experts_reached); !er.ok()) {
    std::fprintf(stderr, "strata plan: error: %s\n", er.message().c_str());
    return 1;
  }
  // Where strata train would run these keys here: auto is the GPU only where one is visible.
  const DeviceKind device = planned_device(*tc);
  const bool cuda = device == DeviceKind::kCuda;
  if (Status cp = check_context_parallel(*tc, tc->plan_world_size, device); !cp.ok()) {
    std::fprintf(stderr, "strata plan: error: %s\n", cp.message().c_str());
    return 1;
  }
  // Latent attention: what cannot combine is an error; that the GPU does not run it yet is said,
  // and the GPU's plan made all the same (what it would take is what people plan for).
  if (Status ml = check_latent_attention(*mc, *tc, DeviceKind::kCpu); !ml.ok()) {
    std::fprintf(stderr, "strata plan: error: %s\n", ml.message().c_str());
    return 1;
  }
  if (Status ml = check_latent_attention(*mc, *tc, device); !ml.ok())
    std::fprintf(stderr, "strata plan: note: %s (the plan below is the GPU's all the same)\n", ml.message().c_str());
  if (tc->memory_device == 0) {
    if (cuda && !cuda_device_visible()) {
      std::fprintf(stderr, "strata plan: error: memory.device is 0; set it to the GPU memory to plan for (e.g. memory.device=24GiB)\n");
      return 1;
    }
    if (cuda) {
      // As strata train reads it: the whole free GPU here.
      Result<uint64_t> free = free_gpu_budget(*tc);
      if (!free.ok()) {
        std::fprintf(stderr, "strata plan: error: memory.device=0 means the free GPU memory: %s\n",
                     free.status().message().c_str());
        return 1;
      }
      tc->memory_device = *free;
      std::printf("memory.device=0: the free memory of cuda:%d, %s\n", tc->cuda_device,
                  format_bytes(*free).c_str());
    } else {
      tc->memory_device = tc->memory_host ? tc->memory_host : default_host_budget();
    }
  }
  // The chunks `strata train` would make, on either backend, so that padding is counted.
  {
    const model::ParamLayout layout(*mc);
    const StateLayout state = StateLayout::of(planned_precision(*tc, device), tc->moments);
    if (tc->chunk_size == 0) tc->chunk_size = PagedState::auto_chunk_bytes(layout, state);
    for (const model::TensorSpec& t : layout.tensors()) {
      const uint64_t bytes = PagedState::largest_block_bytes(layout, t, state);  // its largest block's
      if (bytes <= tc->chunk_size) continue;
      const uint64_t least = (bytes + kChunkAlignment - 1) / kChunkAlignment * kChunkAlignment;  // chunk sizes are 4 KiB multiples
      std::fprintf(stderr, "strata plan: error: tensor '%s' (%s) is larger than a chunk (%s); raise memory.chunk_size "
                   "to at least %s, or leave it auto\n", t.name.c_str(), format_bytes(bytes).c_str(),
                   format_bytes(tc->chunk_size).c_str(), format_bytes(least).c_str());
      return 1;
    }
  }
  const PlanInput in = make_plan_input(*mc, *tc, device);
  const Plan plan = make_plan(in);
  const double n_params = static_cast<double>(mc->num_parameters());
  char params_text[32];
  if (n_params >= 1e12) std::snprintf(params_text, sizeof params_text, "%.3fT", n_params / 1e12);
  else if (n_params >= 1e9) std::snprintf(params_text, sizeof params_text, "%.3fB", n_params / 1e9);
  else std::snprintf(params_text, sizeof params_text, "%.3fM", n_params / 1e6);
  const Precision recipe = planned_precision(*tc, device);
  std::printf("model: %s layers, hidden %lld, vocab %lld, %s parameters; %s layout (%s recipe, %s Adam moments)\n",
              std::to_string(mc->num_hidden_layers).c_str(), static_cast<long long>(mc->hidden_size),
              static_cast<long long>(mc->vocab_size), params_text, cuda ? "GPU" : "CPU", precision_name(recipe),
              kernels::moment_format_name(tc->moments));
  if (tc->device == "auto")
    std::printf("run.device=auto: %s\n", cuda ? "a CUDA device is visible here, so the GPU layout"
                                             : "no CUDA device is visible here, so the CPU layout (run.device=cuda "
                                               "plans a GPU run)");
  std::printf("step: %lld x %lld tokens x %lld accumulation = %lld tokens%s; budgets device %s, host %s, nvme %s\n",
              static_cast<long long>(tc->micro_batch), static_cast<long long>(tc->seq_len),
              static_cast<long long>(tc->grad_accum),
              static_cast<long long>(tc->micro_batch * tc->seq_len * tc->grad_accum),
              tc->parallel_context > 1
                  ? fmt::format(" ({} per rank: 1/{} of each sequence, parallel.context_parallel)", in.tokens_per_step,
                                tc->parallel_context)
                        .c_str()
                  : "",
              format_bytes(in.device_budget).c_str(), format_bytes(in.host_budget).c_str(),
              in.nvme_budget ? format_bytes(in.nvme_budget).c_str() : "none");
  if (const int64_t tile = planned_mlp_tile(*mc, *tc, device); tile > 0) {
    // (model/activations.h: the routed experts tile without expert parallelism only.)
    const char* experts = !mc->is_moe()                            ? ""
                          : tc->parallel_expert > 1                 ? ", the routed experts untiled (expert parallelism)"
                          : planned_precision(*tc, device) == Precision::kFp8 ? ", the routed experts untiled (fp8)"
                                                                     : ", the routed experts in tiles of as many rows";
    std::printf("MLP: in tiles of %lld tokens%s (memory.mlp_tile_tokens=%s)\n", static_cast<long long>(tile),
                experts,
                tc->mlp_tile_tokens == TrainConfig::kMlpTileAuto ? "auto: untiled does not fit"
                                                                 : std::to_string(tile).c_str());
  }
  std::printf("rates: %s\n", tc->hardware_profile.empty()
                                ? "built-in defaults (an H200 box; strata bench machine measures this one)"
                                : tc->hardware_profile.c_str());
  if (!cuda && !tc->cpu_flops_by_width.empty())
    std::printf("compute: %.4g TFLOP/s at hidden %lld (hardware.cpu_tflops_by_width)\n", in.rates.compute_flops / 1e12,
                static_cast<long long>(mc->hidden_size));
  if (in.world_size > 1) {
    std::printf("%s", format_zero_levels(in, plan.zero).c_str());
    std::printf("per rank at ZeRO-%d (each rank's budgets and micro-batches as above; the world's step is %lld "
                "tokens):\n", plan.zero, static_cast<long long>(in.world_size * in.tokens_per_step));
  }
  std::printf("%s", format_plan(in, plan).c_str());
  const HostRamPlan ram = plan_run_host_ram(*mc, *tc, plan, device);
  std::printf("  %s\n%s", format_host_ram(ram).c_str(), format_host_ram_items(ram, "    ").c_str());
  const Status ram_fits = check_host_ram(ram, available_host_memory());
  const int64_t best = largest_micro_batch(*mc, *tc, device);
  if (best > 0)
    std::printf("  largest micro-batch that fits: %lld sequences of %lld tokens\n", static_cast<long long>(best),
                static_cast<long long>(tc->seq_len));
  else
    std::printf("  not even a micro-batch of 1 sequence fits these budgets\n");
  {
    // Sequence length as a budgeted resource: the longest that fits, at one sequence per
    // micro-batch and at the configured micro-batch.
    TrainConfig one = *tc;
    one.micro_batch = 1;
    const int64_t longest = longest_sequence(*mc, one, device);
    std::string line = longest > 0 ? fmt::format("{} tokens at micro-batch 1", longest)
                                   : std::string("none at micro-batch 1");
    if (tc->micro_batch > 1) {
      const int64_t at_batch = longest_sequence(*mc, *tc, device);
      line += at_batch > 0 ? fmt::format(", {} at micro-batch {}", at_batch, tc->micro_batch)
                           : fmt::format(", none at micro-batch {}", tc->micro_batch);
    }
    if (longest > mc->max_position_embeddings)
      line += fmt::format(" (the model's max_position_embeddings is {}; past it, RoPE scaling decides quality)",
                          mc->max_position_embeddings);
    std::printf("  longest train.seq_len that fits these budgets: %s\n", line.c_str());
    // With and without context parallelism: over parallel.context_parallel ranks when it is set,
    // else over the planned world's (each rank then holds 1/N of every sequence's activations).
    const int64_t N = tc->parallel_context > 1 ? tc->parallel_context : tc->plan_world_size;
    if (N > 1 && (tc->parallel_context > 1 || tc->parallel_expert <= 1) && tc->data_packing != "document") {
      TrainConfig other = one;
      other.parallel_context = tc->parallel_context > 1 ? 1 : N;
      other.plan_world_size = std::max(other.plan_world_size, N);
      const int64_t alt = longest_sequence(*mc, other, device);
      const int64_t with = other.parallel_context > 1 ? alt : longest, without = other.parallel_context > 1 ? longest : alt;
      std::printf("  at micro-batch 1: %s without context parallelism, %s with parallel.context_parallel=%lld%s\n",
                  without > 0 ? fmt::format("{} tokens", without).c_str() : "none",
                  with > 0 ? fmt::format("{} tokens", with).c_str() : "none", static_cast<long long>(N),
                  cuda ? " (ring attention runs on the CPU backend only so far)" : "");
    }
  }
  if (const uint64_t least = smallest_host_budget(*mc, *tc, device); least > 0)
    std::printf("  smallest memory.host that fits with these device and nvme budgets: %s%s\n",
                format_bytes(least).c_str(),
                tc->nvme_path.empty() ? " (with memory.nvme.* every kind of state can page to disk instead)" : "");
  if (plan.fits && cuda) {
    const double model_flops = model_flops_per_token(*mc, tc->seq_len) * static_cast<double>(in.tokens_per_step);
    std::printf("  predicted MFU %.1f%% of the H100/H200 dense bf16 peak (989 TFLOP/s; model FLOPs 6N + 12LHT, "
                "recomputation not counted)\n", 100 * model_flops / plan.step_s / 989e12);
  }
  std::printf("%s", format_recipe_comparison(*mc, *tc, device).c_str());
  std::printf("%s", format_method_comparison(*mc, *tc, device).c_str());
  // A plan for a machine not yet rented is still a plan: the check is said, not enforced here.
  if (!ram_fits.ok())
    std::printf("  not on this machine: %s (strata train refuses the run here)\n", ram_fits.message().c_str());
  return plan.fits ? 0 : 1;
}

}  // namespace strata::tools
