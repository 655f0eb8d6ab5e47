// IoEngine: the one interface for file I/O on the nvme tier, checkpoints and weight loading
// (DESIGN §3.3). Like LevelDB's Env, every disk access of the memory layer goes through it, so
// tests can swap in an engine that injects faults.
//
// Engines:
//   io_uring     (io_uring_engine.h) liburing, O_DIRECT, registered files and buffers,
//                batched submission; the default (make_io_engine picks it when io_uring can
//                be set up).
//   thread pool  (io_threads.h) pread/pwrite on worker threads; chosen automatically when
//                io_uring setup fails, with a log line saying so.
//   faulty       (io_faulty.h) wraps another engine and injects short transfers, -EAGAIN,
//                EIO, ENOSPC and latency through the TransferHook below.
//
// Model: the caller registers files (opened by the caller, usually with O_DIRECT) and may
// register buffers; it submits requests and later waits on their tickets. A request is
// complete only when all `length` bytes moved: engines resubmit short transfers and -EAGAIN
// themselves. A failed request completes with a Status naming the file, the offset and
// strerror; it never yields a silently zero-filled page.
//
// Ownership: the engine does not own file descriptors or buffers; both must stay valid until
// the request's ticket has been waited on. Thread safety: every method of the engines here is
// safe for concurrent use from several threads; a ticket is waited on by one thread, once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"

namespace strata {

enum class IoOp : uint8_t { kRead, kWrite };

struct IoRequest {
  IoOp op = IoOp::kRead;
  int file = -1;          // index returned by register_file
  void* buffer = nullptr;  // host memory; 4 KiB aligned for O_DIRECT files
  uint64_t length = 0;     // bytes; a multiple of 4 KiB for O_DIRECT files
  uint64_t offset = 0;     // file offset; 4 KiB aligned for O_DIRECT files
  uint64_t tag = 0;        // opaque; handed to a TransferHook, otherwise ignored
  // Names the request in a trace (core/trace.h: an asynchronous span from submission to
  // completion, with its bytes) when tracing is on; a static string. Null: not traced.
  const char* trace_name = nullptr;
};

// What a TransferHook lets one kernel-level transfer do.
struct TransferDecision {
  uint64_t length = 0;  // bytes this transfer may move; engines clamp it to 1..want
  int error = 0;        // nonzero: the transfer fails as if the kernel returned -error
};

// Fault-injection point (used by FaultyIoEngine, io_faulty.h). Engines that support it call
// before_transfer() before every transfer they hand to the kernel (one pread/pwrite, one SQE),
// so injected short transfers, -EAGAIN and errors travel through the engines' own retry and
// error paths. `done` bytes of `request` have moved; `want` is what the engine would move now.
// Thread safety: called concurrently from the engine's threads; implementations must be safe
// for concurrent use.
class TransferHook {
 public:
  virtual ~TransferHook() = default;
  virtual TransferDecision before_transfer(const IoRequest& request, uint64_t done, uint64_t want) = 0;
};

// Identifies one submitted request. 0 is never a valid ticket.
using IoTicket = uint64_t;

struct IoEngineOptions {
  std::string kind = "auto";  // auto | io_uring | threads
  uint32_t queue_depth = 32;  // io_uring entries / requests in flight (>= 8 recommended)
  uint32_t threads = 4;       // workers of the thread-pool engine
  // Bytes one kernel transfer (pread/pwrite, SQE) moves at most; a larger request moves in
  // consecutive pieces of this size. Keeps every request streaming at the device's preferred
  // size (block layer max_sectors_kb is often 4 MiB) instead of one huge transfer. 0: 1 GiB.
  uint64_t max_transfer = uint64_t{4} << 20;
};

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  virtual const char* name() const = 0;  // "io_uring", "threads", "faulty(io_uring)"

  // Registers an open descriptor; `path` is only used in messages. Returns the file index.
  virtual Result<int> register_file(int fd, const std::string& path) = 0;
  // Optional: pins a host buffer for faster I/O (io_uring fixed buffers). Requests may use
  // any address whether or not it was registered.
  virtual Status register_buffer(void* base, uint64_t length) { return Status::OK(); }

  // Queues a request; may block while the engine is at its queue depth.
  virtual Result<IoTicket> submit(const IoRequest& request) = 0;
  // Blocks until the request completes; returns its outcome. Each ticket is waited once.
  virtual Status wait(IoTicket ticket) = 0;
  // Non-blocking: true when wait(ticket) would return at once.
  virtual bool done(IoTicket ticket) = 0;

  // Whether requests move bytes to and from the registered files. The planner's counting
  // engine (core/counting_backend.h) does not: the nvme tier then creates no files.
  virtual bool moves_bytes() const { return true; }

  // Installs `hook` (not owned; must outlive the engine or be removed with nullptr). REQUIRES:
  // no request in flight. Returns false when the engine has no hook point.
  virtual bool set_transfer_hook(TransferHook* hook) { return false; }
  // The path given to register_file, for messages; "file #N" when unknown.
  virtual std::string file_path(int file) const { return "file #" + std::to_string(file); }

  // Convenience: submit then wait.
  Status read(int file, void* buffer, uint64_t length, uint64_t offset);
  Status write(int file, const void* buffer, uint64_t length, uint64_t offset);
};

// The Status of a failed transfer: "write of 64.00 MiB at offset 134217728 to PATH failed:
// No space left on device (ENOSPC); free space there or move to a larger disk (...)". `done` bytes had moved before the failure (named when nonzero); `err` is an errno.
Status io_error(IoOp op, uint64_t length, uint64_t offset, const std::string& path, int err,
                uint64_t done = 0);
// The Status of a read that hit end of file after `done` of `length` bytes.
Status io_eof_error(uint64_t length, uint64_t offset, const std::string& path, uint64_t done);
// "ENOSPC" for ENOSPC; "errno 1234" for numbers without a name.
std::string errno_name(int err);

// Creates the engine `options.kind` asks for; "auto" tries io_uring and falls back to the
// thread pool with a log line naming the reason.
Result<std::unique_ptr<IoEngine>> make_io_engine(const IoEngineOptions& options);

}  // namespace strata
