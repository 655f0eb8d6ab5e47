#include "train/checkpointing.h"

#include <chrono>
#include <functional>
#include <set>

#include <fmt/format.h>

#include "ckpt/finite.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/version.h"
#include "train/manifest_fields.h"

namespace strata {
namespace {

constexpr StateKind kSavedKinds[] = {StateKind::kParam, StateKind::kAdamM, StateKind::kAdamV};

// How to get past a refused resume of another model.
constexpr const char* kOtherModel =
    "; a checkpoint resumes the model it was made of: set the model back as it was (model.* and model.set), or "
    "export the weights (strata convert) and start a new run from them (model.from)";

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// The flat layout of one kind: the state's host copy, or read out of it on demand. Each tensor
// as far as this writer saves it (SavableState::saved_range): a data-parallel rank its range,
// as a slice of the tensor, unless that is all of it.
ckpt::Region make_region(ckpt::TensorKind kind, StateKind state_kind, const model::ParamLayout& layout,
                         SavableState& state) {
  ckpt::Region r;
  r.kind = kind;
  r.data = state.flat_data(state_kind);
  if (r.data == nullptr) {
    r.read = [&state, state_kind](uint64_t offset, uint64_t length, void* dst) {
      return state.read_flat(state_kind, offset, length, dst);
    };
  }
  r.size = static_cast<uint64_t>(layout.total_size()) * sizeof(float);
  for (size_t i = 0; i < layout.tensors().size(); ++i) {
    const model::TensorSpec& t = layout.tensors()[i];
    const ElementRange range = state.saved_range(t, i);
    if (range.count == 0) continue;
    ckpt::RegionTensor& rt = r.tensors.emplace_back(ckpt::RegionTensor{
        t.name, t.shape, ckpt::DType::kF32, (static_cast<uint64_t>(t.offset) + range.first) * sizeof(float)});
    if (range.count != static_cast<uint64_t>(t.numel)) rt.slice = ckpt::TensorSlice{range.first, range.count};
  }
  return r;
}

}  // namespace

TrainCheckpointer::TrainCheckpointer(const CheckpointOptions& options, const model::ParamLayout& layout,
                                     SavableState& state, ckpt::IoEngineFactory engine_factory)
    : options_(options), layout_(layout), state_(state) {
  CHECK(!options.shard.sharded() || options.shard.exchange);
  ckpt::CheckpointWriterOptions wo;
  wo.keep_last = options.keep_last;
  wo.if_busy = options.skip_if_busy ? ckpt::IfBusy::kSkip : ckpt::IfBusy::kWait;
  wo.staging_bytes = options.staging_bytes;
  wo.engine_factory = std::move(engine_factory);
  writer_ = std::make_unique<ckpt::CheckpointWriter>(wo);
  // Each group's tensors as flat byte ranges, adjacent ones merged.
  group_ranges_.resize(static_cast<size_t>(layout_.num_layers()) + 2);
  for (const auto& t : layout_.tensors()) {
    auto& ranges = group_ranges_[static_cast<size_t>(model::param_group_of(layout_, t))];
    const uint64_t b = static_cast<uint64_t>(t.offset) * sizeof(float);
    const uint64_t e = b + static_cast<uint64_t>(t.numel) * sizeof(float);
    if (!ranges.empty() && ranges.back().second == b) ranges.back().second = e;
    else ranges.emplace_back(b, e);
  }
  state_.set_before_modify([this](int group) { before_modify(group); });
}

TrainCheckpointer::~TrainCheckpointer() {
  Status st = writer_->wait();
  if (!st.ok()) LOG_WARN("checkpoint: {}", st.message());
  state_.set_before_modify(nullptr);
}

void TrainCheckpointer::before_modify(int group) {
  if (!writer_->in_flight()) return;
  const auto start = std::chrono::steady_clock::now();
  for (int region = 0; region < 3; ++region)
    for (const auto& [b, e] : group_ranges_[static_cast<size_t>(group)]) writer_->before_modify(region, b, e);
  blocked_ns_.fetch_add(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                  std::chrono::steady_clock::now() - start)
                                                  .count()),
                        std::memory_order_relaxed);
}

