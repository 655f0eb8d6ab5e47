#include "tools/strata/model_source.h"

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ckpt/format.h"
#include "ckpt/reader.h"
#include "core/config.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/units.h"
#include "model/params.h"
#include "train/checkpointing.h"
#include "train/manifest_fields.h"
#include "train/paged_engine.h"
#include "train/train_config.h"

namespace strata::tools {

namespace fs = std::filesystem;

bool looks_like_checkpoint(const std::string& path) {
  std::error_code ec;
  fs::path p(path);
  while (p.has_relative_path() && p.filename().empty()) p = p.parent_path();  // trailing '/'
  if (fs::is_regular_file(p, ec) && p.filename() == ckpt::kLatestFile) return true;
  if (!fs::is_directory(p, ec)) return false;
  if (fs::exists(p / ckpt::kLatestFile, ec) || fs::exists(p / ckpt::kManifestFile, ec)) return true;
  return ckpt::parse_step_dir_name(p.filename().string()).has_value();
}

namespace {

// A checkpoint's frozen tensors (LoRA's base, an untrained MTP module) into params, from the
// source model_config.strata_frozen_from names (checked against the fingerprint the run
// recorded) or the random init of its seed.
Status read_frozen_tensors(const model::ParamLayout& layout, const nlohmann::json& mc, const std::string& manifest,
                           float* params) {
  bool any = false;
  for (const model::TensorSpec& t : layout.tensors()) any = any || t.frozen;
  if (!any) return Status::OK();
  const auto from = mc.find("strata_frozen_from");
  if (from == mc.end() || !from->is_object())
    return Status::InvalidArgument(manifest + ": the model has frozen tensors but model_config.strata_frozen_from "
                                   "does not say where they come from");
  if (const auto seed = from->find("init_seed"); seed != from->end() && seed->is_number_unsigned()) {
    for (const model::TensorSpec& t : layout.tensors())
      if (t.frozen) model::init_tensor(t, params + t.offset, seed->get<uint64_t>());
    return Status::OK();
  }
  const std::string source = from->value("source", std::string());
  Result<model::SafetensorsReader> reader = model::open_hf_weights(source, layout);
  if (!reader.ok())
    return reader.status().with_context(manifest + ": the frozen weights' source (model_config.strata_frozen_from)");
  const std::string recorded = from->value("tensors_xxh3", std::string());
  const std::string found = model::frozen_tensors_fingerprint(*reader, layout);
  if (recorded != found)
    return Status::InvalidArgument(fmt::format(
        "{}: the frozen weights' source {} is not the model the run trained on (its tensors' fingerprint is {}, the "
        "run recorded {}); put that model back at {}",
        manifest, source, found, recorded, source));
  LOG_INFO("reading the frozen weights from {} (model_config.strata_frozen_from)", source);
  for (const model::TensorSpec& t : layout.tensors())
    if (t.frozen) RETURN_IF_ERROR(model::read_hf_tensor(*reader, t, params + t.offset));
  return Status::OK();
}

}  // namespace

Result<LoadedModel> load_checkpoint(const std::string& path) {
  ckpt::ReaderOpenOptions ro;
  ro.verify = true;
  ASSIGN_OR_RETURN(std::unique_ptr<ckpt::CheckpointReader> reader, ckpt::CheckpointReader::open(path, ro));
  const std::string manifest = reader->step_dir() + "/" + ckpt::kManifestFile;
  const nlohmann::json& mc = reader->manifest().fields.model_config;
  if (!mc.is_object() || mc.empty()) {
    return Status::InvalidArgument(manifest + " has no model_config, so the model's shape is unknown; use a "
                                   "checkpoint saved by strata train, which records the model's config.json there");
  }
  Result<model::ModelConfig> config = model::ModelConfig::from_json(mc, manifest + " model_config");
  if (!config.ok()) return config.status();
  LoadedModel out;
  out.config = *config;
  // What the run trained: LoRA adapters over a frozen base, and whether its MTP modules trained.
  if (const auto it = mc.find("strata_lora"); it != mc.end()) {
    ASSIGN_OR_RETURN(out.config.lora, model::LoraConfig::from_json(*it, manifest + " model_config.strata_lora"));
  }
  if (const auto it = mc.find("strata_trains_mtp"); it != mc.end() && it->is_boolean() && !it->get<bool>())
    out.config.mtp_loss_weight = 0;  // the modules were frozen
  RETURN_IF_ERROR(out.config.validate(manifest + " model_config"));
  if (const auto it = mc.find("torch_dtype"); it != mc.end() && it->is_string()) {
    out.source_dtype = model::parse_torch_dtype(it->get<std::string>()).value_or(model::SafetensorsWriteDtype::kF32);
  }
  const model::ParamLayout layout(out.config);
  // Checked as a resume checks it, before the model's memory is allocated: a manifest that
  // misdescribes its files (fewer layers than they hold, a tensor stored transposed) fails here.
  RETURN_IF_ERROR(check_trainer_fields(reader->manifest(), manifest));
  RETURN_IF_ERROR(check_checkpoint_tensors(
      *reader, layout, "checkpoint " + reader->step_dir() + " against the model_config in " + manifest,
      "; the checkpoint's files do not match the model its manifest records (edited or mixed up): use "
      "another step"));
  out.params.assign(static_cast<size_t>(layout.total_size()), 0.0f);
  LOG_INFO("reading checkpoint {} (step {}, {} parameters)", reader->step_dir(), reader->step(),
           layout.num_parameters());
  // The frozen tensors come from where the run took them (a checkpoint written before frozen
  // tensors were left out holds them: they are read from it, below).
  const bool frozen_saved = frozen_tensors_saved(*reader, layout);
  if (!frozen_saved) RETURN_IF_ERROR(read_frozen_tensors(layout, mc, manifest, out.params.data()));
  Progress progress("reading " + reader->step_dir(), static_cast<uint64_t>(layout.total_size()) * sizeof(float));
  for (const model::TensorSpec& t : layout.tensors()) {
    if (t.frozen && !frozen_saved) continue;
    const std::string name = ckpt::qualified_name(ckpt::TensorKind::kParam, t.name);
    Status st = reader->read_f32(name, out.params.data() + t.offset, static_cast<uint64_t>(t.numel));
    if (!st.ok()) return st.with_context("reading checkpoint " + reader->step_dir());
    progress.add(static_cast<uint64_t>(t.numel) * sizeof(float));
  }
  if (out.config.has_selection_bias()) {
    const int64_t E = out.config.num_experts;
    // Every MoE block's, the MTP modules' too (the decoder's and export_hf's layout).
    out.selection_bias.assign(static_cast<size_t>(out.config.num_blocks() * E), 0.0f);
    for (int64_t l = 0; l < out.config.num_blocks(); ++l) {
      if (!out.config.is_moe_layer(l)) continue;
      const std::string name = ckpt::qualified_name(ckpt::TensorKind::kState, selection_bias_state_name(l));
      if (reader->find(name) == nullptr) continue;  // saved before it was trained: zeros, as resume starts
      Status st = reader->read_f32(name, out.selection_bias.data() + l * E, static_cast<uint64_t>(E));
      if (!st.ok()) return st.with_context("reading checkpoint " + reader->step_dir());
    }
  }
  return out;
}

Result<LoadedModel> load_hf_model(const std::string& dir) {
  LoadedModel out;
  ASSIGN_OR_RETURN(out.config, model::load_hf_config(dir));
  const model::ParamLayout layout(out.config);
  ASSIGN_OR_RETURN(model::SafetensorsReader reader, model::open_hf_weights(dir, layout));
  out.params.assign(static_cast<size_t>(layout.total_size()), 0.0f);
  LOG_INFO("reading {} ({} parameters, {} in fp32)", dir, layout.num_parameters(),
           format_bytes(static_cast<uint64_t>(layout.total_size()) * sizeof(float)));
  RETURN_IF_ERROR(model::read_hf_weights(reader, layout, out.params.data()));
  RETURN_IF_ERROR(model::read_hf_selection_bias(reader, out.config, &out.selection_bias));
  return out;
}

bool looks_like_run_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::is_regular_file(fs::path(path) / "config.yaml", ec) &&
         !model::is_hf_directory(path);
}

