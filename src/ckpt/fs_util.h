// Small POSIX helpers for checkpoints: an owning file descriptor, durable small-file writes,
// directory fsync and rename, and listing the step directories of a checkpoint directory.
// Every failure returns a Status naming the path and errno. Safe for concurrent use on
// different paths.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace strata::ckpt {

// Owns one file descriptor; closes it on destruction. Movable, not copyable.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset();
  // close(2) with its result: a close error after writes can mean lost data.
  Status close_checked(const std::string& path);

 private:
  int fd_ = -1;
};

// Status for a failed system call on `path`: "<what> PATH failed: strerror (ENAME)".
Status sys_error(const std::string& what, const std::string& path, int err);

Result<UniqueFd> open_file(const std::string& path, int flags, int mode = 0644);
Status fsync_path(const std::string& path);  // opens read-only (directories too) and fsyncs
// Writes `content` to `path` (created or truncated) and fsyncs it.
Status write_file_durable(const std::string& path, const std::string& content);
// Whole small file; NotFound when missing.
Result<std::string> read_small_file(const std::string& path, uint64_t max_bytes = 64 << 20);
// rename(2), then fsync of the directory holding `to`.
Status rename_durable(const std::string& from, const std::string& to);
// Swaps two existing paths atomically (renameat2 RENAME_EXCHANGE).
Status exchange_paths(const std::string& a, const std::string& b);
// rm -rf; OK when `path` does not exist, also when entries vanish while it runs.
Status remove_tree(const std::string& path);

struct StepEntry {
  int64_t step = 0;
  std::string name;  // "step-N", "step-N.tmp" or "step-N.deleting"
};
// Directories DIR/step-N (committed) and the unfinished ones, each sorted by step: DIR/step-N.tmp
// (a save under way or interrupted) and DIR/step-N.deleting (a retention removal under way or
// interrupted), which are never read as checkpoints.
Status list_step_dirs(const std::string& dir, std::vector<StepEntry>* committed, std::vector<StepEntry>* tmp);

}  // namespace strata::ckpt
