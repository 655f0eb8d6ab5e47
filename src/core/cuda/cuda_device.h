// The CUDA backend of Device (DESIGN §3.1): cudaStream_t streams, cudaEvent_t events (timing
// disabled; a traced stream times its copies with events of its own), cudaMemcpyAsync copies and cudaHostAlloc pinned memory. Device memory is one
// cudaMalloc made when the device opens (the budget, or free memory less a margin), carved by
// an Arena: no cudaMalloc/cudaFree in the steady state, and a budget below the card's size
// behaves like a smaller card. Plain C++ over the runtime API; compiled only with CUDA on.
// Every method makes its device current on the calling thread first. Thread safety as in
// device.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "core/arena.h"
#include "core/cuda/cuda_timeline.h"
#include "core/device.h"
#include "core/status.h"

namespace strata {

// Number of usable CUDA devices; 0 when there is no device or no driver. Never aborts.
int cuda_device_count();
// The device memory open_device("cuda", index, 0) would take as its whole budget: what is free
// now less the margin left to the driver, without reserving it. InvalidArgument when there is no
// such device, OutOfMemory when too little is free.
Result<uint64_t> cuda_free_budget(int index);
// Makes device `index` the calling thread's current one (what NCCL's communicator uses).
// InvalidArgument when there is no such device.
Status cuda_use_device(int index);

class CudaStream final : public Stream {
 public:
  explicit CudaStream(int device);
  ~CudaStream() override;  // waits for the queued work, then destroys the stream

  void synchronize() override;
  void wait(Event& event) override;
  // Gives the stream a track in traces: the copies queued on it from then on are timed on the
  // GPU (core/cuda/cuda_timeline.h) and shown under `name` while tracing is on.
  void set_trace_name(const char* name) override;
  // For kernel launchers and libraries (cuBLAS, NCCL). Owned by this object.
  cudaStream_t handle() const { return stream_; }
  int device() const { return device_; }
  // Marks the start (a name) or the end (null) of a span of the stream's work on its track;
  // nothing without a track or with tracing off. Safe from any thread.
  void trace_point(const char* category, const char* name);

 private:
  const int device_;
  cudaStream_t stream_ = nullptr;
  std::mutex trace_mu_;  // guards timeline_: copies may be queued from several threads
  std::unique_ptr<CudaTimeline> timeline_;
};

// REQUIRES: stream came from a CUDA device (aborts otherwise).
CudaStream& as_cuda_stream(Stream& stream);

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int device);
  ~CudaEvent() override;

  void record(Stream& stream) override;
  void synchronize() override;
  bool query() override;
  cudaEvent_t handle() const { return event_; }
  int device() const { return device_; }

 private:
  const int device_;
  cudaEvent_t event_ = nullptr;
};

class CudaDevice final : public Device {
 public:
  // Left free when budget_bytes is 0, for the CUDA context, cuBLAS workspaces and NCCL.
  static constexpr uint64_t kReserveMargin = uint64_t{1} << 30;

  // Reserves the device memory region. Errors as in open_device() (device.h).
  static Result<std::unique_ptr<CudaDevice>> create(int index, uint64_t budget_bytes);
  // REQUIRES: every allocation, stream and event made by this device is gone.
  ~CudaDevice() override;

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  int index() const override { return index_; }
  const std::string& name() const override { return name_; }

  Result<DeviceAllocation> allocate(uint64_t bytes) override;
  uint64_t memory_in_use() const override { return device_memory_.arena().in_use(); }
  uint64_t memory_peak() const override { return device_memory_.arena().peak(); }
  uint64_t memory_budget() const override { return device_memory_.arena().capacity(); }

  Result<HostAllocation> allocate_pinned(uint64_t bytes) override;
  uint64_t pinned_in_use() const override;

  std::unique_ptr<Stream> create_stream() override;
  std::unique_ptr<Event> create_event() override;
  using Device::copy;
  void copy(void* dst, const void* src, uint64_t bytes, Stream& stream, const char* trace_name) override;
  void fill(void* dst, uint8_t value, uint64_t bytes, Stream& stream) override;

 private:
  // The single cudaMalloc region and the Arena that carves it.
  class DeviceMemory final : public MemoryOwner {
   public:
    DeviceMemory(int device, void* base, uint64_t bytes, ArenaOptions options);
    ~DeviceMemory();  // frees the region after the arena checked nothing is live
    void release(void* ptr, uint64_t bytes) override { arena_->free(ptr); }
    Arena& arena() { return *arena_; }
    const Arena& arena() const { return *arena_; }

   private:
    const int device_;
    void* const base_;
    std::unique_ptr<Arena> arena_;
  };
  class PinnedMemory final : public MemoryOwner {
   public:
    ~PinnedMemory();
    void release(void* ptr, uint64_t bytes) override;
    void add(uint64_t bytes);
    uint64_t in_use() const;

   private:
    mutable std::mutex mu_;
    uint64_t in_use_ = 0;  // GUARDED_BY(mu_)
  };

  CudaDevice(int index, std::string name, void* base, uint64_t bytes);
  void make_current() const;

  const int index_;
  const std::string name_;
  DeviceMemory device_memory_;
  PinnedMemory pinned_memory_;
};

}  // namespace strata
