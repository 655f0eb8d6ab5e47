// Device: the one interface over the compute backends (DESIGN §3.1). Everything above src/core
// talks to a Device, its Streams and Events, so the whole trainer runs and is tested on the
// CPU backend and runs for real on the CUDA backend.
//
//   Device   memory under a budget (strata's own Arena, no cudaMalloc in steady state),
//            pinned host memory, streams, events, asynchronous copies.
//   Stream   an in-order queue of work. CPU: a worker thread. CUDA: a cudaStream_t.
//   Event    a completion signal recorded on a stream. Like CUDA events: wait() and
//            synchronize() refer to the latest record() made before them; an event never
//            recorded counts as complete.
//
// Ownership: open_device() returns the Device; streams, events and allocations it hands out
// are owned by the caller and must be destroyed before the Device. Destroying a Stream waits
// for the work queued on it. Thread safety: Device methods are safe for concurrent use;
// a Stream or Event may be used from several threads as long as each call is complete in
// itself (as with the CUDA runtime).
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>

#include "core/status.h"

namespace strata {

enum class DeviceKind { kCpu, kCuda };
const char* device_kind_name(DeviceKind kind);  // "cpu", "cuda"

// Takes back memory it handed out. Implemented by the backends; the allocation handles below
// call it from their destructors.
class MemoryOwner {
 public:
  virtual void release(void* ptr, uint64_t bytes) = 0;

 protected:
  ~MemoryOwner() = default;
};

enum class MemorySpace { kDevice, kPinnedHost };

// Move-only owner of one block of memory; gives it back to its owner on destruction.
// Not thread-safe by itself (one owner at a time, like std::unique_ptr).
template <MemorySpace kSpace>
class Allocation {
 public:
  Allocation() = default;
  // Used by backends. REQUIRES: owner outlives this allocation.
  Allocation(void* ptr, uint64_t bytes, MemoryOwner* owner)
      : ptr_(ptr), bytes_(bytes), owner_(owner) {}
  ~Allocation() { reset(); }
  Allocation(Allocation&& other) noexcept { *this = std::move(other); }
  Allocation& operator=(Allocation&& other) noexcept {
    if (this != &other) {
      reset();
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      owner_ = std::exchange(other.owner_, nullptr);
    }
    return *this;
  }
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  uint64_t size() const { return bytes_; }  // bytes requested
  explicit operator bool() const { return ptr_ != nullptr; }

  // Gives the memory back now. REQUIRES: no queued work still uses it.
  void reset() {
    if (owner_ != nullptr) owner_->release(ptr_, bytes_);
    ptr_ = nullptr;
    bytes_ = 0;
    owner_ = nullptr;
  }

 private:
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
  MemoryOwner* owner_ = nullptr;
};

// Memory on the device (CUDA: device pointers; CPU: host memory standing in for it).
using DeviceAllocation = Allocation<MemorySpace::kDevice>;
// Page-locked host memory (CUDA: cudaHostAlloc; CPU: aligned host memory). Copies between it
// and device memory are truly asynchronous.
using HostAllocation = Allocation<MemorySpace::kPinnedHost>;

class Event;

class Stream {
 public:
  virtual ~Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // Blocks until all work queued so far has finished.
  virtual void synchronize() = 0;
  // Work queued after this call starts only once `event`'s latest record has completed.
  // Does not block the caller. REQUIRES: event comes from the same Device.
  virtual void wait(Event& event) = 0;
  // Names the stream's track in a trace (core/trace.h), e.g. "copy host->device". Streams
  // whose work runs on a thread of their own (the CPU backend's) name that thread; the CUDA
  // backend's copies are timed on the GPU with events and shown on a track of that name
  // (core/cuda/cuda_timeline.h).
  virtual void set_trace_name(const char* /*name*/) {}

 protected:
  Stream() = default;
};

class Event {
 public:
  virtual ~Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Marks the current end of `stream`: the event completes when the work queued on it so far
  // has. Re-recording moves the event to the new point. REQUIRES: stream from the same Device.
  virtual void record(Stream& stream) = 0;
  // Blocks until the latest record has completed.
  virtual void synchronize() = 0;
  // True when the latest record has completed (or the event was never recorded).
  virtual bool query() = 0;

 protected:
  Event() = default;
};

// The alignment of every device allocation, on every backend: what cuBLASLt and cuDNN want of
// their operands and workspaces.
inline constexpr uint64_t kDeviceAlignment = 256;

class Device {
 public:
  // memory_budget() of a device whose memory is not capped (the CPU backend with budget 0).
  static constexpr uint64_t kUnlimited = std::numeric_limits<uint64_t>::max();

  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  virtual DeviceKind kind() const = 0;
  virtual int index() const = 0;
  // "cpu:0", "cuda:0 (NVIDIA H100 80GB HBM3)".
  virtual const std::string& name() const = 0;

  // Device memory under the budget, aligned to kDeviceAlignment. OutOfMemory names the tier,
  // the request, the budget and what is in use.
  virtual Result<DeviceAllocation> allocate(uint64_t bytes) = 0;
  virtual uint64_t memory_in_use() const = 0;
  virtual uint64_t memory_peak() const = 0;
  virtual uint64_t memory_budget() const = 0;  // kUnlimited when not capped

  // Pinned host memory; not counted against the device budget.
  virtual Result<HostAllocation> allocate_pinned(uint64_t bytes) = 0;
  virtual uint64_t pinned_in_use() const = 0;

  virtual std::unique_ptr<Stream> create_stream() = 0;
  virtual std::unique_ptr<Event> create_event() = 0;

  // Queues a copy of `bytes` from src to dst on `stream` and returns at once. Either side may
  // be device memory or host memory (pinned host memory for a truly asynchronous copy on
  // CUDA). REQUIRES: both ranges stay valid and untouched by others until the copy completes
  // (synchronize the stream or an event recorded after it); stream from this Device.
  // `trace_name`, a static string, names the copy in a trace where the backend traces copies
  // ("copy" for a move of state between tiers; others, e.g. zero fills, say what they are).
  virtual void copy(void* dst, const void* src, uint64_t bytes, Stream& stream, const char* trace_name) = 0;
  void copy(void* dst, const void* src, uint64_t bytes, Stream& stream) { copy(dst, src, bytes, stream, "copy"); }
  // Queues setting `bytes` bytes at dst (device or host memory) to `value`; returns at once.
  // REQUIRES as for copy.
  virtual void fill(void* dst, uint8_t value, uint64_t bytes, Stream& stream) = 0;

  // Nonzero when the device runs in chaos mode (the CPU backend's STRATA_STREAM_CHAOS=SEED):
  // every stream task waits a random while first, and the chunk space poisons the device slots
  // a chunk leaves, so that a missing wait shows as wrong bits rather than passing by luck.
  virtual uint64_t chaos_seed() const { return 0; }

 protected:
  Device() = default;
};

// Opens a device. kind: "cpu", "cuda" or "auto" (cuda when this build has the CUDA backend and
// the machine has a device, cpu otherwise). budget_bytes caps device memory; 0 means the whole
// device (cuda: free memory less a safety margin; cpu: unlimited). Errors: InvalidArgument for
// an unknown kind, a negative or absent index or a budget larger than the device;
// Unimplemented for "cuda" in a build without CUDA; NotFound for "cuda" on a machine without a
// usable CUDA device; OutOfMemory when the budget cannot be reserved.
Result<std::unique_ptr<Device>> open_device(const std::string& kind, int index,
                                            uint64_t budget_bytes);

}  // namespace strata
