// TensorBoard event files: RUN_DIR/tensorboard/events.out.tfevents.<time>.<host>.<pid>, one per
// start of a run, each a TFRecord stream (length, masked CRC-32C of it, the record, masked
// CRC-32C of that) of tensorflow.Event protos: the file version first, then one Summary of
// scalars per step. The protos are small and fixed, so they are encoded here by hand (wire
// format: tags, varints, fixed64 doubles, fixed32 floats) rather than through generated code.
//
// Resuming. A run that starts where event files already are (a resumed or requeued run) starts a
// new file whose first event after the version is a SessionLog START at the step it starts from:
// TensorBoard then drops the steps from there on that the earlier files hold (what the
// interrupted run logged after its checkpoint), so every step has one value. File names carry a time that only grows within a folder, because TensorBoard reads
// the files in name order.
//
// Not thread-safe. Every record is flushed as written, so a crash loses at most the last one.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace strata {

class TensorBoardWriter {
 public:
  // A new event file in `dir` (created) for a run whose first step is `start_step`; the
  // SessionLog START when `dir` holds event files already. IOError naming the file when it
  // cannot be created or written.
  static Result<TensorBoardWriter> open(const std::string& dir, int64_t start_step = 1);
  TensorBoardWriter(TensorBoardWriter&& o) noexcept : file_(std::exchange(o.file_, nullptr)), path_(std::move(o.path_)) {}
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  ~TensorBoardWriter();

  // One event at `step` holding every (tag, value) scalar.
  Status scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  const std::string& path() const { return path_; }

 private:
  TensorBoardWriter(std::FILE* f, std::string path) : file_(f), path_(std::move(path)) {}
  Status record(const std::string& event);
  std::FILE* file_ = nullptr;
  std::string path_;
};

// The protos, for tests: an Event with wall_time and step and the body's field (already encoded).
std::string tensorboard_event(double wall_time, int64_t step, const std::string& body);
// The TFRecord framing of one record.
std::string tfrecord(const std::string& data);

}  // namespace strata
