#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/log.h"
#include "model/hf_io.h"
#include "model/decoder.h"
#include "data/data.h"
#include "train/lr_schedule.h"
#include "train/metrics.h"
#include "train/optimizer.h"
#include "train/checkpointing.h"
#include "train/paged_engine.h"
#if STRATA_HAVE_CUDA
#include "core/cuda/cuda_device.h"
#endif

namespace strata {
namespace {

namespace fs = std::filesystem;

// Set by SIGINT/SIGTERM; the loop stops after the step in progress. A signal handler can only
// reach process-wide state, hence the one static.
volatile std::sig_atomic_t g_stop_requested = 0;
extern "C" void on_stop_signal(int) {
  if (g_stop_requested) std::_Exit(130);  // a second signal stops at once
  g_stop_requested = 1;
}

constexpr const char* kBuiltinLicenses = "builtin:licenses";

Result<nlohmann::json> read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("model config '" + path + "' cannot be opened; check model.config");
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::InvalidArgument(path + ": not valid JSON");
  return j;
}

}  // namespace

Result<model::ModelConfig> resolve_model_config(const TrainConfig& t) {
  nlohmann::json j;
  std::string source;
  if (!t.model_from.empty()) {
    source = (fs::path(t.model_from) / "config.json").string();
    ASSIGN_OR_RETURN(j, model::read_hf_config_json(t.model_from));
  } else if (!t.model_config.empty()) {
    source = t.model_config;
    if (fs::is_directory(source)) source = (fs::path(source) / "config.json").string();
    ASSIGN_OR_RETURN(j, read_json_file(source));
  } else {
    ASSIGN_OR_RETURN(model::ModelConfig preset, model::ModelConfig::preset(t.model_preset));
    j = preset.to_json();
    source = "preset '" + t.model_preset + "'";
  }
  bool architectures_set = false, model_type_set = false;
  for (const auto& kv : t.model_overrides) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0)
      return Status::InvalidArgument("model.set: '" + kv + "' is not key=value (e.g. num_hidden_layers=2)");
    std::string key = kv.substr(0, eq), text = kv.substr(eq + 1);
    nlohmann::json value = nlohmann::json::parse(text, nullptr, false);
    if (value.is_discarded()) value = text;
    // architectures=MixtralForCausalLM: one name is enough on a command line.
    if (key == "architectures" && value.is_string()) value = nlohmann::json::array({value});
    architectures_set |= key == "architectures";
    model_type_set |= key == "model_type";
    j[key] = value;
  }
  // model_type=mixtral alone switches the architecture too (the base's list would win).
  if (model_type_set && !architectures_set) j.erase("architectures");
  if (!t.model_overrides.empty()) source += " + model.set";
  return model::ModelConfig::from_json(j, source);
}

