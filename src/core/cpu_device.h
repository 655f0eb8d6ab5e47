// The CPU backend of Device (DESIGN §3.1). "Device memory" is host memory under a budget,
// carved by an Arena from one reserved mapping when a budget is given; a Stream is a worker
// thread running its queue in order; an Event is a completion signal that streams and callers
// can block on. Copies are memcpys run on the stream's thread, so overlapping copies and
// compute really run concurrently. Thread safety as in device.h.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "core/arena.h"
#include "core/device.h"

namespace strata {

// Chaos mode (DESIGN §3.1): STRATA_STREAM_CHAOS=SEED, a positive integer; unset, empty or 0
// is off. Anything else is an error naming the variable.
Result<uint64_t> stream_chaos_from_env();
// The longest random delay chaos mode puts before a stream task.
constexpr uint32_t kChaosMaxDelayUs = 200;

// An in-order queue served by one worker thread. Destruction finishes the queued work first.
// With a chaos seed, each task starts after a random delay (0 to kChaosMaxDelayUs), drawn from
// the seed and the stream's name, so that work racing it without a wait finishes first.
class CpuStream final : public Stream {
 public:
  explicit CpuStream(std::string name, uint64_t chaos_seed = 0);
  ~CpuStream() override;

  // Queues `task` behind everything queued so far. Tasks run one at a time on the worker
  // thread; a task must not synchronize its own stream.
  void enqueue(std::function<void()> task);
  void synchronize() override;
  void wait(Event& event) override;
  void set_trace_name(const char* name) override;
  const std::string& name() const { return name_; }

 private:
  void run();

  const std::string name_;
  const uint64_t chaos_seed_;
  std::mutex mu_;
  std::condition_variable work_cv_;          // the worker waits for tasks or stop
  std::condition_variable done_cv_;          // synchronize() waits for finished_ to catch up
  std::deque<std::function<void()>> queue_;  // GUARDED_BY(mu_)
  uint64_t enqueued_ = 0;                    // GUARDED_BY(mu_)
  uint64_t finished_ = 0;                    // GUARDED_BY(mu_)
  bool stopping_ = false;                    // GUARDED_BY(mu_)
  std::thread worker_;                       // last: started once the rest is ready
};

// REQUIRES: stream came from a CPU device (aborts otherwise).
CpuStream& as_cpu_stream(Stream& stream);

class CpuEvent final : public Event {
 public:
  CpuEvent();
  void record(Stream& stream) override;
  void synchronize() override;
  bool query() override;

 private:
  // Shared with the markers and waits queued on streams, which may outlive the event.
  struct State {
    void complete(uint64_t generation);
    void wait_for(uint64_t generation);
    std::mutex mu;
    std::condition_variable cv;
    uint64_t latest = 0;         // generation of the latest record; 0: never recorded
    std::set<uint64_t> pending;  // recorded generations whose marker has not run yet
  };
  std::shared_ptr<State> state_;

  friend class CpuStream;
};

class CpuDevice final : public Device {
 public:
  // budget_bytes 0: unlimited (memory is allocated per request and only counted). chaos_seed:
  // chaos mode for every stream it makes (0 off); by default, what STRATA_STREAM_CHAOS says.
  static Result<std::unique_ptr<CpuDevice>> create(int index, uint64_t budget_bytes);
  static Result<std::unique_ptr<CpuDevice>> create(int index, uint64_t budget_bytes, uint64_t chaos_seed);
  // REQUIRES: every allocation, stream and event made by this device is gone.
  ~CpuDevice() override;

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  int index() const override { return index_; }
  const std::string& name() const override { return name_; }

  Result<DeviceAllocation> allocate(uint64_t bytes) override;
  uint64_t memory_in_use() const override;
  uint64_t memory_peak() const override;
  uint64_t memory_budget() const override;

  Result<HostAllocation> allocate_pinned(uint64_t bytes) override;
  uint64_t pinned_in_use() const override;

  std::unique_ptr<Stream> create_stream() override;
  std::unique_ptr<Event> create_event() override;
  using Device::copy;
  void copy(void* dst, const void* src, uint64_t bytes, Stream& stream, const char* trace_name) override;
  void fill(void* dst, uint8_t value, uint64_t bytes, Stream& stream) override;
  uint64_t chaos_seed() const override { return chaos_seed_; }

  // Typed stream for CPU kernels that queue their own work.
  std::unique_ptr<CpuStream> create_cpu_stream();

 private:
  class Region;
  // Device memory: an Arena over a reserved mapping, or counted per-request allocations.
  class DeviceMemory final : public MemoryOwner {
   public:
    // region null: unlimited. Otherwise an Arena carves `budget` bytes of it.
    DeviceMemory(std::string tier, std::unique_ptr<Region> region, uint64_t budget);
    ~DeviceMemory();
    Result<void*> allocate(uint64_t bytes);
    void release(void* ptr, uint64_t bytes) override;
    uint64_t in_use() const;
    uint64_t peak() const;
    uint64_t budget() const;

   private:
    const std::string tier_;
    std::unique_ptr<Region> region_;  // null when unlimited
    std::unique_ptr<Arena> arena_;    // null when unlimited
    mutable std::mutex mu_;
    uint64_t in_use_ = 0;  // GUARDED_BY(mu_); unlimited mode only
    uint64_t peak_ = 0;    // GUARDED_BY(mu_); unlimited mode only
  };
  // Stand-in for pinned memory: page-aligned host memory, counted.
  class PinnedMemory final : public MemoryOwner {
   public:
    ~PinnedMemory();
    Result<void*> allocate(uint64_t bytes);
    void release(void* ptr, uint64_t bytes) override;
    uint64_t in_use() const;

   private:
    mutable std::mutex mu_;
    uint64_t in_use_ = 0;  // GUARDED_BY(mu_)
  };

  CpuDevice(int index, std::string name, std::unique_ptr<Region> region, uint64_t budget, uint64_t chaos_seed);

  const int index_;
  const uint64_t chaos_seed_;
  const std::string name_;
  DeviceMemory device_memory_;
  PinnedMemory pinned_memory_;
  std::mutex stream_mu_;
  uint64_t streams_created_ = 0;  // GUARDED_BY(stream_mu_); names worker threads
};

}  // namespace strata
