// Files written whole or not at all: the bytes go to PATH.tmp, which is fsynced and renamed
// over PATH (and the folder fsynced), so a reader or a crash never sees half a file; a failure
// removes PATH.tmp and leaves PATH as it was.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace strata {

// Owns the descriptor of a file being written; unlinks the temporary file unless committed.
// Errors are IOError naming the file and errno.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {}
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  Status open();
  Status write(const void* data, int64_t length);
  // fsync, close, rename over the final name.
  Status commit();

 private:
  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  int64_t written_ = 0;
  bool committed_ = false;
};

// Writes `contents` to `path` through an AtomicFile.
Status write_file_atomic(const std::string& path, std::string_view contents);

// Writes all of `data` at `offset`, retrying short writes and EINTR.
Status write_all(int fd, const std::string& path, const void* data, int64_t length, int64_t offset);

}  // namespace strata
