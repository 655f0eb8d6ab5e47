// FaultyIoEngine: wraps a real IoEngine and injects the failures disks produce — short
// transfers, -EAGAIN, EIO, ENOSPC — and added latency, so tests can prove that callers and
// engines handle them (like LevelDB's fault-injection Env).
//
// Faults are injected through the wrapped engine's TransferHook, i.e. before each transfer the
// real engine hands to the kernel. A short transfer really moves fewer bytes (the transfer's
// length is capped), so the wrapped engine's own resubmission path must complete the request;
// an injected -EAGAIN or error travels through its own retry and error reporting, so messages
// name the file and offset exactly as a real failure would.
//
// Determinism: which requests are chosen is drawn from `seed` in submission order (counted per
// op), and every short-transfer length is a hash of (seed, request, bytes done); a single
// submitting thread therefore sees the same faults on every run. ENOSPC depends on the order
// in which writes reach the disk.
//
// Ownership: owns the wrapped engine. Thread safety: all methods are safe for concurrent use.
// IoRequest::tag is overwritten (the wrapper uses it to find a request's plan).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>

#include "core/io_engine.h"

namespace strata {

// How often a fault hits requests of one op: each request with `probability`, and every
// `every`-th request (1-based; 0 = never). Both may be set.
struct FaultRate {
  double probability = 0;
  uint32_t every = 0;
};

struct FaultOptions {
  uint64_t seed = 1;
  // Every transfer of a chosen request moves a random multiple of `granularity` bytes less than
  // asked (when more than `granularity` is asked).
  FaultRate short_read, short_write;
  // The first transfer of a chosen request fails with -EAGAIN (the engine must retry it).
  FaultRate eagain_read, eagain_write;
  // A chosen request fails with EIO once half of it (rounded down to `granularity`) has moved.
  FaultRate eio_read, eio_write;
  // Writes fail with ENOSPC once this many bytes have been written through the engine; the
  // write that crosses the limit moves what fits first (a partial write, then ENOSPC).
  uint64_t enospc_after_bytes = UINT64_MAX;
  // Completions become visible (done()/wait()) no earlier than this after submission.
  std::chrono::microseconds read_latency{0}, write_latency{0};
  // Short and partial transfers are cut at multiples of this (O_DIRECT needs 4 KiB).
  uint64_t granularity = 4096;
};

class FaultyIoEngine final : public IoEngine, private TransferHook {
 public:
  // Counts of injected faults since creation.
  struct Counts {
    uint64_t short_transfers = 0;
    uint64_t eagains = 0;
    uint64_t eios = 0;
    uint64_t enospcs = 0;
  };

  // Fails when `inner` has no TransferHook point.
  static Result<std::unique_ptr<FaultyIoEngine>> create(std::unique_ptr<IoEngine> inner,
                                                        const FaultOptions& options);
  ~FaultyIoEngine() override;
  FaultyIoEngine(const FaultyIoEngine&) = delete;
  FaultyIoEngine& operator=(const FaultyIoEngine&) = delete;

  const char* name() const override { return name_.c_str(); }  // "faulty(io_uring)"
  Result<int> register_file(int fd, const std::string& path) override;
  Status register_buffer(void* base, uint64_t length) override;
  Result<IoTicket> submit(const IoRequest& request) override;
  Status wait(IoTicket ticket) override;
  bool done(IoTicket ticket) override;
  std::string file_path(int file) const override { return inner_->file_path(file); }

  IoEngine& inner() { return *inner_; }
  Counts counts() const;

 private:
  struct Plan {
    bool short_transfers = false;
    bool eagain = false;
    bool eio = false;
  };
  struct Submitted {
    uint64_t tag;
    std::chrono::steady_clock::time_point visible_at;
  };

  FaultyIoEngine(std::unique_ptr<IoEngine> inner, const FaultOptions& options);
  bool draw_locked(const FaultRate& rate, uint64_t count);
  TransferDecision before_transfer(const IoRequest& request, uint64_t done, uint64_t want) override;

  std::unique_ptr<IoEngine> inner_;
  const FaultOptions options_;
  const std::string name_;
  mutable std::mutex mu_;
  std::mt19937_64 rng_;                             // GUARDED_BY(mu_)
  uint64_t reads_ = 0, writes_ = 0;                 // requests seen per op; GUARDED_BY(mu_)
  uint64_t next_tag_ = 1;                           // GUARDED_BY(mu_)
  std::unordered_map<uint64_t, Plan> plans_;        // by tag; GUARDED_BY(mu_)
  std::unordered_map<IoTicket, Submitted> tickets_;  // GUARDED_BY(mu_)
  std::atomic<uint64_t> written_{0};                // bytes granted to writes so far
  std::atomic<uint64_t> short_count_{0}, eagain_count_{0}, eio_count_{0}, enospc_count_{0};
};

// A FaultyIoEngine over a fresh engine of `inner.kind` (make_io_engine), as one value: what a
// test hands to code that takes an IoEngine factory.
Result<std::unique_ptr<IoEngine>> make_faulty_io_engine(const IoEngineOptions& inner, const FaultOptions& faults);

}  // namespace strata
