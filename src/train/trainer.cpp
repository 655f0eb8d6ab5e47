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
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ckpt/finite.h"
#include "ckpt/format.h"
#include "core/checked_math.h"
#include "core/host_memory.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/trace.h"
#include "model/hf_io.h"
#include "model/peft_io.h"
#include "model/context_parallel.h"
#include "model/decoder.h"
#include "data/data.h"
#include "data/document_split.h"
#include "data/tokenizer.h"
#include "train/lr_schedule.h"
#include "train/metrics.h"
#include "train/optimizer.h"
#include "train/checkpointing.h"
#include "train/goodput.h"
#include "train/host_ram.h"
#include "train/paged_engine.h"
#include "train/planning.h"
#include "train/tensorboard.h"
#include "train/ranks.h"
#include "train/run_dirs.h"
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
    if (!model::ModelConfig::is_known_key(key)) {
      std::string keys;
      for (const std::string& k : model::ModelConfig::known_keys()) keys += (keys.empty() ? "" : ", ") + k;
      return Status::InvalidArgument("model.set: unknown model config key '" + key + "'; strata reads: " + keys);
    }
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
  ASSIGN_OR_RETURN(model::ModelConfig mc, model::ModelConfig::from_json(j, source));
  // The MTP loss weight is training's (train.mtp_weight), not the model's.
  mc.mtp_loss_weight = t.mtp_weight;
  if (t.lora) {
    mc.lora = t.lora_config;
    if (!t.model_adapter.empty()) {
      // The adapter's own rank, scale and modules.
      ASSIGN_OR_RETURN(const model::LoraConfig adapter, model::read_peft_adapter_config(t.model_adapter));
      if (adapter.rank != mc.lora.rank || adapter.alpha != mc.lora.alpha || adapter.targets != mc.lora.targets)
        LOG_INFO("model.adapter: rank {}, alpha {}, modules [{}] from {}", adapter.rank, adapter.alpha,
                 fmt::join(model::lora_target_names(adapter.targets), ", "), t.model_adapter);
      mc.lora.rank = adapter.rank;
      mc.lora.alpha = adapter.alpha;
      mc.lora.targets = adapter.targets;
    }
    RETURN_IF_ERROR(mc.validate(source + " with train.method=lora"));
  }
  if (mc.trains_mtp() && t.parallel_context > 1)
    return Status::InvalidArgument(fmt::format(
        "parallel.context_parallel={} with {}'s multi-token prediction module: its tokens one ahead cross the "
        "context group's chunks; set train.mtp_weight=0 (the module is then kept as loaded) or "
        "parallel.context_parallel=1",
        t.parallel_context, mc.architecture));
  if (mc.trains_mtp() && t.parallel_expert > 1)
    return Status::InvalidArgument(fmt::format(
        "parallel.expert_parallel={} with {}'s multi-token prediction module: its block's experts are not yet "
        "exchanged over the expert group; set train.mtp_weight=0 (the module is then kept as loaded) or "
        "parallel.expert_parallel=1",
        t.parallel_expert, mc.architecture));
  return mc;
}

namespace {

// The token files of `paths` (data.paths or data.eval_paths), read as data.format says; `what`
// names them in the log ("data", "eval data"). build_corpus: false on the ranks after the first,
// which read the corpus rank 0 built.
Result<std::unique_ptr<TokenDataset>> open_token_data(const TrainConfig& t, const std::vector<std::string>& paths,
                                                      const std::string& what, bool build_corpus = true) {
  DataConfig dc;
  dc.format = t.data_format;
  dc.what = what;
  for (const auto& p : paths) {
    if (p == kBuiltinLicenses) {
      const std::string path = (fs::path(t.run_dir) / "licenses.txt").string();
      if (!build_corpus) {
        dc.paths.push_back(path);
        continue;
      }
      ASSIGN_OR_RETURN(std::string corpus, build_default_corpus(path));
      dc.paths.push_back(corpus);
    } else {
      dc.paths.push_back(p);
    }
  }
  return open_dataset(dc);
}

bool needs_run_dir_for_data(const TrainConfig& t) {
  for (const auto& p : t.data_paths)
    if (p == kBuiltinLicenses) return true;
  for (const auto& p : t.data_eval_paths)
    if (p == kBuiltinLicenses) return true;
  return false;
}

#if STRATA_HAVE_CUDA
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

Result<std::unique_ptr<PagedEngine>> make_cuda_engine(const model::ModelConfig& mc, const TrainConfig& t,
                                                      const OptimizerConfig& oc) {
  if (!t.precision_auto && t.precision == Precision::kFp32)
    return Status::Unimplemented(
        "the CUDA backend trains in the bf16 and fp8 recipes; train.precision=fp32 runs on the cpu (run.device=cpu)");
  return PagedEngine::create(mc, t, oc, DeviceKind::kCuda);
}

// The engine for run.device: cuda (the CUDA model with the state on the GPU t.cuda_device), cpu
// (the CPU model over the paged state), or auto (cuda when this build has it, a GPU is visible
// and the model runs and fits there, logging why not otherwise; then cpu).
Result<std::unique_ptr<PagedEngine>> make_train_engine(const model::ModelConfig& mc, const TrainConfig& t,
                                                       const OptimizerConfig& oc) {
  if (t.device == "cuda" || (t.device == "auto" && cuda_device_visible())) {
    Result<std::unique_ptr<PagedEngine>> cuda = make_cuda_engine(mc, t, oc);
    if (cuda.ok()) return cuda;
    if (t.device == "cuda") return cuda.status().with_context("run.device=cuda");
    LOG_INFO("run.device=auto: not on the GPU ({}); training on the CPU", cuda.status().message());
  } else if (t.device == "auto" && kBuiltWithCuda) {
    LOG_INFO("run.device=auto: no CUDA device is visible; training on the CPU");
  }
  return PagedEngine::create(mc, t, oc, DeviceKind::kCpu);
}

// A run between its three phases: everything prepare() checked and opened, and where the loop is.
struct Run {
  model::ModelConfig mc;
  model::ParamLayout layout;
  // The precision of the weights the run started from: run.export_dtype=auto exports in it, and
  // checkpoints record it as their model_config's torch_dtype so a resumed run still knows it.
  model::SafetensorsWriteDtype source_dtype = model::SafetensorsWriteDtype::kF32;
  // Where the frozen tensors come from (checkpoints hold the trained state only): the source and
  // a fingerprint of its tensors' names, dtypes and shapes, or the seed of a random init; null
  // when nothing is frozen.
  nlohmann::json frozen_from;
  // The model config checkpoints record: the model's, with the LoRA settings and where the frozen
  // tensors come from, which a resumed run must match.
  nlohmann::json checkpoint_model_config() const {
    nlohmann::json j = mc.to_json();
    if (mc.lora.enabled()) j["strata_lora"] = mc.lora.to_json();
    // Whether the MTP modules train decides what is frozen (and saved); their weight may change.
    if (mc.num_nextn_predict_layers > 0) j["strata_trains_mtp"] = mc.trains_mtp();
    if (!frozen_from.is_null()) j["strata_frozen_from"] = frozen_from;
    return j;
  }
  // DeepSeek-V3's routers' selection biases read with the starting weights (empty otherwise).
  std::vector<float> start_selection_bias;
  std::unique_ptr<TokenDataset> dataset;
  std::optional<DataLoader> loader;
  // data.eval_paths, when set: the held-out data, its loader (restarted for each evaluation) and
  // the micro-batches one evaluation takes over all ranks (train.eval_steps, at most all it holds).
  std::unique_ptr<TokenDataset> eval_dataset;
  std::optional<DataLoader> eval_loader;
  int64_t eval_batches = 0;
  // The lowest eval loss a checkpoint was saved for (ckpt.keep_best); +inf before the first.
  double best_eval = std::numeric_limits<double>::infinity();
  std::unique_ptr<PagedEngine> engine;
  std::optional<LrSchedule> schedule;
  std::unique_ptr<TrainCheckpointer> checkpointer;
  std::optional<MetricsWriter> metrics;
  std::optional<TensorBoardWriter> tensorboard;  // RUN_DIR/tensorboard, beside metrics.jsonl
  int64_t last_logged_step = 0;
  int64_t start_step = 1;
  int64_t tokens_seen = 0;
  int64_t last_saved_step = 0;
  // The last step whose state is whole: parameters, moments, data cursor and token count all
  // after it. False while a step is changing the state (an error then leaves it unsound).
  bool sound = true;
  int64_t sound_step = 0;
  DataCursor sound_cursor;
  int64_t skipped_in_a_row = 0;  // consecutive steps with a NaN/Inf loss or gradient norm
  TrainSummary summary;
  RunObserver* observer = nullptr;
  // The processes of a data-parallel run (one in a plain run); owned by run_training.
  Ranks* ranks = nullptr;
  // Where the run's wall time goes (goodput.h); owned by run_training, which outlives the Run.
  GoodputAccountant* goodput = nullptr;
  // The highest step a previous run recorded in this run.dir's metrics: steps up to it are done
  // a second time (0 when this run continues no earlier one).
  int64_t redo_until = 0;
  uint64_t host_ram_peak = 0;  // the planned peak of host memory (host_ram.h), 0 when not planned

