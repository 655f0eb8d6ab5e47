// The folders a training run writes: run.dir (config.yaml, metrics.jsonl), ckpt.dir and a
// relative nvme tier. Opening them decides which folder an unnamed run uses, takes one
// writer's lock on each for the life of the run, and refuses to land on another run's files.
//
// - Unnamed runs (run.dir unset) get RUN_DIR/version_N, N one past the highest there, so the
//   same command can run twice; --resume auto continues the newest version instead.
// - A named run.dir that holds another run is refused unless resumed (--resume auto or PATH).
// - --resume auto with nothing to resume (a job killed before its first checkpoint, then
//   requeued) starts from step 1, and keeps the earlier metrics as metrics.restart-K.jsonl.
// - The lock is flock(2) on .strata.lock in each folder, which names the holder's pid and host;
//   the kernel releases it when the holder exits or dies, so a stale lock never blocks a run.
#pragma once

#include <memory>
#include <string>

#include "core/status.h"
#include "train/train_config.h"

namespace strata {

// An exclusive flock on DIR/.strata.lock (the folder is created). Not copyable; movable.
class DirLock {
 public:
  // `what` names the folder in messages ("run.dir"); `created` (when set) tells whether this
  // call made the folder.
  static Result<DirLock> acquire(const std::string& dir, const std::string& what, bool* created = nullptr);
  DirLock(DirLock&& other) noexcept;
  DirLock& operator=(DirLock&& other) noexcept;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  ~DirLock();

 private:
  DirLock() = default;
  int fd_ = -1;
};

class RunDirs {
 public:
  // Resolves t.run_dir (versions), t.ckpt_dir (RUN_DIR/checkpoints unless named) and a relative
  // t.nvme_path (inside run.dir), locks run.dir and ckpt.dir, and checks them against t.resume.
  static Result<RunDirs> open(TrainConfig& t);
  RunDirs(RunDirs&&) noexcept = default;
  RunDirs& operator=(RunDirs&&) noexcept = default;
  ~RunDirs();

  // When the run fails before its first step: removes the folders this run created (a version
  // folder, a run.dir or ckpt.dir that did not exist) unless metrics were written, so a refused
  // run leaves nothing behind.
  void discard_if_unused();

  // The earlier run's metrics.jsonl as set aside by this open (metrics.restart-K.jsonl), or ""
  // when nothing was set aside.
  const std::string& set_aside_metrics() const { return set_aside_metrics_; }

 private:
  RunDirs() = default;
  std::unique_ptr<DirLock> run_lock_, ckpt_lock_;
  std::string created_;       // the run.dir this run made (a version folder, or a new named one), or ""
  std::string created_ckpt_;  // the ckpt.dir this run made, or ""
  std::string set_aside_metrics_;
};

// The name of the lock file in a locked folder (checkpoint listings skip it).
inline constexpr const char* kLockFileName = ".strata.lock";

}  // namespace strata
