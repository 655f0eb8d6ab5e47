#include "core/io_threads.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>

#include "core/check.h"
#include "core/trace.h"

namespace strata {
namespace {

// A regular file should not say EAGAIN for long; past this many in a row the request fails.
constexpr int kMaxEagainRetries = 10000;
constexpr uint64_t kDefaultMaxTransfer = uint64_t{1} << 30;

}  // namespace

ThreadPoolIoEngine::ThreadPoolIoEngine(const IoEngineOptions& options)
    : max_in_flight_(std::max({options.queue_depth, options.threads, 1u})),
      max_transfer_(options.max_transfer > 0 ? options.max_transfer : kDefaultMaxTransfer) {
  const uint32_t n = std::max(options.threads, 1u);
  workers_.reserve(n);
  for (uint32_t i = 0; i < n; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPoolIoEngine::~ThreadPoolIoEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;  // workers drain the queue before they exit
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

Result<int> ThreadPoolIoEngine::register_file(int fd, const std::string& path) {
  if (fd < 0) return Status::InvalidArgument("cannot register " + path + ": it is not open (fd " + std::to_string(fd) + ")");
  std::lock_guard<std::mutex> lock(mu_);
  files_.push_back(File{fd, path});
  return static_cast<int>(files_.size() - 1);
}

std::string ThreadPoolIoEngine::file_path(int file) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (file < 0 || file >= static_cast<int>(files_.size())) return IoEngine::file_path(file);
  return files_[file].path;
}

bool ThreadPoolIoEngine::set_transfer_hook(TransferHook* hook) {
  std::lock_guard<std::mutex> lock(mu_);
  CHECK_MSG(in_flight_ == 0, "set_transfer_hook with requests in flight");
  hook_ = hook;
  return true;
}

Result<IoTicket> ThreadPoolIoEngine::submit(const IoRequest& request) {
  std::unique_lock<std::mutex> lock(mu_);
  if (request.file < 0 || request.file >= static_cast<int>(files_.size())) {
    return Status::InvalidArgument("io request names file index " + std::to_string(request.file) +
                                   ", but only " + std::to_string(files_.size()) + " files are registered");
  }
  space_cv_.wait(lock, [&] { return in_flight_ < max_in_flight_; });
  const IoTicket ticket = next_ticket_++;
  pending_.emplace(ticket, Pending{request, false, Status::OK(),
                                   request.trace_name != nullptr && trace::enabled() ? trace::now_ns() : -1});
  queue_.push_back(ticket);
  ++in_flight_;
  lock.unlock();
  work_cv_.notify_one();
  return ticket;
}

Status ThreadPoolIoEngine::wait(IoTicket ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = pending_.find(ticket);
  CHECK_MSG(it != pending_.end(), "wait on unknown or already waited io ticket " + std::to_string(ticket));
  done_cv_.wait(lock, [&] { return it->second.complete; });
  Status status = std::move(it->second.status);
  pending_.erase(it);
  return status;
}

bool ThreadPoolIoEngine::done(IoTicket ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(ticket);
  CHECK_MSG(it != pending_.end(), "done() on unknown or already waited io ticket " + std::to_string(ticket));
  return it->second.complete;
}

void ThreadPoolIoEngine::worker_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping and drained
    const IoTicket ticket = queue_.front();
    queue_.pop_front();
    Pending& p = pending_.at(ticket);  // stable: only wait() erases, after completion
    const IoRequest request = p.request;
    const int64_t trace_start_ns = p.trace_start_ns;
    const File& file = files_[request.file];
    lock.unlock();
    Status status = transfer(request, file);
    if (trace_start_ns >= 0)
      trace::async_span("io", request.trace_name, trace::next_id(), trace_start_ns, trace::now_ns(),
                        {{"bytes", static_cast<double>(request.length)}});
    lock.lock();
    p.status = std::move(status);
    p.complete = true;
    --in_flight_;
    space_cv_.notify_one();
    done_cv_.notify_all();
  }
}

Status ThreadPoolIoEngine::transfer(const IoRequest& r, const File& file) const {
  char* buffer = static_cast<char*>(r.buffer);
  uint64_t done = 0;
  int eagain = 0;
  while (done < r.length) {
    uint64_t want = std::min(r.length - done, max_transfer_);
    int injected = 0;
    if (hook_ != nullptr) {
      const TransferDecision d = hook_->before_transfer(r, done, want);
      injected = d.error;
      want = std::clamp<uint64_t>(d.length, 1, want);
    }
    ssize_t n;
    if (injected != 0) {
      n = -1;
      errno = injected;
    } else if (r.op == IoOp::kRead) {
      n = ::pread(file.fd, buffer + done, want, static_cast<off_t>(r.offset + done));
    } else {
      n = ::pwrite(file.fd, buffer + done, want, static_cast<off_t>(r.offset + done));
    }
    if (n < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err == EAGAIN && ++eagain <= kMaxEagainRetries) {
        if (eagain > 16) std::this_thread::sleep_for(std::chrono::microseconds(100));
        continue;
      }
      return io_error(r.op, r.length, r.offset, file.path, err, done);
    }
    eagain = 0;
    if (n == 0) {
      if (r.op == IoOp::kRead) return io_eof_error(r.length, r.offset, file.path, done);
      // pwrite() of a nonzero length returning 0 means the device took nothing.
      return io_error(r.op, r.length, r.offset, file.path, ENOSPC, done);
    }
    done += static_cast<uint64_t>(n);
  }
  return Status::OK();
}

}  // namespace strata