  void mark_sound(int64_t step) {
    sound = true;
    sound_step = step;
    sound_cursor = loader->cursor();
  }

  // Starts a save of the state after the last sound step; with `best_eval_loss`, as the run's
  // best (ckpt.keep_best), which it then is once the save has started.
  Status save_checkpoint(const TrainConfig& t, std::optional<double> best_eval_loss = {}) {
    CHECK(sound);
    GoodputAccountant::Timer blocked = goodput->time(GoodputPart::kCheckpoint);  // waits for the previous save
    RunPosition pos;
    pos.step = sound_step;
    pos.tokens_seen = static_cast<uint64_t>(tokens_seen);
    pos.data_epoch = static_cast<int64_t>(sound_cursor.epoch);
    pos.data_index = static_cast<int64_t>(sound_cursor.index);
    pos.optimizer_step = engine->state().step_count();
    nlohmann::json model_config = checkpoint_model_config();
    model_config["torch_dtype"] = model::torch_dtype_name(source_dtype);
    const std::string best_note = best_eval_loss ? fmt::format("eval_loss {:.17g}", *best_eval_loss) : "";
    ASSIGN_OR_RETURN(bool started, checkpointer->save(engine->state(), pos, model_config, t.seed,
                                                      engine->extra_state(), best_note));
    if (started) last_saved_step = sound_step;
    if (started && best_eval_loss) best_eval = *best_eval_loss;
    return Status::OK();
  }

