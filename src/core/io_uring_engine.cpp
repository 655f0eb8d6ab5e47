#include "core/io_uring_engine.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/check.h"
#include "core/log.h"
#include "core/trace.h"

namespace strata {
namespace {

constexpr unsigned kFixedFileSlots = 256;
// One SQE moves at most this much (the kernel caps a transfer near 2 GiB anyway).
constexpr uint64_t kMaxSqeBytes = uint64_t{1} << 30;
// Registered buffers are split into iovecs of at most this size (a kernel limit).
constexpr uint64_t kMaxFixedBufferBytes = uint64_t{1} << 30;
constexpr int kMaxRetries = 10000;
constexpr unsigned kReapBatch = 64;

const char* init_hint(int err) {
  switch (err) {
    case ENOSYS:
      return "; the kernel has no io_uring";
    case EPERM:
      return "; io_uring is disabled (sysctl kernel.io_uring_disabled) or blocked by a seccomp policy";
    case ENOMEM:
      return "; RLIMIT_MEMLOCK is too low for the ring (raise `ulimit -l` or lower the queue depth)";
    default:
      return "";
  }
}

}  // namespace

IoUringEngine::IoUringEngine(const IoEngineOptions& options)
    : queue_depth_(options.queue_depth),
      max_transfer_(options.max_transfer > 0 ? std::min(options.max_transfer, kMaxSqeBytes) : kMaxSqeBytes) {}

Result<std::unique_ptr<IoUringEngine>> IoUringEngine::create(const IoEngineOptions& options) {
  if (options.queue_depth == 0) return Status::InvalidArgument("io_uring queue depth must be at least 1");
  std::unique_ptr<IoUringEngine> e(new IoUringEngine(options));
  const int ret = io_uring_queue_init(options.queue_depth, &e->ring_, 0);
  if (ret < 0) {
    return Status::Unimplemented("io_uring_queue_init(" + std::to_string(options.queue_depth) +
                                 ") failed: " + std::strerror(-ret) + " (" + errno_name(-ret) + ")" +
                                 init_hint(-ret));
  }
  e->ring_ready_ = true;
  // A sparse file table lets register_file add descriptors one at a time. Without it every
  // SQE names the plain descriptor, which works everywhere, a little slower.
  if (io_uring_register_files_sparse(&e->ring_, kFixedFileSlots) == 0) {
    e->fixed_files_ = true;
  } else {
    std::vector<int> empty(kFixedFileSlots, -1);
    e->fixed_files_ = io_uring_register_files(&e->ring_, empty.data(), kFixedFileSlots) == 0;
  }
  e->reaper_ = std::thread([raw = e.get()] { raw->completion_loop(); });
  return e;
}

IoUringEngine::~IoUringEngine() {
  if (!ring_ready_) return;
  if (reaper_.joinable()) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return in_flight_ == 0; });
    // A NOP with null user_data tells the completion thread to exit.
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    CHECK(sqe != nullptr);
    io_uring_prep_nop(sqe);
    io_uring_sqe_set_data(sqe, nullptr);
    pending_submit_ = true;
    submit_ring_locked();
    lock.unlock();
    reaper_.join();
  }
  io_uring_queue_exit(&ring_);
}

Result<int> IoUringEngine::register_file(int fd, const std::string& path) {
  if (fd < 0) return Status::InvalidArgument("cannot register " + path + ": it is not open (fd " + std::to_string(fd) + ")");
  std::lock_guard<std::mutex> lock(mu_);
  const int index = static_cast<int>(files_.size());
  int fixed_index = -1;
  if (fixed_files_ && index < static_cast<int>(kFixedFileSlots)) {
    if (io_uring_register_files_update(&ring_, static_cast<unsigned>(index), &fd, 1) == 1) fixed_index = index;
  }
  files_.push_back(File{fd, path, fixed_index});
  return index;
}

std::string IoUringEngine::file_path(int file) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (file < 0 || file >= static_cast<int>(files_.size())) return IoEngine::file_path(file);
  return files_[file].path;
}

Status IoUringEngine::register_buffer(void* base, uint64_t length) {
  if (base == nullptr || length == 0) return Status::InvalidArgument("register_buffer needs a non-empty buffer");
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return in_flight_ == 0; });
  std::vector<iovec> next = buffers_;
  for (uint64_t off = 0; off < length; off += kMaxFixedBufferBytes) {
    next.push_back(iovec{static_cast<char*>(base) + off, std::min(kMaxFixedBufferBytes, length - off)});
  }
  if (!buffers_.empty()) io_uring_unregister_buffers(&ring_);
  const int ret = io_uring_register_buffers(&ring_, next.data(), static_cast<unsigned>(next.size()));
  if (ret == 0) {
    buffers_ = std::move(next);
    return Status::OK();
  }
  // Fall back to the previous set; requests on the new buffer still work, unregistered.
  if (!buffers_.empty() &&
      io_uring_register_buffers(&ring_, buffers_.data(), static_cast<unsigned>(buffers_.size())) != 0) {
    buffers_.clear();
  }
  if (!buffer_warning_logged_) {
    buffer_warning_logged_ = true;
    LOG_WARN("io_uring could not register a {} byte buffer as fixed ({}: {}); using it unregistered{}",
             length, errno_name(-ret), std::strerror(-ret),
             -ret == ENOMEM ? " (raise `ulimit -l` to register pinned memory)" : "");
  }
  return Status::OK();
}

