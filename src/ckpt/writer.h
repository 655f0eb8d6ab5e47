// CheckpointWriter: asynchronous, atomic checkpoints (DESIGN §3.6, docs/checkpoint-format.md).
//
// The trainer's state is a list of regions: contiguous host buffers (the flat fp32 parameters,
// Adam m, Adam v, later chunks), each holding tensors at byte offsets. begin_save() plans the
// files and returns; a background thread writes the tensors straight from the live regions
// through an IoEngine with O_DIRECT (staging only what is misaligned), hashes them (xxh3_64),
// and commits:
//   DIR/step-N.tmp/{model,optimizer}.safetensors, fsync each; manifest.json, fsync;
//   fsync step-N.tmp; rename to DIR/step-N; fsync DIR; DIR/latest.tmp := "step-N", fsync,
//   rename over DIR/latest, fsync DIR; then keep-last-K retention.
//
// Copy-on-write: while a save is in flight the trainer must call before_modify(region, b, e)
// before it overwrites bytes [b, e) of a region. If some of those bytes are not yet persisted,
// the writer copies them into its staging memory (when the staging budget allows) or makes the
// trainer wait until they are written (the writer serves that range first). Either way the
// checkpoint holds the state at begin_save() exactly; a stall is bounded by one piece's write.
// Regions with a reader instead of memory are read piece by piece into staging as the writer
// gets to them (or as before_modify asks), so staging stays within its budget whatever the
// size of the state; a reader's error fails the save like a write error.
//
// A save whose tensors hold NaN or Inf fails the same way, naming them (refuse_non_finite).
//
// A failed save (EIO, ENOSPC, ...) logs one line naming the file and the directory, removes its
// step-N.tmp and leaves DIR/latest and every earlier checkpoint untouched; wait()/poll() return
// the error and the writer can save again.
//
// Ownership: the writer owns its background thread, its staging memory and the IoEngine of
// each save (made by `engine_factory` per save, so that files registered with io_uring are
// released when the save ends). Regions are borrowed: they must stay allocated, at the same
// address, until the save ends (in_flight() false, or wait() returned).
// Thread safety: begin_save, in_flight, wait, poll and cancel are meant for one (trainer)
// thread. before_modify may be called from any threads concurrently (e.g. CPU Adam workers),
// but not concurrently with begin_save. last_stats is safe from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ckpt/format.h"
#include "ckpt/fs_util.h"
#include "core/status.h"
#include "core/units.h"
#include "core/io_engine.h"

namespace strata::ckpt {

// Elements [first, first + count) of a tensor flattened row-major: the share of it a
// data-parallel rank owns when ranks shard every tensor by element ranges.
struct TensorSlice {
  uint64_t first = 0;
  uint64_t count = 0;
};

// One tensor inside a region, or (with `slice`) one slice of it. The slices that the ranks of a
// sharded save write of one tensor must tile it exactly, in one dtype, and the tensor must not
// also be saved whole; the reader refuses the checkpoint otherwise (docs/checkpoint-format.md,
// "Slices").
struct RegionTensor {
  std::string name;            // Hugging Face name, without the kind prefix
  std::vector<int64_t> shape;  // row-major, of the whole tensor even with a slice; {} for a scalar
  DType dtype = DType::kF32;
  uint64_t offset = 0;         // byte offset within the region
  // Set: the region holds only elements [first, first + count) of the tensor, `count` elements
  // of `dtype` at `offset`. REQUIRES first + count <= the shape's element count (begin_save
  // refuses it otherwise). An empty slice is not written; one of every element is written as the
  // whole tensor.
  std::optional<TensorSlice> slice;
};

// Copies bytes [offset, offset + length) of a region into dst (e.g. out of a chunk space whose
// chunks move between tiers). Called from the writer's thread and from before_modify callers.
using RegionReader = std::function<Status(uint64_t offset, uint64_t length, void* dst)>;

// Tensors of one kind laid out in a byte range: a contiguous host buffer (`data`), or a range
// only `read` can copy out. Tensors may sit anywhere inside it (gaps allowed) but must not
// overlap.
struct Region {
  TensorKind kind = TensorKind::kParam;
  const void* data = nullptr;  // borrowed; 4 KiB alignment lets pieces be written in place
  uint64_t size = 0;           // bytes
  std::vector<RegionTensor> tensors;
  RegionReader read;           // used when data is null: every piece is read into staging
};

// One rank's share of a sharded save: data-parallel ranks each write the tensors they own into
// files of their own (shard_file_name) in the same DIR/step-N.tmp, and rank 0 commits them all
// under one manifest. world 1: a save of one writer.
struct ShardedSave {
  int rank = 0;
  int world = 1;
  // Called on the writer's thread of every rank, in the same order of saves, once this rank's
  // files are durable (`own` OK, `files` its files) or its save failed. Returns, on rank 0,
  // every rank's files (then it commits), nothing on the others, and an error when any rank's
  // save failed (then rank 0 removes step-N.tmp once every rank has reported).
  std::function<Result<std::map<std::string, FileRecord>>(const Status& own,
                                                         const std::map<std::string, FileRecord>& files)>
      exchange;
  bool sharded() const { return world > 1; }
};

struct SaveRequest {
  std::string dir;  // the checkpoint directory; created when missing
  int64_t step = 0;
  std::vector<Region> regions;  // before_modify's `region` indexes this vector
  ManifestFields manifest;
  ShardedSave shard;
  // Not empty: this save is the best so far. Once it commits, DIR/best names it, with this
  // note (e.g. "eval_loss 3.1002") as the second line, and retention keeps it beside the last.
  std::string best_note;
};

enum class IfBusy : uint8_t {
  kWait,  // begin_save waits for the save in flight, then starts
  kSkip,  // begin_save logs a line and returns SaveStart::kSkippedBusy
};

enum class SaveStart : uint8_t { kStarted, kSkippedBusy };

using IoEngineFactory = std::function<Result<std::unique_ptr<IoEngine>>()>;

struct CheckpointWriterOptions {
  uint64_t staging_bytes = 64 * kMiB;  // alignment staging + copy-on-write copies; >= 64 KiB
  int keep_last = 0;                    // keep the K newest committed steps; 0 keeps all
  IfBusy if_busy = IfBusy::kWait;
  uint32_t max_in_flight = 8;           // write requests outstanding at once
  bool direct_io = true;                // O_DIRECT (falls back to buffered where refused)
  // Count NaN/Inf in every F32/BF16 tensor as it is hashed and fail the save instead of
  // committing it: a diverged state must not replace the last good checkpoint in `latest`, nor
  // push it out through keep_last. Off only for data that is not numbers (benchmarks).
  bool refuse_non_finite = true;
  IoEngineOptions io;                   // used when engine_factory is empty
  IoEngineFactory engine_factory;       // called once per save; empty: make_io_engine(io)
};

// Figures of the last save, for logs, goodput and tests.
struct SaveStats {
  int64_t step = -1;
  uint64_t file_bytes = 0;        // both .safetensors files
  uint64_t direct_bytes = 0;      // written straight from the regions
  uint64_t staged_bytes = 0;      // copied into staging for alignment
  uint64_t cow_copied_bytes = 0;  // copied by before_modify
  uint64_t cow_waits = 0;         // before_modify calls that waited for a write
  double cow_wait_seconds = 0;    // total time before_modify callers waited
  double write_seconds = 0;       // begin_save to data on disk
  double total_seconds = 0;       // begin_save to committed
  std::string engine;             // IoEngine::name()
};

class CheckpointWriter {
 public:
  explicit CheckpointWriter(CheckpointWriterOptions options = {});
  ~CheckpointWriter();  // waits for the save in flight
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Validates the request (InvalidArgument naming the tensor), plans the files and starts the
  // writer's thread, which removes stale DIR/step-*.tmp left by a crash (one log line each),
  // creates DIR/step-N.tmp and its files and writes them. Errors of the request are returned
  // here; everything touching the disk reports through wait()/poll() (and a log line).
  Result<SaveStart> begin_save(const SaveRequest& request);

