#include "core/io_faulty.h"

#include <algorithm>
#include <cerrno>
#include <thread>

#include "core/check.h"

namespace strata {
namespace {

// splitmix64: a well-mixed hash, so fault choices do not depend on thread timing.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

FaultyIoEngine::FaultyIoEngine(std::unique_ptr<IoEngine> inner, const FaultOptions& options)
    : inner_(std::move(inner)),
      options_(options),
      name_(std::string("faulty(") + inner_->name() + ")"),
      rng_(options.seed) {}

Result<std::unique_ptr<FaultyIoEngine>> FaultyIoEngine::create(std::unique_ptr<IoEngine> inner,
                                                               const FaultOptions& options) {
  CHECK(inner != nullptr);
  if (options.granularity == 0) return Status::InvalidArgument("fault granularity must be positive");
  std::unique_ptr<FaultyIoEngine> e(new FaultyIoEngine(std::move(inner), options));
  if (!e->inner_->set_transfer_hook(e.get())) {
    return Status::Unimplemented(std::string("engine '") + e->inner_->name() +
                                 "' has no transfer hook, so faults cannot be injected into it");
  }
  return e;
}

FaultyIoEngine::~FaultyIoEngine() {
  // Requests still in flight call the hook; let them finish before the hook goes away.
  std::unordered_map<IoTicket, Submitted> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(tickets_);
  }
  for (const auto& [ticket, s] : left) (void)inner_->wait(ticket);
  inner_->set_transfer_hook(nullptr);
}

Result<int> FaultyIoEngine::register_file(int fd, const std::string& path) {
  return inner_->register_file(fd, path);
}

Status FaultyIoEngine::register_buffer(void* base, uint64_t length) {
  return inner_->register_buffer(base, length);
}

FaultyIoEngine::Counts FaultyIoEngine::counts() const {
  return Counts{short_count_.load(), eagain_count_.load(), eio_count_.load(), enospc_count_.load()};
}

bool FaultyIoEngine::draw_locked(const FaultRate& rate, uint64_t count) {
  bool hit = rate.every > 0 && count % rate.every == 0;
  if (rate.probability > 0) {
    // Always draw, so one fault kind's setting does not shift the others' sequences.
    hit |= std::uniform_real_distribution<double>(0, 1)(rng_) < rate.probability;
  }
  return hit;
}

Result<IoTicket> FaultyIoEngine::submit(const IoRequest& request) {
  IoRequest r = request;
  const bool is_read = r.op == IoOp::kRead;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t count = is_read ? ++reads_ : ++writes_;
    Plan plan;
    plan.short_transfers = draw_locked(is_read ? options_.short_read : options_.short_write, count);
    plan.eagain = draw_locked(is_read ? options_.eagain_read : options_.eagain_write, count);
    plan.eio = draw_locked(is_read ? options_.eio_read : options_.eio_write, count);
    r.tag = next_tag_++;
    plans_[r.tag] = plan;
  }
  // Not under mu_: the inner engine calls before_transfer() with its own lock held.
  Result<IoTicket> ticket = inner_->submit(r);
  std::lock_guard<std::mutex> lock(mu_);
  if (!ticket.ok()) {
    plans_.erase(r.tag);
    return ticket;
  }
  const auto latency = is_read ? options_.read_latency : options_.write_latency;
  tickets_[*ticket] = Submitted{r.tag, std::chrono::steady_clock::now() + latency};
  return ticket;
}

Status FaultyIoEngine::wait(IoTicket ticket) {
  Submitted s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tickets_.find(ticket);
    CHECK_MSG(it != tickets_.end(), "wait on unknown or already waited io ticket " + std::to_string(ticket));
    s = it->second;
    tickets_.erase(it);
  }
  Status status = inner_->wait(ticket);
  std::this_thread::sleep_until(s.visible_at);
  std::lock_guard<std::mutex> lock(mu_);
  plans_.erase(s.tag);
  return status;
}

bool FaultyIoEngine::done(IoTicket ticket) {
  std::chrono::steady_clock::time_point visible_at;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tickets_.find(ticket);
    CHECK_MSG(it != tickets_.end(), "done() on unknown or already waited io ticket " + std::to_string(ticket));
    visible_at = it->second.visible_at;
  }
  return inner_->done(ticket) && std::chrono::steady_clock::now() >= visible_at;
}

TransferDecision FaultyIoEngine::before_transfer(const IoRequest& request, uint64_t done, uint64_t want) {
  const uint64_t g = options_.granularity;
  Plan plan;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(request.tag);
    if (it == plans_.end()) return TransferDecision{want, 0};  // submitted before the hook
    plan = it->second;
    if (plan.eagain) {
      it->second.eagain = false;  // only the first transfer
      ++eagain_count_;
      return TransferDecision{0, EAGAIN};
    }
  }
  uint64_t length = want;
  if (plan.eio) {
    const uint64_t fail_at = request.length / 2 / g * g;
    if (done >= fail_at) {
      ++eio_count_;
      return TransferDecision{0, EIO};
    }
    length = std::min(length, fail_at - done);
  }
  if (plan.short_transfers && length > g) {
    // A multiple of g in [g, length - g], chosen by a hash of (seed, request, done).
    const uint64_t units = length / g;  // >= 1; when length is not a multiple, cut at units*g
    const uint64_t cut = units > 1 ? 1 + mix(options_.seed ^ mix(request.tag) ^ done) % (units - 1) : 0;
    if (cut > 0) {
      length = cut * g;
      ++short_count_;
    }
  }
  if (request.op == IoOp::kWrite && options_.enospc_after_bytes != UINT64_MAX) {
    // Reserve bytes from the remaining space; a write that does not fit moves what does.
    uint64_t used = written_.load();
    for (;;) {
      const uint64_t room = options_.enospc_after_bytes > used ? options_.enospc_after_bytes - used : 0;
      const uint64_t grant = length <= room ? length : room / g * g;
      if (grant == 0) {
        ++enospc_count_;
        return TransferDecision{0, ENOSPC};
      }
      if (written_.compare_exchange_weak(used, used + grant)) {
        length = grant;
        break;
      }
    }
  }
  return TransferDecision{length, 0};
}

Result<std::unique_ptr<IoEngine>> make_faulty_io_engine(const IoEngineOptions& inner, const FaultOptions& faults) {
  ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> engine, make_io_engine(inner));
  ASSIGN_OR_RETURN(std::unique_ptr<FaultyIoEngine> faulty, FaultyIoEngine::create(std::move(engine), faults));
  return std::unique_ptr<IoEngine>(std::move(faulty));
}

}  // namespace strata