namespace {

bool has_tokenizer(const std::string& dir) {
  std::error_code ec;
  return !dir.empty() && fs::is_regular_file(fs::path(dir) / "tokenizer.json", ec);
}

// The tokenizer a run recorded: that of model.from, else of run.export (which copies it).
void find_run_tokenizer(const std::string& run_dir, const Config& config, ModelSource* source) {
  for (const char* key : {"model.from", "run.export"}) {
    const std::string& dir = config.get_string(key);
    if (dir.empty()) continue;
    if (has_tokenizer(dir)) {
      source->tokenizer_dir = dir;
      source->tokenizer_note = "the tokenizer of " + dir + " (" + key + " in " + run_dir + "/config.yaml)";
      return;
    }
  }
  source->tokenizer_note = run_dir + "/config.yaml names no model.from or run.export holding a tokenizer.json";
}

// The run directory a checkpoint belongs to: config.yaml in the checkpoint directory's parent
// (RUN/checkpoints) or its grandparent (RUN/checkpoints/step-N), or "".
std::string run_dir_of_checkpoint(const std::string& path) {
  fs::path p = fs::absolute(path);
  while (p.has_relative_path() && p.filename().empty()) p = p.parent_path();
  if (p.filename() == ckpt::kLatestFile) p = p.parent_path();
  for (int up = 0; up < 3 && p.has_relative_path(); ++up, p = p.parent_path()) {
    if (looks_like_run_dir(p.string())) return p.string();
  }
  return "";
}

}  // namespace

