// IoEngine helpers shared by every engine, and make_io_engine.
#include "core/io_engine.h"

#include <cerrno>
#include <cstring>

#include "core/log.h"
#include "core/units.h"
#include "core/io_threads.h"
#include "core/io_uring_engine.h"

namespace strata {
namespace {

// What the user can do about an errno, or "" when there is nothing specific to say.
const char* advice_for(int err) {
  switch (err) {
    case ENOSPC:
      return "free space there or move to a larger disk (memory.nvme.path for the nvme tier, ckpt.dir for "
             "checkpoints)";
    case EDQUOT:
      return "raise the disk quota or move to another disk (memory.nvme.path for the nvme tier, ckpt.dir for "
             "checkpoints)";
    case EIO:
      return "the device reported an I/O error; check `dmesg` and the disk's health";
    case EINVAL:
      return "O_DIRECT needs 4 KiB-aligned buffers, offsets and lengths";
    case EBADF:
      return "the file is not open, or not open for this kind of access";
    case EFBIG:
      return "the file would exceed the filesystem's size limit";
    case EROFS:
      return "the filesystem is read-only";
    default:
      return "";
  }
}

}  // namespace

std::string errno_name(int err) {
  const char* name = strerrorname_np(err);
  return name != nullptr ? std::string(name) : "errno " + std::to_string(err);
}

Status io_error(IoOp op, uint64_t length, uint64_t offset, const std::string& path, int err,
                uint64_t done) {
  const bool is_read = op == IoOp::kRead;
  std::string msg = std::string(is_read ? "read of " : "write of ") + format_bytes(length) +
                    " at offset " + std::to_string(offset) + (is_read ? " from " : " to ") + path +
                    " failed";
  if (done > 0) {
    msg += " at offset " + std::to_string(offset + done) + " (" + format_bytes(done) + " done)";
  }
  msg += ": " + std::string(std::strerror(err)) + " (" + errno_name(err) + ")";
  const char* advice = advice_for(err);
  if (advice[0] != '\0') msg += std::string("; ") + advice;
  return Status::IOError(std::move(msg));
}

Status io_eof_error(uint64_t length, uint64_t offset, const std::string& path, uint64_t done) {
  return Status::Corruption("read of " + format_bytes(length) + " at offset " +
                            std::to_string(offset) + " from " + path + " failed: end of file after " +
                            format_bytes(done) +
                            "; the file is shorter than the request (truncated, or the offset is wrong)");
}

Status IoEngine::read(int file, void* buffer, uint64_t length, uint64_t offset) {
  IoRequest r;
  r.op = IoOp::kRead;
  r.file = file;
  r.buffer = buffer;
  r.length = length;
  r.offset = offset;
  ASSIGN_OR_RETURN(IoTicket ticket, submit(r));
  return wait(ticket);
}

Status IoEngine::write(int file, const void* buffer, uint64_t length, uint64_t offset) {
  IoRequest r;
  r.op = IoOp::kWrite;
  r.file = file;
  r.buffer = const_cast<void*>(buffer);  // engines never write through a write's buffer
  r.length = length;
  r.offset = offset;
  ASSIGN_OR_RETURN(IoTicket ticket, submit(r));
  return wait(ticket);
}

Result<std::unique_ptr<IoEngine>> make_io_engine(const IoEngineOptions& options) {
  if (options.queue_depth == 0) {
    return Status::InvalidArgument("io queue depth must be at least 1 (8 or more recommended)");
  }
  if (options.kind == "threads") {
    return std::unique_ptr<IoEngine>(std::make_unique<ThreadPoolIoEngine>(options));
  }
  if (options.kind == "io_uring" || options.kind == "auto") {
    Result<std::unique_ptr<IoUringEngine>> uring = IoUringEngine::create(options);
    if (uring.ok()) return std::unique_ptr<IoEngine>(std::move(uring).value());
    if (options.kind == "io_uring") return uring.status();
    LOG_WARN("io_uring is unavailable ({}); using the pread/pwrite thread pool instead",
             uring.status().message());
    return std::unique_ptr<IoEngine>(std::make_unique<ThreadPoolIoEngine>(options));
  }
  return Status::InvalidArgument("unknown io engine '" + options.kind +
                                 "'; expected auto, io_uring or threads");
}

}  // namespace strata