Result<bool> TrainCheckpointer::save(SavableState& state, const RunPosition& pos, const nlohmann::json& model_config,
                               uint64_t seed, const std::vector<ExtraState>& extra, const std::string& best_note) {
  CHECK_MSG(&state == &state_, "a TrainCheckpointer saves the state it was made for");
  if (writer_->in_flight()) {
    // A save of the best evaluation waits rather than being skipped: it is not taken again.
    if (options_.skip_if_busy && best_note.empty()) {
      LOG_INFO("checkpoint: step {} skipped, the save of an earlier step is still being written", pos.step);
      return false;
    }
    Status previous = writer_->wait();
    if (!previous.ok()) LOG_WARN("checkpoint: the previous save failed: {}", previous.message());
  }
  RETURN_IF_ERROR(state_.capture());
  ckpt::SaveRequest req;
  req.dir = options_.dir;
  req.step = pos.step;
  req.best_note = best_note;
  const ckpt::ShardedSave& shard = options_.shard;
  req.shard = shard;
  req.regions.push_back(make_region(ckpt::TensorKind::kParam, kSavedKinds[0], layout_, state_));
  req.regions.push_back(make_region(ckpt::TensorKind::kAdamM, kSavedKinds[1], layout_, state_));
  req.regions.push_back(make_region(ckpt::TensorKind::kAdamV, kSavedKinds[2], layout_, state_));
  if (!extra.empty() && shard.rank == 0) {
    // The writer waited for above no longer reads extra_values_.
    extra_values_.clear();
    ckpt::Region r;
    r.kind = ckpt::TensorKind::kState;
    for (const ExtraState& e : extra) {
      r.tensors.push_back({e.name, {static_cast<int64_t>(e.values.size())}, ckpt::DType::kF32,
                           extra_values_.size() * sizeof(float)});
      extra_values_.insert(extra_values_.end(), e.values.begin(), e.values.end());
    }
    r.data = extra_values_.data();
    r.size = extra_values_.size() * sizeof(float);
    req.regions.push_back(std::move(r));
  }
  req.manifest.strata_version = kStrataVersion;
  req.manifest.tokens_seen = pos.tokens_seen;
  req.manifest.data_cursor = {pos.data_epoch, pos.data_index};
  req.manifest.optimizer_step = pos.optimizer_step;
  req.manifest.rng = {{"data_order_seed", seed}};
  req.manifest.lr_schedule = {{"step", pos.step}};
  req.manifest.model_config = model_config;
  req.manifest.layout = {{"kind", "flat fp32 per tensor"}, {"tensors", layout_.tensors().size()}};
  if (shard.sharded())
    req.manifest.layout["sharding"] = {{"world_size", shard.world}, {"by", "element ranges"}};
  if (shard.sharded() && options_.expert_groups > 1)
    req.manifest.layout["sharding"]["expert_parallel"] = options_.expert_groups;
  req.manifest.precision = options_.recipe;
  ASSIGN_OR_RETURN(ckpt::SaveStart started, writer_->begin_save(req));
  return started == ckpt::SaveStart::kStarted;
}

namespace {

Status check_same_model(const ckpt::CheckpointReader& reader, const nlohmann::json& model_config,
                        const model::ParamLayout& layout) {
  const std::string context = "resuming from " + reader.step_dir();
  RETURN_IF_ERROR(compare_model_configs(reader.manifest().fields.model_config, model_config).with_context(context));
  return check_checkpoint_tensors(reader, layout, context, kOtherModel);
}

}  // namespace

bool frozen_tensors_saved(const ckpt::CheckpointReader& reader, const model::ParamLayout& layout) {
  for (const auto& t : layout.tensors())
    if (t.frozen && reader.find(ckpt::qualified_name(ckpt::TensorKind::kParam, t.name)) == nullptr) return false;
  return true;
}