size_t IoUringEngine::fixed_buffer_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return buffers_.size();
}

IoUringEngine::Stats IoUringEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

bool IoUringEngine::set_transfer_hook(TransferHook* hook) {
  std::lock_guard<std::mutex> lock(mu_);
  CHECK_MSG(in_flight_ == 0, "set_transfer_hook with requests in flight");
  hook_ = hook;
  return true;
}

Status IoUringEngine::validate_locked(const IoRequest& r) const {
  if (r.file < 0 || r.file >= static_cast<int>(files_.size())) {
    return Status::InvalidArgument("io request names file index " + std::to_string(r.file) + ", but only " +
                                   std::to_string(files_.size()) + " files are registered");
  }
  if (r.buffer == nullptr && r.length > 0) return Status::InvalidArgument("io request without a buffer");
  return Status::OK();
}

IoTicket IoUringEngine::start_locked(const IoRequest& request) {
  auto ctx = std::make_unique<Context>();
  ctx->ticket = next_ticket_++;
  ctx->request = request;
  if (request.trace_name != nullptr && trace::enabled()) ctx->trace_start_ns = trace::now_ns();
  ctx->file = &files_[request.file];
  Context* raw = ctx.get();
  contexts_.emplace(raw->ticket, std::move(ctx));
  ++stats_.requests;
  if (request.length == 0) {
    raw->complete = true;
    return raw->ticket;
  }
  ++in_flight_;
  prep_locked(raw);
  return raw->ticket;
}

void IoUringEngine::prep_locked(Context* ctx) {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) {  // the SQ ring holds SQEs of an earlier failed enter: flush them
    submit_ring_locked();
    sqe = io_uring_get_sqe(&ring_);
  }
  CHECK_MSG(sqe != nullptr, "io_uring submission queue full with " + std::to_string(in_flight_) + " requests in flight");
  const IoRequest& r = ctx->request;
  uint64_t want = std::min(r.length - ctx->done, max_transfer_);
  // What the engine asks for; a hook's cap below it plays the kernel moving fewer bytes.
  ctx->asked = want;
  ctx->injected = 0;
  if (hook_ != nullptr) {
    const TransferDecision d = hook_->before_transfer(r, ctx->done, want);
    ctx->injected = d.error;
    want = std::clamp<uint64_t>(d.length, 1, want);
  }
  ++stats_.sqes;
  pending_submit_ = true;
  if (ctx->injected != 0) {
    io_uring_prep_nop(sqe);  // completes with 0; handle_cqe substitutes -injected
    io_uring_sqe_set_data(sqe, ctx);
    return;
  }
  char* ptr = static_cast<char*>(r.buffer) + ctx->done;
  const uint64_t offset = r.offset + ctx->done;
  const int fd = ctx->file->fixed_index >= 0 ? ctx->file->fixed_index : ctx->file->fd;
  int buf_index = -1;
  for (size_t i = 0; i < buffers_.size(); ++i) {
    const char* base = static_cast<const char*>(buffers_[i].iov_base);
    if (ptr >= base && ptr + want <= base + buffers_[i].iov_len) {
      buf_index = static_cast<int>(i);
      break;
    }
  }
  const auto len = static_cast<unsigned>(want);
  if (buf_index >= 0) {
    ++stats_.fixed_buffer_sqes;
    if (r.op == IoOp::kRead) {
      io_uring_prep_read_fixed(sqe, fd, ptr, len, offset, buf_index);
    } else {
      io_uring_prep_write_fixed(sqe, fd, ptr, len, offset, buf_index);
    }
  } else if (r.op == IoOp::kRead) {
    io_uring_prep_read(sqe, fd, ptr, len, offset);
  } else {
    io_uring_prep_write(sqe, fd, ptr, len, offset);
  }
  if (ctx->file->fixed_index >= 0) sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data(sqe, ctx);
}

void IoUringEngine::submit_ring_locked() {
  if (!pending_submit_) return;
  for (int attempt = 0;; ++attempt) {
    ++stats_.submit_calls;
    const int ret = io_uring_submit(&ring_);
    if (ret >= 0) break;
    // The SQEs stay in the ring; retry transient refusals, anything else is a broken ring.
    CHECK_MSG((ret == -EINTR || ret == -EAGAIN || ret == -EBUSY) && attempt < kMaxRetries,
              std::string("io_uring_submit failed: ") + std::strerror(-ret));
    std::this_thread::yield();
  }
  pending_submit_ = false;
}

