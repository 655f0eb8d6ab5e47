// Checkpoints of a training run: the state (a SavableState) written asynchronously by
// ckpt::CheckpointWriter, and the restore that resumes a run bit-exactly.
//
// For the paged state a save copies nothing up front: the writer reads parameters and Adam
// moments out of the chunk space (wherever each chunk is: device, host or nvme) piece by piece
// into its staging memory (CheckpointOptions::staging_bytes) while training goes on. Before the
// optimizer updates a group it calls the writer's before_modify for that group's bytes, which
// captures what has not been written yet (or waits for it), so the checkpoint holds exactly the
// state after its step while host memory beyond the state stays bounded by the staging budget.
// A state with a host copy (SavableState::capture, e.g. a model resident on a GPU) is written
// straight from that copy. Not thread-safe, except that the hook it installs may run on the
// optimizer's worker.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/reader.h"
#include "ckpt/writer.h"
#include "model/params.h"
#include "model/param_access.h"
#include "train/savable_state.h"

namespace strata {

struct CheckpointOptions {
  std::string dir;  // DIR/step-N/ and DIR/latest
  int keep_last = 3;
  bool skip_if_busy = false;
  uint64_t staging_bytes = 64ull << 20;
  // The run's precision recipe and moment format, recorded in each manifest's "precision"
  // object (the tensors themselves are logical: fp32 master weights and decoded moments).
  nlohmann::json recipe = nlohmann::json::object();
  // Data-parallel ranks: each writes its range of every tensor (SavableState::saved_range) into
  // files of its own, and rank 0 commits them under one manifest (ckpt::ShardedSave). world 1:
  // one writer saves everything.
  ckpt::ShardedSave shard;
  // Expert parallelism (parallel.expert_parallel): each expert's ranges are written by the
  // world / expert_groups ranks holding it; recorded in the manifest for `ckpt inspect` (a
  // resume reads tensors by name and range, whatever the groups).
  int64_t expert_groups = 1;
};

// What a run needs besides the tensors to continue where it stopped.
struct RunPosition {
  int64_t step = 0;
  uint64_t tokens_seen = 0;
  int64_t data_epoch = 0;
  int64_t data_index = 0;
  int64_t optimizer_step = 0;
  // The torch_dtype of the weights the run started from, which an export keeps: the saved
  // model_config's (the trainer writes the source's there); "" when it has none.
  std::string source_torch_dtype;
  // The manifest's "precision" object: the recipe and moment format the checkpoint was written
  // under (empty for checkpoints that predate it).
  nlohmann::json recipe = nlohmann::json::object();
};

class TrainCheckpointer {
 public:
  // Installs the copy-on-write hook in `state`, which must outlive the checkpointer.
  TrainCheckpointer(const CheckpointOptions& options, const model::ParamLayout& layout, SavableState& state,
                    ckpt::IoEngineFactory engine_factory = {});
  ~TrainCheckpointer();

  // Starts writing DIR/step-N from `state` (the state after step N). The previous save is waited
  // for first (or, with skip_if_busy, this one skipped); its failure is logged (the run goes on)
  // and returned by the next wait(). Returns whether the save started (false: skipped).
  // `extra` is copied. A `best_note` marks the save as the run's best (ckpt::SaveRequest).
  Result<bool> save(SavableState& state, const RunPosition& position, const nlohmann::json& model_config, uint64_t seed,
                    const std::vector<ExtraState>& extra = {}, const std::string& best_note = "");
  // Waits for the save in flight; its outcome.
  Status wait() { return writer_->wait(); }
  bool in_flight() const { return writer_->in_flight(); }
  std::pair<uint64_t, uint64_t> save_progress() const { return writer_->save_progress(); }
  void cancel() { writer_->cancel(); }
  ckpt::SaveStats last_stats() const { return writer_->last_stats(); }
  // Time the optimizer spent in the copy-on-write hook of saves in flight (copying bytes not yet
  // written, or waiting for them), cumulative; readable from any thread.
  uint64_t blocked_ns() const { return blocked_ns_.load(std::memory_order_relaxed); }

 private:
  void before_modify(int group);

  CheckpointOptions options_;
  model::ParamLayout layout_;
  SavableState& state_;
  std::unique_ptr<ckpt::CheckpointWriter> writer_;
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> group_ranges_;  // per group: flat byte ranges
  std::vector<float> extra_values_;  // the extra state of the save in flight, back to back
  std::atomic<uint64_t> blocked_ns_{0};
};

// Restores parameters, Adam moments and the run position from a checkpoint (DIR, DIR/latest
// or DIR/step-N). The model must be the checkpoint's: `model_config` (ModelConfig::to_json of
// the run) equal to the manifest's key by key (compare_model_configs), and every tensor present
// with the same shape, none extra; each mismatch is an InvalidArgument naming the key or the
// tensor. Checksums are verified first; a tensor holding NaN or Inf is refused, naming it.
// Tensors are read straight into their chunks, group by group. Each entry of `extra` whose
// name the checkpoint has gets its values (the size must match); one it lacks keeps its values
// and is named in a warning.
Result<RunPosition> restore_checkpoint(const std::string& path, const nlohmann::json& model_config,
                                       const model::ParamLayout& layout, SavableState& state,
                                       std::vector<ExtraState>* extra = nullptr);

// The tensors of a checkpoint against the model `layout` describes, as a resume and `strata
// convert` check them before reading any: every parameter, adam_m and adam_v tensor of the
// layout present as fp32 with exactly its shape (the same element count is not enough: a
// transposed tensor would read as garbage), and no tensor the model lacks (the trainer's state
// aside). Each mismatch is an InvalidArgument starting with `context` and ending with `hint`.
Status check_checkpoint_tensors(const ckpt::CheckpointReader& reader, const model::ParamLayout& layout,
                                const std::string& context, const std::string& hint);

// OK when two model configs (JSON objects) have the same keys with equal values; otherwise an
// InvalidArgument naming the first key that differs, with both values. An empty `saved` is
// refused: there is nothing to check the run against.
// Whether `reader` holds the parameters of every frozen tensor of `layout` (a checkpoint written
// before checkpoints left frozen tensors out, or of a model without any): they are then read from
// it rather than from the run's source.
bool frozen_tensors_saved(const ckpt::CheckpointReader& reader, const model::ParamLayout& layout);
Status compare_model_configs(const nlohmann::json& saved, const nlohmann::json& run);

}  // namespace strata
