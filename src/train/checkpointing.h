// Checkpoints of a training run: snapshots of the paged state written asynchronously by
// ckpt::CheckpointWriter, and the restore that resumes a run bit-exactly.
//
// A save copies parameters and Adam moments out of the chunk space into three 4 KiB-aligned
// host buffers (the snapshot) and hands those to the writer, so training continues while the
// files are written, and the checkpoint holds exactly the state after its step. The snapshot
// is the size of the state (fp32 parameters and two moments); the next save waits for the one
// in flight before it reuses the buffers. Not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "ckpt/reader.h"
#include "ckpt/writer.h"
#include "model/params.h"
#include "train/paged_state.h"

namespace strata {

struct CheckpointOptions {
  std::string dir;  // DIR/step-N/ and DIR/latest
  int keep_last = 3;
  bool skip_if_busy = false;
  uint64_t staging_bytes = 64ull << 20;
};

// What a run needs besides the tensors to continue where it stopped.
struct RunPosition {
  int64_t step = 0;
  uint64_t tokens_seen = 0;
  int64_t data_epoch = 0;
  int64_t data_index = 0;
  int64_t optimizer_step = 0;
};

class TrainCheckpointer {
 public:
  TrainCheckpointer(const CheckpointOptions& options, const model::ParamLayout& layout);
  ~TrainCheckpointer();

  // Snapshots `state` and starts writing DIR/step-N. The previous save is waited for first;
  // its failure is logged (the run goes on) and returned by the next wait().
  Status save(PagedState& state, const RunPosition& position, const nlohmann::json& model_config, uint64_t seed);
  // Waits for the save in flight; its outcome.
  Status wait() { return writer_->wait(); }
  bool in_flight() const { return writer_->in_flight(); }
  void cancel() { writer_->cancel(); }

 private:
  CheckpointOptions options_;
  model::ParamLayout layout_;
  std::unique_ptr<ckpt::CheckpointWriter> writer_;
  std::unique_ptr<float, void (*)(void*)> params_, m_, v_;
};

// Restores parameters, Adam moments and the run position from a checkpoint (DIR, DIR/latest
// or DIR/step-N). The model layout must match: a tensor missing or of another size is an error
// naming it. Checksums are verified first.
Result<RunPosition> restore_checkpoint(const std::string& path, const model::ParamLayout& layout, PagedState& state);

}  // namespace strata
