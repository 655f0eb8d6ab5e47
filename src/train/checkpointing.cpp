#include "train/checkpointing.h"

#include <cstdlib>
#include <cstring>

#include "core/log.h"
#include "core/version.h"

namespace strata {
namespace {

float* aligned_floats(int64_t count) {
  const size_t bytes = (static_cast<size_t>(count) * sizeof(float) + 4095) / 4096 * 4096;
  void* p = std::aligned_alloc(4096, bytes);
  CHECK_MSG(p != nullptr, "out of host memory for a checkpoint snapshot of " + std::to_string(bytes) + " bytes");
  return static_cast<float*>(p);
}

ckpt::Region make_region(ckpt::TensorKind kind, const float* data, const model::ParamLayout& layout) {
  ckpt::Region r;
  r.kind = kind;
  r.data = data;
  r.size = static_cast<uint64_t>(layout.total_size()) * sizeof(float);
  for (const auto& t : layout.tensors())
    r.tensors.push_back({t.name, t.shape, ckpt::DType::kF32, static_cast<uint64_t>(t.offset) * sizeof(float)});
  return r;
}

}  // namespace

TrainCheckpointer::TrainCheckpointer(const CheckpointOptions& options, const model::ParamLayout& layout)
    : options_(options),
      layout_(layout),
      params_(aligned_floats(layout.total_size()), std::free),
      m_(aligned_floats(layout.total_size()), std::free),
      v_(aligned_floats(layout.total_size()), std::free) {
  ckpt::CheckpointWriterOptions wo;
  wo.keep_last = options.keep_last;
  wo.if_busy = options.skip_if_busy ? ckpt::IfBusy::kSkip : ckpt::IfBusy::kWait;
  wo.staging_bytes = options.staging_bytes;
  writer_ = std::make_unique<ckpt::CheckpointWriter>(wo);
}

TrainCheckpointer::~TrainCheckpointer() {
  Status st = writer_->wait();
  if (!st.ok()) LOG_WARN("checkpoint: {}", st.message());
}

Status TrainCheckpointer::save(PagedState& state, const RunPosition& pos, const nlohmann::json& model_config,
                               uint64_t seed) {
  if (writer_->in_flight()) {
    if (options_.skip_if_busy) {
      LOG_INFO("checkpoint: step {} skipped, the save of an earlier step is still being written", pos.step);
      return Status::OK();
    }
    Status previous = writer_->wait();
    if (!previous.ok()) LOG_WARN("checkpoint: the previous save failed: {}", previous.message());
  }
  // The snapshot: the state after this step, copied out of the chunk space.
  RETURN_IF_ERROR(state.store_params(params_.get()));
  RETURN_IF_ERROR(state.store_moments(m_.get(), v_.get()));
  ckpt::SaveRequest req;
  req.dir = options_.dir;
  req.step = pos.step;
  req.regions.push_back(make_region(ckpt::TensorKind::kParam, params_.get(), layout_));
  req.regions.push_back(make_region(ckpt::TensorKind::kAdamM, m_.get(), layout_));
  req.regions.push_back(make_region(ckpt::TensorKind::kAdamV, v_.get(), layout_));
  req.manifest.strata_version = kStrataVersion;
  req.manifest.tokens_seen = pos.tokens_seen;
  req.manifest.data_cursor = {pos.data_epoch, pos.data_index};
  req.manifest.optimizer_step = pos.optimizer_step;
  req.manifest.rng = {{"data_order_seed", seed}};
  req.manifest.lr_schedule = {{"step", pos.step}};
  req.manifest.model_config = model_config;
  req.manifest.layout = {{"kind", "flat fp32 per tensor"}, {"tensors", layout_.tensors().size()}};
  ASSIGN_OR_RETURN(ckpt::SaveStart started, writer_->begin_save(req));
  (void)started;
  return Status::OK();
}

Result<RunPosition> restore_checkpoint(const std::string& path, const model::ParamLayout& layout, PagedState& state) {
  ckpt::ReaderOpenOptions ro;
  ro.verify = true;
  ASSIGN_OR_RETURN(std::unique_ptr<ckpt::CheckpointReader> reader, ckpt::CheckpointReader::open(path, ro));
  std::vector<float> params(static_cast<size_t>(layout.total_size()), 0.0f), m(params.size(), 0.0f),
      v(params.size(), 0.0f);
  for (const auto& t : layout.tensors()) {
    const uint64_t n = static_cast<uint64_t>(t.numel);
    RETURN_IF_ERROR(reader->read_f32(ckpt::qualified_name(ckpt::TensorKind::kParam, t.name), params.data() + t.offset, n)
                        .with_context("resuming from " + reader->step_dir()));
    RETURN_IF_ERROR(reader->read_f32(ckpt::qualified_name(ckpt::TensorKind::kAdamM, t.name), m.data() + t.offset, n)
                        .with_context("resuming from " + reader->step_dir()));
    RETURN_IF_ERROR(reader->read_f32(ckpt::qualified_name(ckpt::TensorKind::kAdamV, t.name), v.data() + t.offset, n)
                        .with_context("resuming from " + reader->step_dir()));
  }
  RETURN_IF_ERROR(state.load_params(params.data()));
  RETURN_IF_ERROR(state.load_moments(m.data(), v.data()));
  const ckpt::ManifestFields& f = reader->manifest().fields;
  RunPosition pos;
  pos.step = reader->step();
  pos.tokens_seen = f.tokens_seen;
  pos.data_epoch = f.data_cursor.epoch;
  pos.data_index = f.data_cursor.index;
  pos.optimizer_step = f.optimizer_step;
  state.set_step_count(pos.optimizer_step);
  LOG_INFO("resumed from {} (step {}, {} tokens seen)", reader->step_dir(), pos.step, pos.tokens_seen);
  return pos;
}

}  // namespace strata