Result<IoTicket> IoUringEngine::submit(const IoRequest& request) {
  std::unique_lock<std::mutex> lock(mu_);
  RETURN_IF_ERROR(validate_locked(request));
  space_cv_.wait(lock, [&] { return in_flight_ < queue_depth_; });
  const IoTicket ticket = start_locked(request);
  submit_ring_locked();
  return ticket;
}

Status IoUringEngine::submit_batch(std::span<const IoRequest> requests, std::vector<IoTicket>* tickets) {
  std::unique_lock<std::mutex> lock(mu_);
  for (const IoRequest& r : requests) RETURN_IF_ERROR(validate_locked(r));
  for (const IoRequest& r : requests) {
    if (in_flight_ >= queue_depth_) {
      submit_ring_locked();  // hand over what is prepared before sleeping
      space_cv_.wait(lock, [&] { return in_flight_ < queue_depth_; });
    }
    tickets->push_back(start_locked(r));
  }
  submit_ring_locked();
  return Status::OK();
}

Status IoUringEngine::wait(IoTicket ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = contexts_.find(ticket);
  CHECK_MSG(it != contexts_.end(), "wait on unknown or already waited io ticket " + std::to_string(ticket));
  Context* ctx = it->second.get();
  done_cv_.wait(lock, [&] { return ctx->complete; });
  Status status = std::move(ctx->status);
  contexts_.erase(it);
  return status;
}

bool IoUringEngine::done(IoTicket ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = contexts_.find(ticket);
  CHECK_MSG(it != contexts_.end(), "done() on unknown or already waited io ticket " + std::to_string(ticket));
  return it->second->complete;
}

void IoUringEngine::complete_locked(Context* ctx, Status status) {
  ctx->status = std::move(status);
  ctx->complete = true;
  --in_flight_;
  if (ctx->trace_start_ns >= 0)
    trace::async_span("io", ctx->request.trace_name, trace::next_id(), ctx->trace_start_ns, trace::now_ns(),
                      {{"bytes", static_cast<double>(ctx->done)}});
}

void IoUringEngine::handle_cqe_locked(Context* ctx, int res, bool* resubmitted) {
  const IoRequest& r = ctx->request;
  if (ctx->injected != 0) res = -ctx->injected;
  if ((res == -EAGAIN || res == -EINTR) && ++ctx->retries <= kMaxRetries) {
    ++stats_.eagain_resubmits;
    prep_locked(ctx);
    *resubmitted = true;
    return;
  }
  if (res < 0) return complete_locked(ctx, io_error(r.op, r.length, r.offset, ctx->file->path, -res, ctx->done));
  if (res == 0) {
    if (r.op == IoOp::kRead) return complete_locked(ctx, io_eof_error(r.length, r.offset, ctx->file->path, ctx->done));
    return complete_locked(ctx, io_error(r.op, r.length, r.offset, ctx->file->path, ENOSPC, ctx->done));
  }
  ctx->retries = 0;
  ctx->done += static_cast<uint64_t>(res);
  if (ctx->done >= r.length) return complete_locked(ctx, Status::OK());
  if (static_cast<uint64_t>(res) < ctx->asked) {
    ++stats_.short_resubmits;
  } else {
    ++stats_.continuations;
  }
  prep_locked(ctx);
  *resubmitted = true;
}

void IoUringEngine::completion_loop() {
  io_uring_cqe* batch[kReapBatch];
  for (;;) {
    io_uring_cqe* first = nullptr;
    const int ret = io_uring_wait_cqe(&ring_, &first);
    if (ret == -EINTR || ret == -EAGAIN) continue;
    CHECK_MSG(ret == 0, std::string("io_uring_wait_cqe failed: ") + std::strerror(-ret));
    std::unique_lock<std::mutex> lock(mu_);
    const unsigned n = io_uring_peek_batch_cqe(&ring_, batch, kReapBatch);
    bool exit = false, resubmitted = false;
    const uint32_t before = in_flight_;
    for (unsigned i = 0; i < n; ++i) {
      auto* ctx = static_cast<Context*>(io_uring_cqe_get_data(batch[i]));
      if (ctx == nullptr) {
        exit = true;
        continue;
      }
      handle_cqe_locked(ctx, batch[i]->res, &resubmitted);
    }
    io_uring_cq_advance(&ring_, n);
    if (resubmitted) submit_ring_locked();
    const bool completed = in_flight_ != before;
    lock.unlock();
    if (completed) {
      space_cv_.notify_all();
      done_cv_.notify_all();
    }
    if (exit) return;
  }
}

}  // namespace strata