namespace {

Result<std::unique_ptr<TokenDataset>> open_training_data(const TrainConfig& t) {
  DataConfig dc;
  dc.format = t.data_format;
  for (const auto& p : t.data_paths) {
    if (p == kBuiltinLicenses) {
      ASSIGN_OR_RETURN(std::string corpus, build_default_corpus((fs::path(t.run_dir) / "licenses.txt").string()));
      dc.paths.push_back(corpus);
    } else {
      dc.paths.push_back(p);
    }
  }
  return open_dataset(dc);
}

// A run never lands on another run's directories: the old checkpoints would mix with the new
// run's (and retention could delete them), and the old metrics would be overwritten. A run dir
// is continued only through a checkpoint: --resume auto when ckpt.dir has `latest`, or
// --resume PATH (whose metrics are appended to).
Status check_run_dirs(const TrainConfig& t) {
  if (!t.resume.empty() && t.resume != "auto") return Status::OK();
  std::error_code ec;
  const fs::path ckpt(t.ckpt_dir);
  std::string latest;
  if (fs::exists(ckpt / "latest", ec)) {
    // Never echo what `latest` holds unless it is a step name (it may point anywhere).
    Result<std::string> named = ckpt::read_latest_file((ckpt / "latest").string());
    latest = named.ok() ? *named : "not a step name";
  }
  const std::string elsewhere = "choose another run.dir (or ckpt.dir), or remove it first";
  if (!latest.empty()) {
    if (t.resume == "auto") return Status::OK();
    return Status::InvalidArgument("ckpt.dir '" + t.ckpt_dir + "' already holds checkpoints of a run (latest: " + latest +
                                   "); pass --resume auto to continue that run, or " + elsewhere);
  }
  // Committed step-N directories without `latest`; step-N.tmp ones are unfinished saves that the
  // next save removes anyway.
  std::string step;
  if (fs::is_directory(ckpt, ec)) {
    for (const auto& e : fs::directory_iterator(ckpt, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("step-", 0) == 0 && !name.ends_with(".tmp")) step = name;
    }
  }
  if (!step.empty())
    return Status::InvalidArgument("ckpt.dir '" + t.ckpt_dir + "' holds checkpoints (e.g. " + step +
                                   ") but no 'latest'; continue from one with --resume " +
                                   (ckpt / step).string() + ", or " + elsewhere);
  const fs::path metrics = fs::path(t.run_dir) / "metrics.jsonl";
  if (fs::exists(metrics, ec))
    return Status::InvalidArgument("run.dir '" + t.run_dir + "' already holds a run's metrics (" + metrics.string() +
                                   ") and no checkpoint to continue it from; " + elsewhere);
  return Status::OK();
}

bool needs_run_dir_for_data(const TrainConfig& t) {
  for (const auto& p : t.data_paths)
    if (p == kBuiltinLicenses) return true;
  return false;
}

Result<std::unique_ptr<TrainEngine>> make_cuda_engine(const model::ModelConfig& mc, const TrainConfig& t,
                                                      const OptimizerConfig& oc) {
  if (!t.precision_auto && t.precision != Precision::kBf16)
    return Status::Unimplemented(fmt::format("the CUDA backend trains in the bf16 recipe; train.precision={} runs on "
                                             "the cpu (run.device=cpu)",
                                             precision_name(t.precision)));
  ASSIGN_OR_RETURN(std::unique_ptr<PagedEngine> paged, PagedEngine::create(mc, t, oc, /*cuda=*/true));
  return std::unique_ptr<TrainEngine>(std::move(paged));
}

#if STRATA_HAVE_CUDA
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

bool cuda_visible() {
#if STRATA_HAVE_CUDA
  return cuda_device_count() > 0;
#else
  return false;
#endif
}

}  // namespace

Result<std::unique_ptr<TrainEngine>> make_train_engine(const model::ModelConfig& mc, const TrainConfig& t,
                                                       const OptimizerConfig& oc) {
  if (t.device == "cuda" || (t.device == "auto" && cuda_visible())) {
    Result<std::unique_ptr<TrainEngine>> cuda = make_cuda_engine(mc, t, oc);
    if (cuda.ok()) return cuda;
    if (t.device == "cuda") return cuda.status().with_context("run.device=cuda");
    LOG_INFO("run.device=auto: not on the GPU ({}); training on the CPU", cuda.status().message());
  } else if (t.device == "auto" && kBuiltWithCuda) {
    LOG_INFO("run.device=auto: no CUDA device is visible; training on the CPU");
  }
  ASSIGN_OR_RETURN(std::unique_ptr<PagedEngine> paged, PagedEngine::create(mc, t, oc));
  return std::unique_ptr<TrainEngine>(std::move(paged));
}

Result<TrainSummary> run_training(const TrainConfig& t, const std::string& effective_yaml) {
  return run_training(t, effective_yaml, make_train_engine);
}

namespace {

// A run between its three phases: everything prepare() checked and opened, and where the loop is.
struct Run {
  model::ModelConfig mc;
  model::ParamLayout layout;
  std::unique_ptr<TokenDataset> dataset;
  std::optional<DataLoader> loader;
  std::unique_ptr<TrainEngine> engine;
  std::optional<LrSchedule> schedule;
  std::unique_ptr<TrainCheckpointer> checkpointer;
  std::optional<MetricsWriter> metrics;
  int64_t start_step = 1;
  int64_t tokens_seen = 0;
  int64_t last_saved_step = 0;
  int64_t skipped_in_a_row = 0;  // consecutive steps with a NaN/Inf loss or gradient norm
  TrainSummary summary;