Result<ModelSource> resolve_model_source(const std::string& from) {
  ModelSource source;
  if (model::is_hf_directory(from)) {
    source.kind = ModelSource::Kind::kHuggingFace;
    source.model_path = from;
    if (has_tokenizer(from)) {
      source.tokenizer_dir = from;
      source.tokenizer_note = "the tokenizer of " + from;
    } else {
      source.tokenizer_note = from + " has no tokenizer.json";
    }
    return source;
  }
  std::string run_dir;
  source.kind = ModelSource::Kind::kCheckpoint;
  if (looks_like_checkpoint(from)) {
    source.model_path = from;
    run_dir = run_dir_of_checkpoint(from);
    if (run_dir.empty()) source.tokenizer_note = "no run directory (config.yaml) holds the checkpoint " + from;
  } else if (looks_like_run_dir(from)) {
    run_dir = from;
  } else {
    return Status::InvalidArgument(from + ": not a Hugging Face directory (no config.json), a strata checkpoint "
                                          "(no latest or manifest.json) nor a run directory (no config.yaml); pass "
                                          "one of them");
  }
  if (run_dir.empty()) return source;
  Result<Config> config = Config::load_file(train_schema(), (fs::path(run_dir) / "config.yaml").string());
  if (!config.ok()) {
    if (!source.model_path.empty()) {  // a checkpoint: its tokenizer is all the run's config gave
      source.tokenizer_note = "the run's config.yaml cannot be read: " + config.status().message();
      return source;
    }
    return config.status().with_context("reading the run directory " + run_dir);
  }
  if (source.model_path.empty()) {
    const std::string& ckpt_dir = config->get_string("ckpt.dir");
    source.model_path = ckpt_dir.empty() ? (fs::path(run_dir) / "checkpoints").string() : ckpt_dir;
    if (!looks_like_checkpoint(source.model_path)) {
      return Status::NotFound("the run " + run_dir + " has no checkpoint in " + source.model_path +
                              " (nothing saved yet?); pass a checkpoint or a Hugging Face export instead");
    }
  }
  find_run_tokenizer(run_dir, *config, &source);
  return source;
}

}  // namespace strata::tools