  // REQUIRES: 0 <= region < regions of the save in flight, begin <= end <= its size. Returns
  // at once when no save is in flight or the bytes are already persisted.
  void before_modify(int region, uint64_t begin, uint64_t end);

  bool in_flight() const;
  // Blocks until the save in flight ends; returns the outcome of the last save (OK when none).
  Status wait();
  // OK while a save runs; once it has ended, its outcome (joins the thread).
  Status poll();
  // Stops the save in flight as soon as its writes in flight complete; it fails with
  // "cancelled" and removes its tmp dir. No-op when idle.
  void cancel();
  // Bytes of the save in flight written so far, and in all; {0, 0} when none runs.
  // Trainer thread only, like in_flight().
  std::pair<uint64_t, uint64_t> save_progress() const;
  SaveStats last_stats() const;

 private:
  struct Job;
  void run(Job* job);
  Status setup(Job* job);
  Status write_data(Job* job);
  Status commit(Job* job);
  void join_locked_out();

  const CheckpointWriterOptions options_;
  std::unique_ptr<Job> job_;           // the save in flight or last ended; trainer thread only
  std::thread thread_;
  std::atomic<bool> running_{false};   // a job's thread has not finished
  std::atomic<bool> cow_active_{false};  // the job's regions may still be needed
  Status last_status_;                 // trainer thread only
  // Staging slots plus one piece of scratch, allocated by the first save and reused (only one
  // save runs at a time).
  std::unique_ptr<char, void (*)(void*)> staging_{nullptr, std::free};
  mutable std::mutex stats_mu_;
  SaveStats stats_;                    // GUARDED_BY(stats_mu_)
};

// Removes the unfinished DIR/step-*.tmp and DIR/step-*.deleting directories (logging each); used
// at the start of every save and of a run with several ranks.
Status remove_stale_tmp_dirs(const std::string& dir);
// The step directory DIR/best names; empty when there is no such file or it is unreadable.
std::string read_best_step(const std::string& dir);
// Deletes committed DIR/step-N directories beyond the `keep_last` newest, never `protect`
// (the one latest names) nor the one DIR/best names. Logs each deletion. Each is first renamed to step-N.deleting (durably)
// and only then removed, so a process killed mid-removal leaves no half-deleted directory under
// a committed name; the next save removes the leftover. `remove` removes a tree (remove_tree; a
// test may pass one that fails part-way).
Status apply_retention(const std::string& dir, int keep_last, const std::string& protect,
                       const std::function<Status(const std::string&)>& remove = remove_tree);

}  // namespace strata::ckpt