Status check_checkpoint_tensors(const ckpt::CheckpointReader& reader, const model::ParamLayout& layout,
                                const std::string& context, const std::string& hint) {
  std::set<std::string> expected;
  const bool frozen_saved = frozen_tensors_saved(reader, layout);
  for (const auto& t : layout.tensors()) {
    if (t.frozen && !frozen_saved) continue;  // not saved: it comes from the run's source again
    for (ckpt::TensorKind kind : {ckpt::TensorKind::kParam, ckpt::TensorKind::kAdamM, ckpt::TensorKind::kAdamV}) {
      const std::string q = ckpt::qualified_name(kind, t.name);
      expected.insert(q);
      RETURN_IF_ERROR(reader.check_f32(q, static_cast<uint64_t>(t.numel)).with_context(context));
      const ckpt::SavedTensor* saved = reader.find(q);
      if (saved->shape != t.shape) {
        return Status::InvalidArgument(context + ": tensor '" + q + "' has shape " + shape_text(saved->shape) +
                                       " in the checkpoint but " + shape_text(t.shape) + " in this model" + hint);
      }
    }
  }
  for (const ckpt::SavedTensor& saved : reader.tensors()) {
    if (saved.kind == ckpt::TensorKind::kState || expected.count(saved.name) > 0) continue;
    return Status::InvalidArgument(context + ": the checkpoint has tensor '" + saved.name + "', which this model lacks" +
                                   hint);
  }
  return Status::OK();
}

Status compare_model_configs(const nlohmann::json& saved, const nlohmann::json& run) {
  if (!saved.is_object() || saved.empty())
    return Status::InvalidArgument("the checkpoint records no model config, so it cannot be checked against this run's");
  // torch_dtype is the precision the weights came in (what an export keeps), not what the
  // tensors mean: the checkpoint holds the fp32 master either way. Where frozen tensors come from
  // is compared apart (below).
  auto compared = [](const std::string& key) { return key != "torch_dtype" && key != "strata_frozen_from"; };
  for (auto it = run.begin(); it != run.end(); ++it) {
    if (!compared(it.key())) continue;
    // Written before checkpoints recorded it (they saved every tensor, the frozen ones too).
    if (it.key() == "strata_trains_mtp" && !saved.contains(it.key())) continue;
    auto s = saved.find(it.key());
    if (s == saved.end())
      return Status::InvalidArgument("the model config key '" + it.key() + "' (" + ckpt::quote_untrusted(it->dump(), 64) +
                                     " in this run) is missing from the checkpoint's" + kOtherModel);
    if (*s != *it)
      return Status::InvalidArgument("the model config key '" + it.key() + "' is " + ckpt::quote_untrusted(it->dump(), 64) +
                                     " in this run but " + ckpt::quote_untrusted(s->dump(), 64) + " in the checkpoint" +
                                     kOtherModel);
  }
  for (auto it = saved.begin(); it != saved.end(); ++it) {
    if (compared(it.key()) && !run.contains(it.key()))
      return Status::InvalidArgument("the checkpoint's model config has key " + ckpt::quote_untrusted(it.key(), 64) +
                                     ", which this run's lacks" + kOtherModel);
  }
  // The frozen tensors' source: the same model (its fingerprint) or the same random init; the
  // path may differ (another mount, a moved copy).
  const auto saved_from = saved.find("strata_frozen_from");
  const auto run_from = run.find("strata_frozen_from");
  if (saved_from != saved.end() && run_from != run.end()) {
    for (const char* key : {"tensors_xxh3", "init_seed"}) {
      if (saved_from->value(key, nlohmann::json()) == run_from->value(key, nlohmann::json())) continue;
      const bool init = saved_from->contains("init_seed") || run_from->contains("init_seed");
      return Status::InvalidArgument(
          init ? fmt::format("the checkpoint's frozen weights are {}, this run's {}: start the run from the same "
                             "weights (model.from) or the same random init (train.seed)",
                             ckpt::quote_untrusted(saved_from->dump(), 120), ckpt::quote_untrusted(run_from->dump(), 120))
               : fmt::format("the frozen weights this run reads ({}) are not the model the checkpoint was trained on "
                             "({}): their tensors' fingerprints differ; set model.from to that model",
                             run_from->value("source", std::string("?")),
                             ckpt::quote_untrusted(saved_from->value("source", std::string("?")), 200)));
    }
  }
  return Status::OK();
}