  Status save_checkpoint(int64_t step, const TrainConfig& t) {
    RunPosition pos;
    pos.step = step;
    pos.tokens_seen = static_cast<uint64_t>(tokens_seen);
    pos.data_epoch = static_cast<int64_t>(loader->cursor().epoch);
    pos.data_index = static_cast<int64_t>(loader->cursor().index);
    pos.optimizer_step = engine->state().step_count();
    ASSIGN_OR_RETURN(bool started,
                     checkpointer->save(engine->state(), pos, mc.to_json(), t.seed, engine->extra_state()));
    if (started) last_saved_step = step;
    return Status::OK();
  }
};

// 1. Everything that can be wrong with the inputs is checked before anything is written; then
// the engine, the starting state (a checkpoint, weights or an init) and the run directory.
Result<std::unique_ptr<Run>> prepare(const TrainConfig& t, const std::string& effective_yaml,
                                     const EngineFactory& make_engine) {
  auto run = std::make_unique<Run>();
  ASSIGN_OR_RETURN(run->mc, resolve_model_config(t));
  const model::ModelConfig& mc = run->mc;
  const std::string model_source = !t.model_from.empty()     ? (fs::path(t.model_from) / "config.json").string()
                                   : !t.model_config.empty() ? t.model_config
                                                             : "preset '" + t.model_preset + "'";
  RETURN_IF_ERROR(mc.check_sequence_length(t.seq_len, model_source + " (train.seq_len)"));
  if (t.seq_len > mc.max_position_embeddings)
    LOG_WARN("train.seq_len {} exceeds the model's max_position_embeddings {}", t.seq_len,
             mc.max_position_embeddings);
  RETURN_IF_ERROR(check_run_dirs(t));
  std::error_code ec;
  if (needs_run_dir_for_data(t)) {
    fs::create_directories(t.run_dir, ec);
    if (ec) return Status::IOError("cannot create run.dir '" + t.run_dir + "': " + ec.message());
  }
  ASSIGN_OR_RETURN(run->dataset, open_training_data(t));
  if (run->dataset->vocab_hint() > mc.vocab_size)
    return Status::InvalidArgument("data.paths are read as bytes (256 token ids) but the model's vocab_size is " +
                                   std::to_string(mc.vocab_size) + "; use a model with vocab_size >= 256");
  DataLoaderOptions lo;
  lo.batch_size = t.micro_batch;
  lo.seq_len = t.seq_len;
  lo.seed = t.seed;
  lo.vocab_size = mc.vocab_size;
  ASSIGN_OR_RETURN(DataLoader loader, DataLoader::create(run->dataset.get(), lo));
  run->loader.emplace(std::move(loader));

  // The starting weights are read (or initialised) tensor by tensor straight into the engine's
  // state below, so a model is never held twice in memory. The checkpoint is checked
  // completely here, first.
  run->layout = model::ParamLayout(mc);
  const std::string weights_from = !t.model_from.empty() ? t.model_from : t.model_init;
  std::optional<model::SafetensorsReader> weights;
  if (!weights_from.empty()) {
    ASSIGN_OR_RETURN(model::SafetensorsReader reader, model::open_hf_weights(weights_from, run->layout));
    weights.emplace(std::move(reader));
  }
  if (!t.run_export.empty()) RETURN_IF_ERROR(model::check_export_target(t.run_export));
  OptimizerConfig oc;
  oc.lr = static_cast<float>(t.lr);
  oc.beta1 = static_cast<float>(t.beta1);
  oc.beta2 = static_cast<float>(t.beta2);
  oc.eps = static_cast<float>(t.eps);
  oc.weight_decay = static_cast<float>(t.weight_decay);
  oc.grad_clip = static_cast<float>(t.grad_clip);
  run->schedule.emplace(LrSchedule{t.lr, t.warmup_steps, t.steps, t.min_lr_ratio, t.lr_schedule});

  // Where the state lives and where the steps compute (run.device, memory.*).
  ASSIGN_OR_RETURN(run->engine, make_engine(mc, t, oc));
  SavableState& state = run->engine->state();

  // Resume: parameters, moments, data position and step from a checkpoint (any budgets).
  // Otherwise the starting weights, from model.from / model.init or initialised.
  std::string resume_from = t.resume;
  if (resume_from == "auto") {
    resume_from = fs::exists(fs::path(t.ckpt_dir) / "latest") ? t.ckpt_dir : "";
    if (resume_from.empty()) LOG_INFO("resume: no checkpoint in {}; starting from step 1", t.ckpt_dir);
  }
  if (resume_from.empty()) {
    RETURN_IF_ERROR(state.fill_kind(StateKind::kParam, [&](const model::TensorSpec& spec, float* dst) {
      if (weights) return weights->read_f32(spec.name, dst);
      model::init_tensor(spec, dst, t.seed);
      return Status::OK();
    }));
  }
  weights.reset();
  if (!resume_from.empty()) {
    std::vector<ExtraState> extra = run->engine->extra_state();
    ASSIGN_OR_RETURN(RunPosition pos, restore_checkpoint(resume_from, mc.to_json(), run->layout, state, &extra));
    run->engine->set_extra_state(extra);
    RETURN_IF_ERROR(
        run->loader->set_cursor({static_cast<uint64_t>(pos.data_epoch), static_cast<uint64_t>(pos.data_index)}));
    run->start_step = pos.step + 1;
    run->tokens_seen = static_cast<int64_t>(pos.tokens_seen);
    if (run->start_step > t.steps)
      LOG_WARN("the checkpoint is at step {}; train.steps is {}: nothing to do", pos.step, t.steps);
  }
  CheckpointOptions co;
  co.dir = t.ckpt_dir;
  co.keep_last = static_cast<int>(t.ckpt_keep_last);
  co.skip_if_busy = t.ckpt_skip_if_busy;
  co.staging_bytes = t.ckpt_staging;
  run->checkpointer = std::make_unique<TrainCheckpointer>(co, run->layout, state);
  run->last_saved_step = run->start_step - 1;

  // The run directory: the effective config, then metrics as steps complete.
  fs::create_directories(t.run_dir, ec);
  if (ec) return Status::IOError("cannot create run.dir '" + t.run_dir + "': " + ec.message());
  {
    std::ofstream out(fs::path(t.run_dir) / "config.yaml");
    out << effective_yaml;
    if (!out) return Status::IOError("cannot write " + (fs::path(t.run_dir) / "config.yaml").string());
  }
  ASSIGN_OR_RETURN(MetricsWriter metrics, MetricsWriter::open((fs::path(t.run_dir) / "metrics.jsonl").string(),
                                                               /*append=*/!resume_from.empty()));
  run->metrics.emplace(std::move(metrics));

  const int64_t tokens_per_step = t.micro_batch * t.seq_len * t.grad_accum;
  LOG_INFO("model: {} layers, hidden {}, {} heads ({} kv), vocab {}, {:.2f}M parameters", mc.num_hidden_layers,
           mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.vocab_size,
           static_cast<double>(mc.num_parameters()) / 1e6);
  LOG_INFO("data: {} tokens, {} windows of {}; {} tokens per step ({} x {} x {} accumulation)",
           run->dataset->num_tokens(), run->loader->num_windows(), t.seq_len, tokens_per_step, t.micro_batch,
           t.seq_len, t.grad_accum);
  LOG_INFO("memory: {}", run->engine->memory_summary());
  LOG_INFO("run: {} steps on {}, writing {}/metrics.jsonl", t.steps, run->engine->device_name(), t.run_dir);
  return run;
}

// A step skipped for a NaN/Inf loss or gradient norm: logged whatever run.log_every says; more
// than train.max_skipped_steps in a row stop the run.
Status note_skipped_step(Run& run, const TrainConfig& t, const StepMetrics& sm) {
  LOG_WARN("{}", format_step_line(sm));
  const std::string what = std::isfinite(sm.loss) ? "gradient norm" : "loss";
  if (run.skipped_in_a_row <= t.max_skipped_steps) {
    LOG_WARN("step {} skipped: the {} is not finite (NaN or Inf); nothing was updated ({} in a row; more than {} "
             "stop the run)",
             sm.step, what, run.skipped_in_a_row, t.max_skipped_steps);
    return Status::OK();
  }
  // Saves of a non-finite state are never committed: `latest` names the last finite one once
  // the save in flight has ended (a failure of it was logged by the writer).
  (void)run.checkpointer->wait();
  Result<std::string> latest = ckpt::read_latest_file((fs::path(t.ckpt_dir) / ckpt::kLatestFile).string());
  const std::string resume = latest.ok()
                                 ? fmt::format("the last finite checkpoint is {}/{}; resume from it", t.ckpt_dir, *latest)
                                 : std::string("no checkpoint of a finite state was committed; start again");
  return Status::InvalidArgument(fmt::format(
      "step {}: the {} has not been finite (NaN or Inf) for {} steps in a row, more than train.max_skipped_steps={}; "
      "the run has diverged and stops ({} with a lower optim.lr, a larger optim.eps or optim.grad_clip, or check the "
      "data)",
      sm.step, what, run.skipped_in_a_row, t.max_skipped_steps, resume));
}

// 2. The steps, until train.steps, a signal or the first error (returned).
Status loop(Run& run, const TrainConfig& t) {
  TrainEngine& engine = *run.engine;
  const int64_t micro_tokens = t.micro_batch * t.seq_len;
  const int64_t tokens_per_step = micro_tokens * t.grad_accum;
  std::vector<int32_t> inputs(static_cast<size_t>(micro_tokens * t.grad_accum));
  std::vector<int32_t> targets(inputs.size());
  const auto run_start = std::chrono::steady_clock::now();
  for (int64_t step = run.start_step; step <= t.steps; ++step) {
    if (g_stop_requested) {
      run.summary.interrupted = true;
      break;
    }
    auto t0 = std::chrono::steady_clock::now();
    const bool ckpt_in_flight = run.checkpointer->in_flight();
    for (int64_t m = 0; m < t.grad_accum; ++m)
      RETURN_IF_ERROR(run.loader->next(inputs.data() + m * micro_tokens, targets.data() + m * micro_tokens));
    const int64_t valid = model::count_valid_targets(targets.data(), static_cast<int64_t>(targets.size()));
    const float grad_scale = valid > 0 ? 1.0f / static_cast<float>(valid) : 0.0f;
    const EngineStats before = engine.stats();
    RETURN_IF_ERROR(engine.zero_grads());
    double loss_sum = 0;
    const double lr = run.schedule->lr(step);
    for (int64_t m = 0; m < t.grad_accum; ++m) {
      ASSIGN_OR_RETURN(double loss, engine.micro_batch(inputs.data() + m * micro_tokens,
                                                        targets.data() + m * micro_tokens, t.micro_batch, t.seq_len,
                                                        grad_scale, m == t.grad_accum - 1, static_cast<float>(lr)));
      loss_sum += loss;
    }
    // A NaN/Inf loss or gradient norm skips the step: nothing is updated (the engine checks
    // the norm before any group changes), the batch is consumed and the schedule moves on.
    double grad_norm = std::numeric_limits<double>::quiet_NaN();
    bool skipped = !std::isfinite(loss_sum);
    if (skipped && engine.updates_during_backward())
      return Status::InvalidArgument(fmt::format(
          "step {}: the loss is not finite (NaN or Inf) and optim.overlap_backward already updated parameters "
          "during backward, so the step cannot be skipped; the run stops without saving this state (resume from "
          "the last checkpoint with optim.overlap_backward=false to skip such steps, or lower optim.lr)",
          step));
    if (!skipped) {
      Result<double> stepped = engine.step(static_cast<float>(lr));
      if (!stepped.ok()) return stepped.status().with_context(fmt::format("step {}", step));
      grad_norm = *stepped;
      skipped = !std::isfinite(grad_norm);
    }
    run.skipped_in_a_row = skipped ? run.skipped_in_a_row + 1 : 0;
    run.summary.skipped_steps += skipped ? 1 : 0;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    run.tokens_seen += tokens_per_step;

    StepMetrics sm;
    sm.step = step;
    sm.total_steps = t.steps;
    sm.loss = valid > 0 ? loss_sum / static_cast<double>(valid) : 0.0;
    sm.lr = lr;
    sm.grad_norm = grad_norm;
    sm.ms = seconds * 1e3;
    sm.tokens_per_s = static_cast<double>(tokens_per_step) / seconds;
    sm.tokens = run.tokens_seen;
    const EngineStats after = engine.stats();
    for (int i = 0; i < kNumTiers; ++i) sm.tier_bytes[i] = after.tier_bytes[i];
    sm.stall_ms = static_cast<double>(after.stall_ns - before.stall_ns) / 1e6;
    sm.moved_bytes = after.moved_bytes - before.moved_bytes;
    sm.rss_bytes = resident_bytes();
    sm.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    sm.ckpt_in_flight = ckpt_in_flight;
    sm.skipped = skipped;
    sm.skipped_steps = run.summary.skipped_steps;
    sm.eta_s = sm.elapsed_s / static_cast<double>(step - run.start_step + 1) * static_cast<double>(t.steps - step);
    RETURN_IF_ERROR(run.metrics->write(sm));
    if (step == run.start_step) run.summary.first_loss = sm.loss;
    run.summary.last_loss = sm.loss;
    run.summary.steps_done = step;
    if (skipped) RETURN_IF_ERROR(note_skipped_step(run, t, sm));
    if (t.ckpt_every > 0 && step % t.ckpt_every == 0) RETURN_IF_ERROR(run.save_checkpoint(step, t));
    if (!skipped && (step % t.log_every == 0 || step == 1 || step == t.steps)) {
      LOG_INFO("{}", format_step_line(sm));
      if (std::string note = engine.step_note(); !note.empty()) LOG_INFO("{}", note);
    }
  }
  return Status::OK();
}

// 3. The final checkpoint (when stopped by a signal, or at the end of a run that saves
// periodically), waiting for the saves in flight, and the export.
Result<TrainSummary> finish(Run& run, const TrainConfig& t) {
  TrainSummary& summary = run.summary;
  const int64_t done_step = summary.steps_done > 0 ? summary.steps_done : run.start_step - 1;
  if ((summary.interrupted || t.ckpt_every > 0) && done_step > run.last_saved_step) {
    // The final save waits for one in flight instead of being skipped (ckpt.if_busy=skip).
    if (Status previous = run.checkpointer->wait(); !previous.ok()) LOG_WARN("checkpoint: {}", previous.message());
    RETURN_IF_ERROR(run.save_checkpoint(done_step, t));
  }
  if (Status saved = run.checkpointer->wait(); !saved.ok()) LOG_WARN("checkpoint: {}", saved.message());
  else if (run.last_saved_step >= run.start_step)
    LOG_INFO("checkpoint: step {} committed in {}", run.last_saved_step, t.ckpt_dir);
  if (summary.interrupted) LOG_WARN("interrupted: stopped after step {}", summary.steps_done);
  if (!t.run_export.empty()) {
    model::ExportOptions eo;
    eo.copy_tokenizer_from = t.model_from;
    SavableState& state = run.engine->state();
    // Tensor by tensor out of the engine's state: no second copy of the model.
    RETURN_IF_ERROR(model::export_hf(
        t.run_export, run.mc, run.layout,
        [&](const model::TensorSpec& spec, float* out) {
          return state.read_flat(StateKind::kParam, static_cast<uint64_t>(spec.offset) * sizeof(float),
                                 static_cast<uint64_t>(spec.numel) * sizeof(float), out);
        },
        eo));
    LOG_INFO("exported the weights after step {} to {} (Hugging Face format)", summary.steps_done, t.run_export);
  }
  LOG_INFO("done: {} steps, loss {:.4f} -> {:.4f}", summary.steps_done, summary.first_loss, summary.last_loss);
  return summary;
}

}  // namespace

Result<TrainSummary> run_training(const TrainConfig& t, const std::string& effective_yaml,
                                  const EngineFactory& make_engine) {
  ASSIGN_OR_RETURN(std::unique_ptr<Run> run, prepare(t, effective_yaml, make_engine));
  g_stop_requested = 0;
  auto old_int = std::signal(SIGINT, on_stop_signal);
  auto old_term = std::signal(SIGTERM, on_stop_signal);
  const Status stepped = loop(*run, t);
  std::signal(SIGINT, old_int);
  std::signal(SIGTERM, old_term);
  RETURN_IF_ERROR(stepped);
  return finish(*run, t);
}

}  // namespace strata