  // Waits for the save in flight. It can take a while after the last step: a progress line shows
  // how far it is (plain lines even on a terminal, as the writer logs its own line at commit).
  Status wait_for_save() {
    std::optional<GoodputAccountant::Timer> blocked;
    if (checkpointer->in_flight()) blocked.emplace(*goodput, GoodputPart::kCheckpoint);
    const uint64_t total = checkpointer->save_progress().second;
    Progress progress(fmt::format("saving checkpoint step {}", last_saved_step), total,
                      ProgressOptions{.enabled = checkpointer->in_flight(), .tty = false});
    while (checkpointer->in_flight()) {
      progress.set(checkpointer->save_progress().first);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    Status saved = checkpointer->wait();
    if (saved.ok()) progress.set(total);
    return saved;
  }

  // The final save: the state after the last sound step, committed before this returns. The
  // outcome of an earlier save in flight is only a warning when this one lands.
  Status save_final(const TrainConfig& t) {
    if (Status previous = wait_for_save(); !previous.ok()) {
      LOG_WARN("checkpoint: {}", previous.message());
      last_saved_step = std::min(last_saved_step, sound_step - 1);  // it did not land: save again
    }
    if (sound_step > last_saved_step) {
      Status started = save_checkpoint(t);
      Status committed = wait_for_save();
      if (started.ok()) started = committed;
      if (!started.ok())
        return started.with_context(fmt::format("the final checkpoint (step {}) was not written to ckpt.dir '{}'",
                                                sound_step, t.ckpt_dir));
    }
    if (last_saved_step >= start_step) LOG_INFO("checkpoint: step {} committed in {}", last_saved_step, t.ckpt_dir);
    return Status::OK();
  }
};

// prepare()'s first step: the model's config, checked against the run's sequence length.
Status resolve_run_model(const TrainConfig& t, Run& run) {
  ASSIGN_OR_RETURN(run.mc, resolve_model_config(t));
  const std::string model_source = !t.model_from.empty()     ? (fs::path(t.model_from) / "config.json").string()
                                   : !t.model_config.empty() ? t.model_config
                                                             : "preset '" + t.model_preset + "'";
  RETURN_IF_ERROR(run.mc.check_sequence_length(t.seq_len, model_source + " (train.seq_len)"));
  if (t.seq_len > run.mc.max_position_embeddings && run.mc.rope.scaling == kernels::RopeScaling::kDynamic)
    LOG_INFO("train.seq_len {} exceeds the model's max_position_embeddings {}: dynamic RoPE scaling (factor {}) "
             "rescales the frequencies for it", t.seq_len, run.mc.max_position_embeddings, run.mc.rope.factor);
  else if (t.seq_len > run.mc.max_position_embeddings)
    LOG_WARN("train.seq_len {} exceeds the model's max_position_embeddings {}", t.seq_len,
             run.mc.max_position_embeddings);
  return Status::OK();
}

// The token that ends a document, for `what` (data.packing: document, data.eval_fraction):
// data.eos_id, else the eos_token of model.from's tokenizer (the one `strata data tokenize`
// writes after every document).
Result<int64_t> document_eos_id(const TrainConfig& t, const std::string& what) {
  if (t.data_eos_id >= 0) return t.data_eos_id;
  const std::string how = "set data.eos_id to the token id that ends each document (the tokenizer's eos_token)";
  if (t.model_from.empty() || !fs::exists(fs::path(t.model_from) / "tokenizer.json"))
    return Status::InvalidArgument(what + " needs data.eos_id, and model.from names no tokenizer.json to take it "
                                   "from; " + how);
  Result<model::Tokenizer> tok = model::Tokenizer::load(t.model_from);
  if (!tok.ok()) return tok.status().with_context(what + " reads the EOS of model.from's tokenizer");
  if (tok->eos_id() < 0)
    return Status::InvalidArgument(what + ": the tokenizer of " + t.model_from + " has no eos_token; " + how);
  LOG_INFO("data: documents end at token {} (the eos_token of {}'s tokenizer)", tok->eos_id(), t.model_from);
  return static_cast<int64_t>(tok->eos_id());
}

// data.eval_fraction: the documents of data.paths split into the ones training reads (run.dataset)
// and the held-out ones evaluations read (run.eval_dataset).
Status hold_out_documents(const TrainConfig& t, Run& run) {
  ASSIGN_OR_RETURN(int64_t eos, document_eos_id(t, "data.eval_fraction"));
  std::shared_ptr<const TokenDataset> all(std::move(run.dataset));
  ASSIGN_OR_RETURN(DocumentSplit split, split_documents(all, eos, t.data_eval_fraction));
  LOG_INFO("data: {} of {} documents ({} of {} tokens) held out for evaluation (data.eval_fraction {})",
           split.held_out_documents, split.documents, split.held_out->num_tokens(), all->num_tokens(),
           t.data_eval_fraction);
  run.dataset = std::move(split.train);
  run.eval_dataset = std::move(split.held_out);
  return Status::OK();
}

// The run's folders, locked: t names them from here on (a version folder, a relative nvme).
// Rank 0 owns them and tells the other ranks where they are (after building the default
// corpus, which they read). Then the training data and its loader.
Status open_dirs_and_data(TrainConfig& t, Run& run, std::optional<RunDirs>* dirs, Ranks& ranks) {
  std::error_code ec;
  Status opened_dirs = Status::OK();
  if (ranks.writes()) {
    opened_dirs = [&]() -> Status {
      ASSIGN_OR_RETURN(RunDirs opened, RunDirs::open(t));
      dirs->emplace(std::move(opened));
      if (needs_run_dir_for_data(t)) {
        fs::create_directories(t.run_dir, ec);
        if (ec) return Status::IOError("cannot create run.dir '" + t.run_dir + "': " + ec.message());
      }
      ASSIGN_OR_RETURN(run.dataset, open_token_data(t, t.data_paths, "data"));
      if (!t.data_eval_paths.empty()) {
        ASSIGN_OR_RETURN(run.eval_dataset, open_token_data(t, t.data_eval_paths, "eval data"));
      }
      return Status::OK();
    }();
  }
  // A sharded save's ranks all write into step-N.tmp and none removes it: what a crashed run
  // left is cleared before any rank saves (rank 0 does it before telling the others to go on).
  if (ranks.several() && ranks.writes() && opened_dirs.ok() && fs::is_directory(t.ckpt_dir))
    opened_dirs = ckpt::remove_stale_tmp_dirs(t.ckpt_dir);
  if (ranks.several()) {
    RETURN_IF_ERROR(share_run_dirs(*ranks.comm, opened_dirs, t));
    // Each rank pages through a folder of its own.
    if (!t.nvme_path.empty()) t.nvme_path = (fs::path(t.nvme_path) / fmt::format("rank-{}", ranks.rank())).string();
  }
  RETURN_IF_ERROR(opened_dirs);
  if (!ranks.writes()) {
    ASSIGN_OR_RETURN(run.dataset, open_token_data(t, t.data_paths, "data", /*build_corpus=*/false));
    if (!t.data_eval_paths.empty()) {
      ASSIGN_OR_RETURN(run.eval_dataset, open_token_data(t, t.data_eval_paths, "eval data", /*build_corpus=*/false));
    }
  }
  if (run.dataset->vocab_hint() > run.mc.vocab_size)
    return Status::InvalidArgument("data.paths are read as bytes (256 token ids) but the model's vocab_size is " +
                                   std::to_string(run.mc.vocab_size) + "; use a model with vocab_size >= 256");
  if (t.data_eval_fraction > 0) RETURN_IF_ERROR(hold_out_documents(t, run));
  DataLoaderOptions lo;
  lo.batch_size = t.micro_batch;
  lo.seq_len = t.seq_len;
  lo.seed = t.seed;
  lo.vocab_size = run.mc.vocab_size;
  ASSIGN_OR_RETURN(lo.packing, parse_packing(t.data_packing));
  if (lo.packing == Packing::kDocument) {
    ASSIGN_OR_RETURN(lo.eos_id, document_eos_id(t, "data.packing: document"));
  }
  ASSIGN_OR_RETURN(DataLoader loader, DataLoader::create(run.dataset.get(), lo));
  run.loader.emplace(std::move(loader));
  if (run.eval_dataset) {
    // What the eval data is, in the messages: the files named, or the documents held out.
    const bool held_out = t.data_eval_fraction > 0;
    const std::string eval_data = held_out ? "the documents data.eval_fraction holds out" : "data.eval_paths";
    if (run.eval_dataset->vocab_hint() > run.mc.vocab_size)
      return Status::InvalidArgument(eval_data + " are read as bytes (256 token ids) but the model's vocab_size is " +
                                     std::to_string(run.mc.vocab_size) + "; use a model with vocab_size >= 256");
    // Every rank reads the same windows from the start each time and evaluates its share.
    Result<DataLoader> eval = DataLoader::create(run.eval_dataset.get(), lo);
    if (!eval.ok()) return eval.status().with_context(eval_data);
    run.eval_batches = std::min(t.eval_steps, eval->batches_per_epoch());
    if (run.eval_batches == 0)
      return Status::InvalidArgument(fmt::format(
          "{} hold {} tokens, fewer than one evaluation micro-batch needs ({} windows of {} tokens); {} or lower "
          "train.micro_batch or train.seq_len",
          eval_data, run.eval_dataset->num_tokens(), t.micro_batch, t.seq_len + 1,
          held_out ? "raise data.eval_fraction" : "name more eval data"));
    run.eval_loader.emplace(std::move(*eval));
    // The windows are the same at every evaluation: data with nothing to predict in them is
    // refused now, not after the training steps.
    std::vector<int32_t> inputs(static_cast<size_t>(t.micro_batch * t.seq_len)), targets(inputs.size()),
        positions(inputs.size());
    int64_t valid = 0;
    for (int64_t m = 0; m < run.eval_batches; ++m) {
      RETURN_IF_ERROR(run.eval_loader->next(inputs.data(), targets.data(), positions.data()));
      valid += model::count_valid_targets(targets.data(), static_cast<int64_t>(targets.size()));
    }
    if (valid == 0)
      return Status::InvalidArgument(fmt::format(
          "the loss masks of {} leave no token to predict in the {} micro-batches an evaluation takes; check the "
          "masks beside the {} token files, or raise train.eval_steps",
          eval_data, run.eval_batches, held_out ? "training" : "eval"));
  }
  return Status::OK();
}

// The starting weights of model.from / model.init, checked completely (every tensor the layout
// needs, in its shape) but not read: they are read tensor by tensor straight into the engine's
// state, so a model is never held twice in memory. Empty when the run initialises its weights.
Result<std::optional<model::SafetensorsReader>> open_starting_weights(const TrainConfig& t, Run& run) {
  run.layout = model::ParamLayout(run.mc);
  const std::string weights_from = !t.model_from.empty() ? t.model_from : t.model_init;
  std::optional<model::SafetensorsReader> weights;
  const bool any_frozen =
      std::any_of(run.layout.tensors().begin(), run.layout.tensors().end(), [](const auto& s) { return s.frozen; });
  if (any_frozen && weights_from.empty()) run.frozen_from = {{"init_seed", t.seed}};
  if (weights_from.empty()) return weights;
  ASSIGN_OR_RETURN(model::SafetensorsReader reader, model::open_hf_weights(weights_from, run.layout));
  nlohmann::json source_json = nlohmann::json::object();
  if (model::is_hf_directory(weights_from)) {
    ASSIGN_OR_RETURN(source_json, model::read_hf_config_json(weights_from));
  }
  run.source_dtype = model::hf_source_dtype(reader, run.layout, source_json);
  if (any_frozen) {
    run.frozen_from = {{"source", fs::absolute(weights_from).lexically_normal().string()},
                       {"tensors_xxh3", model::frozen_tensors_fingerprint(reader, run.layout)}};
  }
  RETURN_IF_ERROR(model::read_hf_selection_bias(reader, run.mc, &run.start_selection_bias));
  weights.emplace(std::move(reader));
  return weights;
}

OptimizerConfig optimizer_config(const TrainConfig& t) {
  OptimizerConfig oc;
  oc.lr = static_cast<float>(t.lr);
  oc.beta1 = static_cast<float>(t.beta1);
  oc.beta2 = static_cast<float>(t.beta2);
  oc.eps = static_cast<float>(t.eps);
  oc.weight_decay = static_cast<float>(t.weight_decay);
  oc.grad_clip = static_cast<float>(t.grad_clip);
  return oc;
}

// Where the state lives and where the steps compute (run.device, memory.*); then every byte of
// host memory the run will hold, refused now when the machine does not have it (the engine's
// host tier alone was checked before it was reserved), before any weights load.
Result<HostRamPlan> open_engine(const TrainConfig& t, Run& run, Ranks& ranks) {
  ASSIGN_OR_RETURN(run.engine, make_train_engine(run.mc, t, optimizer_config(t)));
  RETURN_IF_ERROR(run.engine->set_comm(ranks.comm.get(), ranks.grad_comm.get(), ranks.expert_comm.get(),
                                       ranks.expert_holders.get(), ranks.grad_expert_holders.get()));
  RETURN_IF_ERROR(run.engine->set_context_comm(ranks.context_comm.get()));
  HostRamData data = host_ram_data(*run.dataset, run.loader->num_windows());
  if (run.eval_dataset) data += host_ram_data(*run.eval_dataset, run.eval_loader->num_windows());
  const HostRamPlan host_ram = run.engine->host_ram(data);
  if (!host_ram.items.empty()) {
    // On cuda the host tier is page-locked (cudaHostAlloc: every page committed) as the engine
    // reserves it, so it is gone from the machine's available memory but in the plan: count it
    // back once. On the cpu its pages are committed as they are used (and locked only where
    // io_uring registers them), so what is available still includes them.
    HostMemory machine = available_host_memory();
    if (run.engine->backend() == DeviceKind::kCuda) machine.available += host_ram.pinned_tier();
    RETURN_IF_ERROR(check_host_ram(host_ram, machine));
    run.host_ram_peak = host_ram.peak();
  }
  return host_ram;
}

// The starting weights from model.from / model.init (`weights`), or initialised from train.seed.
Status fill_starting_weights(const TrainConfig& t, Run& run, std::optional<model::SafetensorsReader>& weights,
                             TensorSet which = TensorSet::kAll) {
  const std::string weights_from = !t.model_from.empty() ? t.model_from : t.model_init;
  if (!run.start_selection_bias.empty() && which == TensorSet::kAll)
    run.engine->set_selection_bias(run.start_selection_bias);
  // LoRA adapters: from model.adapter, else lora.init.
  std::optional<model::SafetensorsReader> adapter;
  if (!t.model_adapter.empty() && which != TensorSet::kFrozen) {
    ASSIGN_OR_RETURN(model::SafetensorsReader reader, model::open_peft_adapter(t.model_adapter, run.layout));
    adapter.emplace(std::move(reader));
  }
  uint64_t bytes = 0;
  for (const model::TensorSpec& spec : run.layout.tensors())
    if (in_set(which, spec)) bytes += static_cast<uint64_t>(spec.numel) * sizeof(float);
  Progress progress(weights ? "loading weights from " + weights_from : "initialising weights", bytes);
  RETURN_IF_ERROR(run.engine->state().fill_kind(StateKind::kParam, [&](const model::TensorSpec& spec, float* dst) {
    if (spec.adapts >= 0 && adapter) {
      RETURN_IF_ERROR(adapter->read_f32(model::peft_tensor_name(spec.name), spec.shape, dst));
    } else if (weights && spec.adapts < 0) {
      RETURN_IF_ERROR(model::read_hf_tensor(*weights, spec, dst));
    } else {
      model::init_tensor(spec, dst, t.seed);
    }
    progress.add(static_cast<uint64_t>(spec.numel) * sizeof(float));
    return Status::OK();
  }, which));
  if (which == TensorSet::kTrained) return Status::OK();
  // An FP8 checkpoint's weights (DeepSeek-V3's, with 128 x 128 block scales): the master holds
  // them dequantised; the fp8 recipe computes with the checkpoint's own codes and scales.
  if (!weights) return Status::OK();
  bool block_scaled = false;
  for (const model::TensorSpec& spec : run.layout.tensors())
    block_scaled = block_scaled || weights->find(model::block_scale_name(spec.name)) != nullptr;
  if (!block_scaled) return Status::OK();
  return run.engine->load_quantized_copies([&](const model::TensorSpec& spec, uint8_t* copy) -> Result<bool> {
    if (!in_set(which, spec)) return false;  // (a resume's trained copies come from the checkpoint)
    return model::read_hf_fp8_copy(*weights, spec, copy);
  });
}

// Resume: parameters, moments, data position and step from the checkpoint in `resume_from`
// (saved under any budgets).
Status restore_run(const TrainConfig& t, Run& run, const std::string& resume_from) {
  std::vector<ExtraState> extra = run.engine->extra_state();
  ASSIGN_OR_RETURN(RunPosition pos,
                   restore_checkpoint(resume_from, run.checkpoint_model_config(), run.layout, run.engine->state(), &extra));
  run.engine->set_extra_state(extra);
  RETURN_IF_ERROR(
      run.loader->set_cursor({static_cast<uint64_t>(pos.data_epoch), static_cast<uint64_t>(pos.data_index)}));
  if (t.model_from.empty() && t.model_init.empty()) {
    run.source_dtype = model::parse_torch_dtype(pos.source_torch_dtype).value_or(model::SafetensorsWriteDtype::kF32);
  }
  const std::optional<int64_t> next_step = checked_add(pos.step, int64_t{1});
  if (!next_step)
    return Status::InvalidArgument("checkpoint " + resume_from + " is at step " + std::to_string(pos.step) +
                                   ", too large to continue from");
  run.start_step = *next_step;
  run.tokens_seen = static_cast<int64_t>(pos.tokens_seen);
  // The tensors are logical (decoded moments), so another moment format converts on load:
  // exactly into a wider one, rounded once into a narrower one.
  const std::string run_moments = kernels::moment_format_name(t.moments);
  if (pos.recipe.contains("moments") && pos.recipe["moments"].is_string() && pos.recipe["moments"] != run_moments) {
    const std::string saved = pos.recipe["moments"].get<std::string>();
    const auto saved_format = kernels::parse_moment_format(saved);
    const bool narrower = saved_format && kernels::moment_bytes(t.moments, kernels::kMomentBlock) <
                                              kernels::moment_bytes(*saved_format, kernels::kMomentBlock);
    LOG_WARN("the checkpoint's Adam moments were stored as {}; this run stores them as {} (optim.moments), "
             "converted on load{}",
             saved, run_moments, narrower ? ": rounded once, so the run is not bitwise the uninterrupted one" : "");
  }
  if (run.start_step > t.steps)
    LOG_WARN("the checkpoint is at step {}; train.steps is {}: nothing to do", pos.step, t.steps);
  return Status::OK();
}

// The checkpoint writer of ckpt.*; with several ranks each writes the parameter groups it owns
// and rank 0 commits them under one manifest.
void open_checkpointer(const TrainConfig& t, Run& run, Ranks& ranks) {
  CheckpointOptions co;
  co.dir = t.ckpt_dir;
  co.keep_last = static_cast<int>(t.ckpt_keep_last);
  co.skip_if_busy = t.ckpt_skip_if_busy;
  co.staging_bytes = t.ckpt_staging;
  if (ranks.several()) {
    co.shard.rank = ranks.rank();
    co.shard.world = ranks.world();
    co.expert_groups = t.parallel_expert;
    parallel::Comm* ckpt_comm = ranks.ckpt_comm.get();
    co.shard.exchange = [ckpt_comm](const Status& own, const std::map<std::string, ckpt::FileRecord>& files) {
      return exchange_shard_files(*ckpt_comm, own, files);
    };
    // Ranks must save the same steps: none may skip a save another makes.
    if (co.skip_if_busy) LOG_INFO("ckpt.skip_if_busy is off with several ranks: every rank saves every checkpoint");
    co.skip_if_busy = false;
  }
  co.recipe = {{"recipe", run.engine->recipe()},
               {"moments", kernels::moment_format_name(t.moments)},
               {"moments_rounding", t.stochastic_rounding ? "stochastic" : "nearest"}};
  run.checkpointer = std::make_unique<TrainCheckpointer>(co, run.layout, run.engine->state());
  run.last_saved_step = run.start_step - 1;
  run.mark_sound(run.start_step - 1);
}

// A step's scalars for TensorBoard. MFU is the model FLOP/s against hardware.gpu_tflops, the
// compute rate the plan predicts with (this machine's when its profile was measured).
std::vector<std::pair<std::string, double>> tensorboard_scalars(const StepMetrics& m, const TrainConfig& t) {
  std::vector<std::pair<std::string, double>> s = {
      {"train/loss", m.loss},
      {"train/lr", m.lr},
      {"train/grad_norm", m.grad_norm},
      {"perf/tokens_per_s", m.tokens_per_s},
      {"perf/model_tflops", m.model_tflops},
      {"perf/mfu", t.gpu_flops > 0 ? m.model_tflops * 1e12 / t.gpu_flops : 0.0},
      {"perf/step_ms", m.ms},
      {"memory/device_bytes", static_cast<double>(m.tier_bytes[0])},
      {"memory/host_bytes", static_cast<double>(m.tier_bytes[1])},
      {"memory/nvme_bytes", static_cast<double>(m.tier_bytes[2])},
      {"memory/rss_bytes", static_cast<double>(m.rss_bytes)},
      {"paging/moved_bytes", static_cast<double>(m.moved_bytes)},
      {"paging/stall_ms", m.stall_ms},
      {"train/skipped_steps", static_cast<double>(m.skipped_steps)},
  };
  if (m.world > 1) s.emplace_back("comm/bytes_per_rank", m.comm_bytes);
  if (m.evaluated) {
    s.emplace_back("eval/loss", m.eval_loss);
    s.emplace_back("eval/ppl", std::exp(m.eval_loss));
  }
  return s;
}

// The run directory (rank 0's): the effective config, the metrics file (continued when
// resuming), and the lines that say what the run is about to do.
Status open_run_dir(const TrainConfig& t, Run& run, const std::string& effective_yaml, bool resuming,
                    const HostRamPlan& host_ram, const Ranks& ranks) {
  std::error_code ec;
  fs::create_directories(t.run_dir, ec);
  if (ec) return Status::IOError("cannot create run.dir '" + t.run_dir + "': " + ec.message());
  {
    std::ofstream out(fs::path(t.run_dir) / "config.yaml");
    out << effective_yaml;
    if (!out) return Status::IOError("cannot write " + (fs::path(t.run_dir) / "config.yaml").string());
  }
  const fs::path metrics_path = fs::path(t.run_dir) / "metrics.jsonl";
  ASSIGN_OR_RETURN(MetricsWriter metrics, MetricsWriter::open(metrics_path.string(), /*append=*/resuming));
  run.metrics.emplace(std::move(metrics));
  ASSIGN_OR_RETURN(TensorBoardWriter tensorboard,
                   TensorBoardWriter::open((fs::path(t.run_dir) / "tensorboard").string(), run.start_step));
  run.tensorboard.emplace(std::move(tensorboard));

  const model::ModelConfig& mc = run.mc;
  const int64_t tokens_per_step = t.micro_batch * t.seq_len * t.grad_accum * ranks.world() / t.parallel_context;
  LOG_INFO("model: {} layers, hidden {}, {} heads ({} kv), vocab {}, {:.2f}M parameters", mc.num_hidden_layers,
           mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.vocab_size,
           static_cast<double>(mc.num_parameters()) / 1e6);
  if (mc.lora.enabled()) {
    int64_t trained = 0, adapted = 0, mlp = 0;
    for (const model::TensorSpec& s : run.layout.tensors()) {
      trained += s.adapts >= 0 ? s.numel : 0;
      adapted += s.adapts >= 0 && s.name.ends_with("lora_A.weight") ? 1 : 0;
      const bool dense_mlp = s.adapts >= 0 && model::param_expert_of(run.layout, s) < 0 &&
                             (s.name.find(".mlp.") != std::string::npos);
      mlp += dense_mlp && s.name.ends_with("lora_A.weight") ? 1 : 0;
    }
    if (mc.is_moe() && mlp == 0 && mc.lora.targets_any(model::kLoraGate | model::kLoraUp | model::kLoraDown))
      LOG_WARN("lora.targets names gate_proj/up_proj/down_proj, which in a mixture-of-experts layer are its shared "
               "expert's, and this model has neither a shared expert nor dense MLPs; add `experts` to lora.targets "
               "to adapt the routed experts' projections");
    LOG_INFO("lora: rank {}, alpha {} (scale {:.4g}), dropout {}, on {} projections [{}]: {:.3f}M trained parameters "
             "({:.3f}% of the model's), the rest frozen",
             mc.lora.rank, mc.lora.alpha, mc.lora.scale(), mc.lora.dropout, adapted,
             fmt::join(model::lora_target_names(mc.lora.targets), ", "), static_cast<double>(trained) / 1e6,
             100.0 * static_cast<double>(trained) / static_cast<double>(mc.num_parameters()));
  }
  LOG_INFO("data: {} tokens, {} windows of {}; {} tokens per step ({} x {} x {} accumulation{}){}",
           run.dataset->num_tokens(), run.loader->num_windows(), t.seq_len, tokens_per_step, t.micro_batch,
           t.seq_len, t.grad_accum,
           t.parallel_context > 1 ? fmt::format(" x {} context groups of {} ranks, each rank a 1/{} share of every "
                                                "sequence", ranks.world() / t.parallel_context, t.parallel_context,
                                                t.parallel_context)
           : ranks.several()      ? fmt::format(" x {} ranks", ranks.world())
                                  : "",
           run.loader->options().packing == Packing::kDocument
               ? fmt::format("; documents packed apart (end at token {})", run.loader->options().eos_id)
               : "");
  if (run.eval_loader)
    LOG_INFO("eval: {} micro-batches ({} tokens) of {} ({} tokens) after {}the last step", run.eval_batches,
             run.eval_batches * t.micro_batch * t.seq_len,
             t.data_eval_fraction > 0 ? "the held-out documents" : "data.eval_paths", run.eval_dataset->num_tokens(),
             t.eval_every > 0 ? fmt::format("every {} steps and ", t.eval_every) : std::string());
  LOG_INFO("memory: {}", run.engine->memory_summary());
  if (!host_ram.items.empty()) LOG_INFO("{}", format_host_ram(host_ram));
  LOG_INFO("run: {} steps on {}, writing {} (metrics.jsonl, config.yaml) and checkpoints to {}", t.steps,
           run.engine->device_name(), t.run_dir, t.ckpt_dir);
  return Status::OK();
}

// The eval loss of the checkpoint CKPT_DIR/best names (ckpt.keep_best), so that a run resumed
// from step `resumed` saves only evaluations better than it; +inf when there is none, it cannot
// be read, or it names a later step (a branch this run redoes: that checkpoint stays until its
// step is saved again, and this run's evaluations start a new best).
double saved_best_eval(const std::string& ckpt_dir, int64_t resumed) {
  const fs::path path = fs::path(ckpt_dir) / ckpt::kBestFile;
  if (!fs::exists(path)) return std::numeric_limits<double>::infinity();
  std::ifstream in(path);
  std::string name, key;
  double loss = 0;
  long long step = -1;
  if (!std::getline(in, name) || !(in >> key >> loss) || key != "eval_loss" || !std::isfinite(loss) ||
      std::sscanf(name.c_str(), "step-%lld", &step) != 1) {
    LOG_WARN("ckpt.keep_best: {} cannot be read; this run's evaluations start a new best", path.string());
    return std::numeric_limits<double>::infinity();
  }
  if (step > resumed) {
    LOG_INFO("ckpt.keep_best: {} names {}, after step {} this run resumes from; this run's evaluations start a "
             "new best", path.string(), name, resumed);
    return std::numeric_limits<double>::infinity();
  }
  LOG_INFO("ckpt.keep_best: the best so far is {} (eval loss {:.4f})", name, loss);
  return loss;
}

// 1. Everything that can be wrong with the inputs is checked before anything but the locks of
// the run's folders is written; then the engine, the starting state (a checkpoint, weights or an
// init) and the run directory.
Result<std::unique_ptr<Run>> prepare(TrainConfig& t, const std::string& effective_yaml, GoodputAccountant* goodput,
                                     std::optional<RunDirs>* dirs, Ranks& ranks) {
  auto run = std::make_unique<Run>();
  run->goodput = goodput;
  run->ranks = &ranks;
  RETURN_IF_ERROR(resolve_run_model(t, *run));
  RETURN_IF_ERROR(open_dirs_and_data(t, *run, dirs, ranks));
  ASSIGN_OR_RETURN(std::optional<model::SafetensorsReader> weights, open_starting_weights(t, *run));
  if (!t.run_export.empty())
    RETURN_IF_ERROR(model::check_export_target(
        t.run_export, run->mc.lora.enabled() && !t.run_export_merged ? model::kPeftConfigFile : "config.json"));
  run->schedule.emplace(LrSchedule{t.lr, t.warmup_steps, t.steps, t.min_lr_ratio, t.lr_schedule});
  ASSIGN_OR_RETURN(HostRamPlan host_ram, open_engine(t, *run, ranks));

  // Resume from a checkpoint (any budgets); otherwise the starting weights.
  std::string resume_from = t.resume;
  if (resume_from == "auto") {
    resume_from = fs::exists(fs::path(t.ckpt_dir) / "latest") ? t.ckpt_dir : "";
    if (resume_from.empty()) LOG_INFO("resume: no checkpoint in {}; starting from step 1", t.ckpt_dir);
  }
  if (resume_from.empty()) RETURN_IF_ERROR(fill_starting_weights(t, *run, weights));
  // A checkpoint holds the trained state; frozen tensors (LoRA's base) come from the source again.
  const bool any_frozen =
      std::any_of(run->layout.tensors().begin(), run->layout.tensors().end(), [](const auto& s) { return s.frozen; });
  if (!resume_from.empty() && any_frozen) RETURN_IF_ERROR(fill_starting_weights(t, *run, weights, TensorSet::kFrozen));
  weights.reset();
  if (!resume_from.empty()) RETURN_IF_ERROR(restore_run(t, *run, resume_from));
  if (!resume_from.empty() && t.ckpt_keep_best) {
    run->best_eval = saved_best_eval(t.ckpt_dir, run->start_step - 1);
    if (ranks.several()) {
      // Every rank must make the same best-save decisions (a sharded save needs all of them):
      // they take rank 0's reading.
      std::vector<double> readings(static_cast<size_t>(ranks.world()), 0.0);
      if (ranks.rank() == 0) readings[0] = run->best_eval;
      RETURN_IF_ERROR(parallel::sum_over_ranks(*ranks.comm, std::span<double>(readings)));
      run->best_eval = readings[0];
    }
  }
  open_checkpointer(t, *run, ranks);

  // Steps an earlier run in this run.dir recorded beyond where this one starts are done again:
  // its metrics are metrics.jsonl when resuming from a checkpoint, or the file set aside when a
  // requeued run found none (run_dirs.h).
  if (!resume_from.empty()) {
    run->redo_until = highest_recorded_step((fs::path(t.run_dir) / "metrics.jsonl").string());
  } else if (dirs->has_value() && !(*dirs)->set_aside_metrics().empty()) {
    run->redo_until = highest_recorded_step((*dirs)->set_aside_metrics());
  }

  // No rank starts unless every rank can (the others would wait for it until the timeout), and
  // rank 0 writes into run.dir only then, so that a refused start leaves nothing behind.
  if (ranks.several()) {
    ranks.start_agreed = true;
    RETURN_IF_ERROR(agree_all_ok(*ranks.comm, Status::OK(), "to start"));
    // ZeRO-3's gathers run as many groups ahead on every rank, so that the ranks' collectives
    // pair up in order: the fewest any rank's device has room for.
    ASSIGN_OR_RETURN(const int ahead,
                     fewest_over_ranks(*ranks.comm, run->engine->gather_ahead(), kMaxGatherAhead));
    run->engine->run_gathers_ahead(ahead);
  }
  if (!ranks.writes()) {
    LOG_INFO("rank {}: prepared", ranks.rank());
    // Each other rank keeps its own step metrics beside rank 0's: its tiers, traffic and
    // memory are its own. Appended to, never truncated: a rerun in the same run.dir adds its
    // steps after the earlier run's (rank 0's set-aside and redo rules are for metrics.jsonl).
    const fs::path path = fs::path(t.run_dir) / fmt::format("metrics.rank-{}.jsonl", ranks.rank());
    std::error_code ec;
    fs::create_directories(t.run_dir, ec);
    if (ec) return Status::IOError("cannot create run.dir '" + t.run_dir + "': " + ec.message());
    ASSIGN_OR_RETURN(MetricsWriter metrics, MetricsWriter::open(path.string(), /*append=*/true));
    run->metrics.emplace(std::move(metrics));
    return run;
  }
  RETURN_IF_ERROR(open_run_dir(t, *run, effective_yaml, !resume_from.empty(), host_ram, ranks));
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
  {
    GoodputAccountant::Timer blocked = run.goodput->time(GoodputPart::kCheckpoint);
    (void)run.checkpointer->wait();
  }
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

// A step's time in the goodput parts: loading its batch is data, the engine's waits for state
// are memory stalls, the optimizer's copy-on-write for a save in flight is checkpoint time and
// the rest is compute; all of it is restart when an earlier run already did this step.
void account_step(Run& run, int64_t step, double data_s, double step_s, uint64_t stall_ns, uint64_t ckpt_ns) {
  GoodputAccountant& g = *run.goodput;
  if (step <= run.redo_until) {
    g.add(GoodputPart::kRestart, data_s + step_s);
    return;
  }
  // Both are measured apart from the step, possibly on another thread: never more than it.
  const double stall_s = std::min(static_cast<double>(stall_ns) / 1e9, step_s);
  const double ckpt_s = std::min(static_cast<double>(ckpt_ns) / 1e9, step_s - stall_s);
  g.add(GoodputPart::kData, data_s);
  g.add(GoodputPart::kMemoryStall, stall_s);
  g.add(GoodputPart::kCheckpoint, ckpt_s);
  g.add(GoodputPart::kCompute, step_s - stall_s - ckpt_s);
}

// This rank's share of a micro-batch of train.micro_batch sequences: all of it, or with context
// parallelism its two chunks of every sequence (model/context_parallel.h), as rows and tokens.
struct RankShare {
  const int32_t* inputs;
  const int32_t* targets;
  int64_t B, T;
};
RankShare rank_share(const TrainConfig& t, const Ranks& ranks, const int32_t* inputs, const int32_t* targets,
                     std::vector<int32_t>& local_inputs, std::vector<int32_t>& local_targets) {
  const int64_t N = t.parallel_context;
  if (N <= 1) return {inputs, targets, t.micro_batch, t.seq_len};
  const int64_t local = t.micro_batch * t.seq_len / N, r = ranks.rank() % N;
  local_inputs.resize(static_cast<size_t>(local));
  local_targets.resize(static_cast<size_t>(local));
  model::context_split(local_inputs.data(), inputs, t.micro_batch, t.seq_len, 1, sizeof(int32_t), N, r);
  model::context_split(local_targets.data(), targets, t.micro_batch, t.seq_len, 1, sizeof(int32_t), N, r);
  return {local_inputs.data(), local_targets.data(), 2 * t.micro_batch, t.seq_len / (2 * N)};
}

// One evaluation on data.eval_paths after `step`: the first run.eval_batches micro-batches of the
// eval data's window order, the same ones every time, forward only through the engine. Rank r
// computes micro-batches r, r + W, ... (context group g = r / N of W / N groups computes g, g +
// W / N, ..., each rank its share); the sums of NLLs and of predicted tokens are added over
// the ranks. Returns the mean NLL per predicted token.
Result<double> evaluate(Run& run, const TrainConfig& t, int64_t step) {
  trace::Span eval_span("step", "evaluation", step);
  GoodputAccountant::Timer timing = run.goodput->time(GoodputPart::kEval);
  Ranks& ranks = *run.ranks;
  const int64_t micro_tokens = t.micro_batch * t.seq_len;
  std::vector<int32_t> inputs(static_cast<size_t>(micro_tokens)), targets(inputs.size()), positions(inputs.size());
  // Packed documents' positions (data.packing: document); null keeps concat's bits.
  const bool documents = run.eval_loader->options().packing == Packing::kDocument;
  RETURN_IF_ERROR(run.eval_loader->set_cursor({}));
  double sums[2] = {0, 0};  // NLL, predicted tokens
  // Rounds of one micro-batch per rank (per context group with context parallelism, whose ranks
  // share it): with the weights sliced over the ranks (ZeRO-3) every forward gathers them, with
  // expert parallelism every MoE layer exchanges tokens, and a context group's ring passes keys
  // on, all collectives, so a rank without a micro-batch of its own in the last round computes
  // the round's first one again and drops its loss.
  const int64_t world = ranks.world() / t.parallel_context, own = ranks.rank() / t.parallel_context;
  const int64_t rounds = (run.eval_batches + world - 1) / world;
  const bool every_rank_computes = world > 1 && (run.engine->plan().zero >= 3 || ranks.expert_comm != nullptr ||
                                                 t.parallel_context > 1);
  std::vector<int32_t> first_inputs, first_targets, first_positions;  // of the round
  std::vector<int32_t> local_inputs, local_targets;
  for (int64_t m = 0; m < rounds * world; ++m) {
    const bool real = m < run.eval_batches;
    if (real) RETURN_IF_ERROR(run.eval_loader->next(inputs.data(), targets.data(), positions.data()));
    if (m % world == 0) first_inputs = inputs, first_targets = targets, first_positions = positions;
    if (m % world != own || (!real && !every_rank_computes)) continue;
    const int32_t* pos = !documents ? nullptr : real ? positions.data() : first_positions.data();
    const RankShare share = rank_share(t, ranks, real ? inputs.data() : first_inputs.data(),
                                       real ? targets.data() : first_targets.data(), local_inputs, local_targets);
    ASSIGN_OR_RETURN(double nll, run.engine->eval_micro_batch(share.inputs, share.targets, share.B, share.T, pos));
    if (!real) continue;
    sums[0] += nll;
    sums[1] += static_cast<double>(model::count_valid_targets(share.targets, share.B * share.T));
  }
  if (ranks.several()) RETURN_IF_ERROR(parallel::sum_over_ranks(*ranks.comm, std::span<double>(sums)));
  CHECK_MSG(sums[1] > 0, "the eval windows were checked for targets when the run started");
  return sums[0] / sums[1];
}

// 2. The steps, until train.steps, a signal or the first error (returned).
//
// Data parallel: every rank reads the step's whole global batch (world x train.grad_accum
// micro-batches, so the data cursor is the same everywhere) and computes micro-batches
// [rank x grad_accum, (rank + 1) x grad_accum) of it; the gradients are summed over the ranks in
// the engine's step, and the loss here. The tokens are scaled by the global batch's count, so a
// step is the one a single process takes with world x grad_accum micro-batches (W / N x
// grad_accum with context groups of N, whose ranks share each micro-batch).
Status loop(Run& run, const TrainConfig& t) {
  PagedEngine& engine = *run.engine;
  Ranks& ranks = *run.ranks;
  const int64_t micro_tokens = t.micro_batch * t.seq_len;
  // In the global batch, and this rank's first: a context group's ranks share theirs.
  const int64_t micro_batches = t.grad_accum * ranks.world() / t.parallel_context;
  const int64_t first_micro = t.grad_accum * (ranks.rank() / t.parallel_context);
  std::vector<int32_t> local_inputs, local_targets;  // this rank's share (context parallelism)
  const int64_t tokens_per_step = micro_tokens * micro_batches;
  const double flops_per_token = model_flops_per_token(run.mc, t.seq_len);
  std::vector<int32_t> inputs(static_cast<size_t>(micro_tokens * micro_batches));
  std::vector<int32_t> targets(inputs.size());
  // Packed documents' positions (data.packing: document); none with concat, whose bits stay.
  const bool documents = run.loader->options().packing == Packing::kDocument;
  std::vector<int32_t> positions(documents ? inputs.size() : 0);
  auto positions_of = [&](int64_t m) { return documents ? positions.data() + m * micro_tokens : nullptr; };
  const auto run_start = std::chrono::steady_clock::now();
  trace::name_thread("training");
  for (int64_t step = run.start_step; step <= t.steps; ++step) {
    bool stop = g_stop_requested != 0;
    // A signal may reach the ranks at different times: they stop at the same step.
    if (ranks.several()) {
      ASSIGN_OR_RETURN(stop, any_rank(*ranks.comm, stop));
    }
    if (stop) {
      run.summary.interrupted = true;
      break;
    }
    if (run.observer != nullptr) run.observer->on_step_begin(step);
    trace::Span step_span("step", "step", step);
    auto t0 = std::chrono::steady_clock::now();
    const bool ckpt_in_flight = run.checkpointer->in_flight();
    trace::Span data_span("data", "data");
    int64_t step_start = 0;  // where the step's first window starts in the token stream
    for (int64_t m = 0; m < micro_batches; ++m) {
      RETURN_IF_ERROR(
          run.loader->next(inputs.data() + m * micro_tokens, targets.data() + m * micro_tokens, positions_of(m)));
      if (m == 0) step_start = run.loader->last_window_start();
    }
    data_span.end();
    const auto t_data = std::chrono::steady_clock::now();
    const int64_t valid = model::count_valid_targets(targets.data(), static_cast<int64_t>(targets.size()));
    // Every rank reads the whole global batch, so all of them stop here at the same step.
    if (run.dataset->has_masks() && !t.data_allow_empty_loss) {
      if (valid == 0) {
        return Status::InvalidArgument(fmt::format(
            "step {}: the loss masks leave no token to predict in any of the step's {} windows (the first starts at "
            "{}): every mask byte is 0, so the step would train on nothing; check the masks written beside the token "
            "files (strata data tokenize --format chat marks the assistant's tokens), or set "
            "data.allow_empty_loss=true to train such steps as no-ops",
            step, micro_batches * t.micro_batch, run.dataset->describe_position(step_start)));
      }
    }
    const float grad_scale = valid > 0 ? 1.0f / static_cast<float>(valid) : 0.0f;
    const EngineStats before = engine.stats();
    const uint64_t ckpt_blocked_before = run.checkpointer->blocked_ns();
    run.sound = false;  // until the optimizer step is through
    RETURN_IF_ERROR(engine.zero_grads());
    // After zero_grads(), which waits for a skipped step's gradient sums still under way.
    const uint64_t sent_before = ranks.bytes_sent();
    double loss_sum = 0;
    const double lr = run.schedule->lr(step);
    for (int64_t m = first_micro; m < first_micro + t.grad_accum; ++m) {
      trace::Span micro_span("step", "micro-batch", m);
      const RankShare share = rank_share(t, ranks, inputs.data() + m * micro_tokens, targets.data() + m * micro_tokens,
                                         local_inputs, local_targets);
      ASSIGN_OR_RETURN(double loss, engine.micro_batch(share.inputs, share.targets, share.B, share.T, grad_scale,
                                                        m == first_micro + t.grad_accum - 1, static_cast<float>(lr),
                                                        positions_of(m)));
      loss_sum += loss;
    }
    if (ranks.several()) {
      ASSIGN_OR_RETURN(loss_sum, parallel::sum_over_ranks(*ranks.comm, loss_sum));
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
      trace::Span optimizer_span("step", "optimizer step");
      Result<double> stepped = engine.step(static_cast<float>(lr));
      if (!stepped.ok()) return stepped.status().with_context(fmt::format("step {}", step));
      grad_norm = *stepped;
      skipped = !std::isfinite(grad_norm);
    }
    run.skipped_in_a_row = skipped ? run.skipped_in_a_row + 1 : 0;
    run.summary.skipped_steps += skipped ? 1 : 0;
    const auto t_end = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(t_end - t0).count();
    const EngineStats after = engine.stats();
    account_step(run, step, std::chrono::duration<double>(t_data - t0).count(),
                 std::chrono::duration<double>(t_end - t_data).count(), after.stall_ns - before.stall_ns,
                 run.checkpointer->blocked_ns() - ckpt_blocked_before);
    // What each rank sent in the step (the gradient sums and the updated groups' weights).
    double comm_bytes = 0;
    if (ranks.several()) {
      ASSIGN_OR_RETURN(comm_bytes, parallel::sum_over_ranks(
                                       *ranks.comm, static_cast<double>(ranks.bytes_sent() - sent_before)));
      comm_bytes /= ranks.world();
    }
    run.tokens_seen += tokens_per_step;
    run.mark_sound(step);
    run.summary.steps_done = step;

    StepMetrics sm;
    sm.step = step;
    sm.total_steps = t.steps;
    sm.loss = valid > 0 ? loss_sum / static_cast<double>(valid) : 0.0;
    sm.lr = lr;
    sm.grad_norm = grad_norm;
    sm.ms = seconds * 1e3;
    sm.tokens_per_s = static_cast<double>(tokens_per_step) / seconds;
    sm.model_tflops = sm.tokens_per_s * flops_per_token / 1e12;
    sm.tokens = run.tokens_seen;
    for (int i = 0; i < kNumTiers; ++i) sm.tier_bytes[i] = after.tier_bytes[i];
    sm.state_bytes = after.state_bytes;
    sm.stall_ms = static_cast<double>(after.stall_ns - before.stall_ns) / 1e6;
    sm.moved_bytes = after.moved_bytes - before.moved_bytes;
    sm.world = ranks.world();
    sm.comm_bytes = comm_bytes;
    sm.experts_reached_by_layer = run.engine->experts_reached_by_layer();
    sm.experts_reached = run.engine->experts_reached();
    sm.rss_bytes = resident_bytes();
    sm.rss_peak_bytes = peak_resident_bytes();
    sm.rss_planned_bytes = run.host_ram_peak;
    sm.recipe = run.engine->recipe();
    sm.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    sm.ckpt_in_flight = ckpt_in_flight;
    sm.skipped = skipped;
    sm.skipped_steps = run.summary.skipped_steps;
    sm.eta_s = sm.elapsed_s / static_cast<double>(step - run.start_step + 1) * static_cast<double>(t.steps - step);
    if (run.eval_loader && ((t.eval_every > 0 && step % t.eval_every == 0) || step == t.steps)) {
      ASSIGN_OR_RETURN(sm.eval_loss, evaluate(run, t, step));
      sm.evaluated = true;
    }
    if (run.metrics) RETURN_IF_ERROR(run.metrics->write(sm));
    if (run.tensorboard) RETURN_IF_ERROR(run.tensorboard->scalars(step, tensorboard_scalars(sm, t)));
    run.last_logged_step = step;
    if (step == run.start_step) run.summary.first_loss = sm.loss;
    run.summary.last_loss = sm.loss;
    if (skipped) {
      // A run stopped for diverging is not checkpointed again: the last finite checkpoint
      // stays the newest.
      if (Status st = note_skipped_step(run, t, sm); !st.ok()) {
        run.sound = false;
        return st;
      }
    }
    // ckpt.keep_best: an evaluation better than every saved one is saved too.
    std::optional<double> best;
    if (t.ckpt_keep_best && !skipped && sm.evaluated && sm.eval_loss < run.best_eval) best = sm.eval_loss;
    if ((t.ckpt_every > 0 && step % t.ckpt_every == 0) || best) {
      trace::Span save_span("checkpoint", "checkpoint start");
      RETURN_IF_ERROR(run.save_checkpoint(t, best));
    }
    if (!skipped && (step % t.log_every == 0 || step == 1 || step == t.steps || sm.evaluated)) {
      LOG_INFO("{}", format_step_line(sm));
      if (std::string note = engine.step_note(); !note.empty()) LOG_INFO("{}", note);
    }
    if (run.observer != nullptr) run.observer->on_step_end(sm);
  }
  return Status::OK();
}

// OK when every parameter the run ends with is finite; else an error naming the first tensor
// that is not. A finite loss and gradient norm do not prove it: AdamW itself can write 0/0
// (optim.eps=0 with a zero gradient), after the step was judged. The optimizer checks what it
// writes and fails that step (PagedState::clip_and_step); this is the last look before anything
// of the final state is saved or exported. One read of the parameters,
// as an export makes. With several ranks a rank holds only its groups' fp32 weights: each rank's
// final checkpoint shard is checked as it is written instead (the writer refuses NaN or Inf),
// and their export reads that checkpoint.
Status check_final_weights(Run& run) {
  if (run.ranks->several()) return Status::OK();
  SavableState& state = run.engine->state();
  std::vector<float> values;
  for (const model::TensorSpec& spec : run.layout.tensors()) {
    if (spec.frozen) continue;  // unchanged since it was loaded (and checked)
    values.resize(static_cast<size_t>(spec.numel));
    RETURN_IF_ERROR(state.read_flat(StateKind::kParam, static_cast<uint64_t>(spec.offset) * sizeof(float),
                                    static_cast<uint64_t>(spec.numel) * sizeof(float), values.data()));
    const uint64_t bad = ckpt::count_non_finite(DType::kF32, values.data(), values.size());
    if (bad > 0)
      return Status::Internal(fmt::format(
          "the weights after step {} are not finite: tensor '{}' holds {} NaN or Inf values of {}; the last update "
          "diverged (optim.eps 0, or a learning rate too large); resume from an earlier checkpoint with other settings",
          run.summary.steps_done, spec.name, bad, spec.numel));
  }
  return Status::OK();
}

// 3. The final checkpoint (when stopped by a signal, or at the end of a run that saves
// periodically), waiting for the saves in flight, and the export. A final save that fails is
// the run's error: the state it held is not on disk. A run whose final weights are not finite
// fails: nothing of them is saved or exported.
Result<TrainSummary> finish(Run& run, const TrainConfig& t) {
  TrainSummary& summary = run.summary;
  if (Status finite = check_final_weights(run); !finite.ok()) {
    (void)run.wait_for_save();  // a save in flight holds an earlier, finite state
    return finite;
  }
  // Ranks hold master weights in shards: an export reads them from the final checkpoint.
  const bool export_from_checkpoint = run.ranks->several() && !t.run_export.empty();
  if (summary.interrupted || t.ckpt_every > 0 || export_from_checkpoint) {
    RETURN_IF_ERROR(run.save_final(t));
  } else if (Status saved = run.wait_for_save(); !saved.ok()) {
    LOG_WARN("checkpoint: {}", saved.message());
  }
  if (summary.interrupted) LOG_WARN("interrupted: stopped after step {}", summary.steps_done);
  if (!t.run_export.empty() && run.ranks->writes()) {
    model::ExportOptions eo;
    eo.copy_tokenizer_from = t.model_from;
    eo.dtype = t.run_export_dtype == "auto" ? run.source_dtype : *model::parse_export_dtype(t.run_export_dtype);
    eo.selection_bias = &run.engine->selection_bias();
    SavableState& state = run.engine->state();
    std::unique_ptr<ckpt::CheckpointReader> saved;
    if (export_from_checkpoint) {
      ASSIGN_OR_RETURN(saved, ckpt::CheckpointReader::open(
                                  (fs::path(t.ckpt_dir) / ckpt::step_dir_name(run.last_saved_step)).string()));
    }
    // Frozen tensors (LoRA's base) as the source holds them, read from it again; a checkpoint
    // holds none of them.
    const std::string weights_from = !t.model_from.empty() ? t.model_from : t.model_init;
    std::optional<model::SafetensorsReader> base;
    if (run.frozen_from.contains("source")) {
      ASSIGN_OR_RETURN(model::SafetensorsReader reader, model::open_hf_weights(weights_from, run.layout));
      base.emplace(std::move(reader));
    }
    // Tensor by tensor out of the engine's state (or the final checkpoint): no second copy of the model.
    auto read = [&](const model::TensorSpec& spec, float* out) -> Status {
      if (spec.frozen && base) return model::read_hf_tensor(*base, spec, out);
      if (spec.frozen && run.frozen_from.contains("init_seed")) {
        model::init_tensor(spec, out, t.seed);  // a random init's values, as strata convert reads them
        return Status::OK();
      }
      if (saved && !spec.frozen) return saved->read_f32(spec.name, out, static_cast<uint64_t>(spec.numel));
      return state.read_flat(StateKind::kParam, static_cast<uint64_t>(spec.offset) * sizeof(float),
                             static_cast<uint64_t>(spec.numel) * sizeof(float), out);
    };
    const bool adapter_only = run.mc.lora.enabled() && !t.run_export_merged;
    GoodputAccountant::Timer exporting = run.goodput->time(GoodputPart::kExport);
    Status exported;
    if (adapter_only) {
      // PEFT keeps adapters in fp32; run.export_dtype names another dtype.
      const model::SafetensorsWriteDtype dtype =
          t.run_export_dtype == "auto" ? model::SafetensorsWriteDtype::kF32 : eo.dtype;
      exported = model::export_peft_adapter(t.run_export, run.layout, read, {.dtype = dtype, .base_model = weights_from});
    } else {
      // A merged export: each adapted weight plus scale * B A, in fp32, then in the export's dtype.
      std::vector<float> a, b;
      exported = model::export_hf(
          t.run_export, run.mc, run.layout,
          [&](const model::TensorSpec& spec, float* out) -> Status {
            RETURN_IF_ERROR(read(spec, out));
            const model::LoraOffsets* lo = run.layout.lora_of(spec.offset);
            if (lo == nullptr) return Status::OK();
            const model::TensorSpec& sa = run.layout.at(lo->a);
            const model::TensorSpec& sb = run.layout.at(lo->b);
            a.resize(static_cast<size_t>(sa.numel));
            b.resize(static_cast<size_t>(sb.numel));
            RETURN_IF_ERROR(read(sa, a.data()));
            RETURN_IF_ERROR(read(sb, b.data()));
            model::merge_lora(out, a.data(), b.data(), spec.shape[0], spec.shape[1], run.mc.lora.rank,
                              run.mc.lora.scale());
            return Status::OK();
          },
          eo);
    }
    exporting.stop();
    if (!exported.ok()) {
      // The trained state must outlive a failed export (a full disk): it goes to a checkpoint.
      Status saved = run.save_final(t);
      return exported.with_context("run.export")
          .with_note(saved.ok() ? fmt::format("the trained state is in checkpoint step {} in '{}'; export it with "
                                              "`strata convert --from {} --to DIR`",
                                              run.last_saved_step, t.ckpt_dir, t.ckpt_dir)
                                : "the state could not be checkpointed either: " + saved.message());
    }
    LOG_INFO("exported the {} after step {} to {} ({}, {})", adapter_only ? "adapters" : "weights",
             summary.steps_done, t.run_export,
             adapter_only ? "PEFT adapter" : run.mc.lora.enabled() ? "Hugging Face format, adapters merged"
                                                                   : "Hugging Face format",
             model::export_dtype_name(eo.dtype));
  }
  LOG_INFO("done: {} steps, loss {:.4f} -> {:.4f}", summary.steps_done, summary.first_loss, summary.last_loss);
  return summary;
}

// The loop and the end of a prepared run: finish() after the last step, or the error, with the
// state checkpointed first when it is whole.
Result<TrainSummary> train(Run& run, const TrainConfig& t) {
  g_stop_requested = 0;
  auto old_int = std::signal(SIGINT, on_stop_signal);
  auto old_term = std::signal(SIGTERM, on_stop_signal);
  const Status stepped = loop(run, t);
  std::signal(SIGINT, old_int);
  std::signal(SIGTERM, old_term);
  if (!stepped.ok()) {
    // An error between steps (metrics on a full disk, a save that could not start) leaves the
    // state whole: it is checkpointed before the run exits with the error.
    if (!run.sound) return stepped;
    Status saved = run.save_final(t);
    if (!saved.ok()) return stepped.with_note("the final checkpoint failed too: " + saved.message());
    if (run.last_saved_step < run.start_step) return stepped;  // no step done, nothing saved
    return stepped.with_note(fmt::format("stopped after step {}, whose checkpoint is in '{}' (--resume auto "
                                         "continues from it)",
                                         run.last_saved_step, t.ckpt_dir));
  }
  return finish(run, t);
}

// The goodput of a run that got as far as its metrics file, whether it trained, was stopped or
// failed: one line in the log and the last line of metrics.jsonl. The engine and the saves are
// ended first (a save in flight is waited for), so that the report covers nearly all of
// run_training.
GoodputReport report_goodput(Run& run, GoodputAccountant& goodput) {
  {
    std::optional<GoodputAccountant::Timer> blocked;
    if (run.checkpointer->in_flight()) blocked.emplace(goodput, GoodputPart::kCheckpoint);
    run.checkpointer.reset();
  }
  run.engine.reset();
  run.eval_loader.reset();
  run.eval_dataset.reset();
  run.loader.reset();
  run.dataset.reset();
  const GoodputReport report = goodput.report();
  LOG_INFO("{}", format_goodput_line(report));
  if (!run.metrics) return report;
  if (Status written = run.metrics->append(goodput_json(report).dump()); !written.ok())
    LOG_WARN("goodput: {}", written.message());
  if (run.tensorboard && run.last_logged_step > 0) {
    if (Status written = run.tensorboard->scalars(run.last_logged_step, {{"run/goodput", report.goodput()}});
        !written.ok())
      LOG_WARN("goodput: {}", written.message());
  }
  return report;
}

}  // namespace

Result<TrainSummary> run_training(const TrainConfig& config, const std::string& effective_yaml) {
  return run_training(config, effective_yaml, nullptr);
}

Result<TrainSummary> run_training(const TrainConfig& config, const std::string& effective_yaml,
                                  RunObserver* observer) {
  GoodputAccountant goodput;  // the run's wall time starts here
  TrainConfig t = config;
  std::optional<RunDirs> dirs;
  GoodputAccountant::Timer starting = goodput.time(GoodputPart::kStartup);
  ASSIGN_OR_RETURN(Ranks ranks, connect_ranks(t));
  Result<std::unique_ptr<Run>> prepared = prepare(t, effective_yaml, &goodput, &dirs, ranks);
  // A rank that failed before prepare's agreement to start still takes part in it.
  if (ranks.several() && !ranks.start_agreed) {
    Status all = agree_all_ok(*ranks.comm, prepared.status(), "to start");
    if (prepared.ok() && !all.ok()) prepared = all;
  }
  starting.stop();
  if (!prepared.ok()) {
    if (dirs) dirs->discard_if_unused();
    return prepared.status();
  }
  Run& run = **prepared;
  run.observer = observer;
  if (observer != nullptr) observer->on_start(t, *run.engine);
  Result<TrainSummary> trained = train(run, t);
  const GoodputReport report = report_goodput(run, goodput);
  if (trained.ok()) trained->goodput = report;
  // A run that ended well leaves no addresses behind for a later launch with the same job id.
  if (trained.ok() && ranks.several()) retire_rendezvous(ranks, t);
  return trained;
}

}  // namespace strata