namespace {

// A NaN or Inf read back means the checkpoint holds a diverged state (one written before saves
// refused those, or edited); training from it would only produce NaN.
Status check_finite(const std::string& step_dir, const std::string& qualified, const float* data, int64_t numel) {
  const uint64_t bad = ckpt::count_non_finite(ckpt::DType::kF32, data, static_cast<uint64_t>(numel));
  if (bad == 0) return Status::OK();
  return Status::Corruption("resuming from " + step_dir + ": tensor '" + qualified + "' holds " + std::to_string(bad) +
                            " non-finite values (NaN or Inf); the checkpoint is of a diverged run, resume from an "
                            "earlier step");
}

}  // namespace

Result<RunPosition> restore_checkpoint(const std::string& path, const nlohmann::json& model_config,
                                       const model::ParamLayout& layout, SavableState& state,
                                       std::vector<ExtraState>* extra) {
  ckpt::ReaderOpenOptions ro;
  ro.verify = true;
  ASSIGN_OR_RETURN(std::unique_ptr<ckpt::CheckpointReader> reader, ckpt::CheckpointReader::open(path, ro));
  RETURN_IF_ERROR(check_trainer_fields(reader->manifest(), reader->step_dir() + "/manifest.json"));
  // The model and every tensor's name, size and shape must match before anything is overwritten.
  RETURN_IF_ERROR(check_same_model(*reader, model_config, layout));
  const std::pair<StateKind, ckpt::TensorKind> kinds[] = {{StateKind::kParam, ckpt::TensorKind::kParam},
                                                          {StateKind::kAdamM, ckpt::TensorKind::kAdamM},
                                                          {StateKind::kAdamV, ckpt::TensorKind::kAdamV}};
  Progress progress("loading " + reader->step_dir(), 3 * static_cast<uint64_t>(layout.total_size()) * sizeof(float));
  for (const auto& [state_kind, kind] : kinds) {
    RETURN_IF_ERROR(state.fill_kind(state_kind, [&, kind = kind](const model::TensorSpec& t, float* dst) {
      const std::string q = ckpt::qualified_name(kind, t.name);
      RETURN_IF_ERROR(reader->read_f32(q, dst, static_cast<uint64_t>(t.numel))
                          .with_context("resuming from " + reader->step_dir()));
      progress.add(static_cast<uint64_t>(t.numel) * sizeof(float));
      return check_finite(reader->step_dir(), q, dst, t.numel);
    }, frozen_tensors_saved(*reader, layout) ? TensorSet::kAll : TensorSet::kTrained));
  }
  progress.finish();
  if (extra != nullptr) {
    for (ExtraState& e : *extra) {
      const std::string q = ckpt::qualified_name(ckpt::TensorKind::kState, e.name);
      if (reader->find(q) == nullptr) {
        LOG_WARN("checkpoint {} has no '{}'; it starts from its initial values", reader->step_dir(), q);
        continue;
      }
      RETURN_IF_ERROR(reader->read_f32(q, e.values.data(), e.values.size()).with_context("resuming from " +
                                                                                         reader->step_dir()));
      RETURN_IF_ERROR(check_finite(reader->step_dir(), q, e.values.data(), static_cast<int64_t>(e.values.size())));
    }
  }
  const ckpt::ManifestFields& f = reader->manifest().fields;
  RunPosition pos;
  pos.step = reader->step();
  pos.tokens_seen = f.tokens_seen;
  pos.data_epoch = f.data_cursor.epoch;
  pos.data_index = f.data_cursor.index;
  pos.optimizer_step = f.optimizer_step;
  pos.recipe = f.precision;
  if (const auto it = f.model_config.find("torch_dtype"); it != f.model_config.end() && it->is_string())
    pos.source_torch_dtype = it->get<std::string>();
  state.set_step_count(pos.optimizer_step);
  LOG_INFO("resumed from {} (step {}, {} tokens seen)", reader->step_dir(), pos.step, pos.tokens_seen);
  return pos;
}

}  // namespace strata
