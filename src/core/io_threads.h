// ThreadPoolIoEngine: the fallback IoEngine, pread/pwrite on a few worker threads. Chosen by
// make_io_engine when io_uring cannot be set up (seccomp, old kernels, io_uring_disabled).
//
// Each request is handled whole by one worker, which loops until every byte has moved:
// EINTR and EAGAIN are retried, short transfers continue from where they stopped, end of file
// on a read and any other error complete the request with a Status naming file and offset.
//
// Ownership: does not own the registered descriptors or request buffers. Thread safety: all
// methods are safe for concurrent use; the destructor waits for requests in flight.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/io_engine.h"

namespace strata {

class ThreadPoolIoEngine final : public IoEngine {
 public:
  // Starts max(1, options.threads) workers; at most max(queue_depth, threads) requests are
  // queued or running at once (submit blocks beyond that).
  explicit ThreadPoolIoEngine(const IoEngineOptions& options);
  ~ThreadPoolIoEngine() override;
  ThreadPoolIoEngine(const ThreadPoolIoEngine&) = delete;
  ThreadPoolIoEngine& operator=(const ThreadPoolIoEngine&) = delete;

  const char* name() const override { return "threads"; }
  Result<int> register_file(int fd, const std::string& path) override;
  Result<IoTicket> submit(const IoRequest& request) override;
  Status wait(IoTicket ticket) override;
  bool done(IoTicket ticket) override;
  bool set_transfer_hook(TransferHook* hook) override;
  std::string file_path(int file) const override;

 private:
  struct File {
    int fd;
    std::string path;
  };
  struct Pending {
    IoRequest request;
    bool complete = false;
    Status status;
    int64_t trace_start_ns = -1;  // tracing: when it was submitted
  };

  void worker_loop();
  // Moves all bytes of `request`; runs without the lock.
  Status transfer(const IoRequest& request, const File& file) const;

  const uint32_t max_in_flight_;
  const uint64_t max_transfer_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;   // queue_ not empty, or stopping_
  std::condition_variable space_cv_;  // in_flight_ dropped below max_in_flight_
  std::condition_variable done_cv_;   // some request completed
  std::deque<File> files_;            // GUARDED_BY(mu_); never shrinks, so references stay valid
  std::deque<IoTicket> queue_;        // GUARDED_BY(mu_)
  std::unordered_map<IoTicket, Pending> pending_;  // GUARDED_BY(mu_); node-based, stable
  uint32_t in_flight_ = 0;            // queued or running; GUARDED_BY(mu_)
  IoTicket next_ticket_ = 1;          // GUARDED_BY(mu_)
  bool stopping_ = false;             // GUARDED_BY(mu_)
  TransferHook* hook_ = nullptr;      // set while idle
  std::vector<std::thread> workers_;
};

}  // namespace strata
