#include "core/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "core/io_engine.h"

namespace strata {
namespace {

// Makes a rename inside `dir` durable.
void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

Status write_all(int fd, const std::string& path, const void* data, int64_t length, int64_t offset) {
  const auto* p = static_cast<const char*>(data);
  int64_t done = 0;
  while (done < length) {
    const ssize_t n = ::pwrite(fd, p + done, static_cast<size_t>(length - done), offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error(IoOp::kWrite, static_cast<uint64_t>(length), static_cast<uint64_t>(offset), path, errno,
                      static_cast<uint64_t>(done));
    }
    done += n;
  }
  return Status::OK();
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

Status AtomicFile::open() {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) return Status::IOError(fmt::format("cannot create {}: {}", tmp_, std::strerror(errno)));
  return Status::OK();
}

Status AtomicFile::write(const void* data, int64_t length) {
  RETURN_IF_ERROR(write_all(fd_, tmp_, data, length, written_));
  written_ += length;
  return Status::OK();
}

Status AtomicFile::commit() {
  if (::fsync(fd_) != 0) return Status::IOError(fmt::format("fsync of {} failed: {}", tmp_, std::strerror(errno)));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return Status::IOError(fmt::format("closing {} failed: {}", tmp_, std::strerror(errno)));
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    return Status::IOError(fmt::format("renaming {} to {} failed: {}", tmp_, path_, std::strerror(errno)));
  }
  committed_ = true;
  fsync_directory(std::filesystem::path(path_).parent_path().string());
  return Status::OK();
}

Status write_file_atomic(const std::string& path, std::string_view contents) {
  AtomicFile out(path);
  RETURN_IF_ERROR(out.open());
  RETURN_IF_ERROR(out.write(contents.data(), static_cast<int64_t>(contents.size())));
  return out.commit();
}

}  // namespace strata
