// IoUringEngine: the default IoEngine, on liburing (DESIGN §3.3).
//
// One ring of `queue_depth` entries. Files are registered with the ring (IOSQE_FIXED_FILE) and
// host buffers may be (read_fixed/write_fixed when a transfer lies inside one). submit() and
// submit_batch() prepare SQEs under one lock and submit them in one io_uring_enter; a
// completion thread reaps CQEs in batches and checks every cqe->res: -EAGAIN/-EINTR is
// resubmitted, a short transfer is advanced and the remainder resubmitted, end of file on a
// read and negative results complete the request with a Status naming file, offset and
// strerror. At most queue_depth requests are in flight; submit blocks beyond that.
//
// Ownership: owns the ring and the completion thread; does not own registered descriptors or
// buffers, which must outlive the engine (or at least every request that uses them). A file
// registered with the ring stays referenced by it until the engine is destroyed, so closing
// and unlinking it frees its disk space only then.
// Thread safety: every method is safe for concurrent use. A TransferHook is called with the
// engine's lock held and must not call back into the engine.
#pragma once

#include <liburing.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/io_engine.h"

namespace strata {

class IoUringEngine final : public IoEngine {
 public:
  // Counters since creation; for tests and benchmarks.
  struct Stats {
    uint64_t requests = 0;          // requests submitted
    uint64_t sqes = 0;              // SQEs prepared, resubmissions included
    uint64_t fixed_buffer_sqes = 0;  // SQEs that used read_fixed/write_fixed
    uint64_t continuations = 0;     // next pieces of requests larger than max_transfer
    uint64_t short_resubmits = 0;   // short transfers whose remainder was resubmitted
    uint64_t eagain_resubmits = 0;  // -EAGAIN/-EINTR results resubmitted
    uint64_t submit_calls = 0;      // io_uring_submit calls (batching shows as sqes > calls)
  };

  // Sets up the ring. Fails (Unimplemented, naming the reason) when the kernel refuses
  // io_uring: ENOSYS, EPERM from seccomp or kernel.io_uring_disabled, ENOMEM from a low
  // RLIMIT_MEMLOCK.
  static Result<std::unique_ptr<IoUringEngine>> create(const IoEngineOptions& options);
  ~IoUringEngine() override;  // waits for requests in flight
  IoUringEngine(const IoUringEngine&) = delete;
  IoUringEngine& operator=(const IoUringEngine&) = delete;

  const char* name() const override { return "io_uring"; }
  Result<int> register_file(int fd, const std::string& path) override;
  // Registers [base, base+length) as fixed buffers (split into 1 GiB pieces). Waits until no
  // request is in flight, since the kernel's buffer table is replaced. A kernel refusal
  // (e.g. RLIMIT_MEMLOCK) is logged once and the buffer is simply used unregistered.
  Status register_buffer(void* base, uint64_t length) override;
  Result<IoTicket> submit(const IoRequest& request) override;
  // Submits several requests with as few io_uring_enter calls as the queue depth allows.
  // Validates all first; on error nothing is submitted. Appends one ticket per request.
  Status submit_batch(std::span<const IoRequest> requests, std::vector<IoTicket>* tickets);
  Status wait(IoTicket ticket) override;
  bool done(IoTicket ticket) override;
  bool set_transfer_hook(TransferHook* hook) override;
  std::string file_path(int file) const override;

  bool uses_fixed_files() const { return fixed_files_; }
  size_t fixed_buffer_count() const;
  Stats stats() const;

 private:
  struct File {
    int fd;
    std::string path;
    int fixed_index;  // index in the ring's file table, or -1 to use fd
  };
  // Per-request context; its address is the SQE's user_data.
  struct Context {
    IoTicket ticket = 0;
    IoRequest request;
    const File* file = nullptr;
    uint64_t done = 0;      // bytes moved so far
    uint64_t asked = 0;     // bytes the current SQE asked for
    int retries = 0;        // consecutive -EAGAIN/-EINTR
    int injected = 0;       // errno a TransferHook asked the current SQE to fail with
    bool complete = false;
    Status status;
    int64_t trace_start_ns = -1;  // tracing: when it was submitted
  };

  explicit IoUringEngine(const IoEngineOptions& options);
  Status validate_locked(const IoRequest& request) const;
  IoTicket start_locked(const IoRequest& request);  // REQUIRES: in_flight_ < queue_depth_
  void prep_locked(Context* ctx);
  void submit_ring_locked();
  void complete_locked(Context* ctx, Status status);
  void handle_cqe_locked(Context* ctx, int res, bool* resubmitted);
  void completion_loop();

  const uint32_t queue_depth_;
  const uint64_t max_transfer_;
  io_uring ring_{};
  bool ring_ready_ = false;
  bool fixed_files_ = false;
  mutable std::mutex mu_;
  std::condition_variable space_cv_;  // in_flight_ dropped
  std::condition_variable done_cv_;   // a request completed
  std::deque<File> files_;            // GUARDED_BY(mu_); never shrinks
  std::vector<iovec> buffers_;        // GUARDED_BY(mu_); the registered fixed buffers
  bool buffer_warning_logged_ = false;
  std::unordered_map<IoTicket, std::unique_ptr<Context>> contexts_;  // GUARDED_BY(mu_)
  uint32_t in_flight_ = 0;            // GUARDED_BY(mu_)
  IoTicket next_ticket_ = 1;          // GUARDED_BY(mu_)
  bool pending_submit_ = false;       // SQEs prepared but not yet submitted; GUARDED_BY(mu_)
  TransferHook* hook_ = nullptr;      // GUARDED_BY(mu_)
  Stats stats_;                       // GUARDED_BY(mu_)
  std::thread reaper_;
};

}  // namespace strata
