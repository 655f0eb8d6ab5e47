// A Device and an IoEngine that move nothing: what the planner runs the real chunk space over
// to learn a step's traffic (offload/replay.h). Every decision of the chunk space (slots,
// eviction, prefetch, write-backs) is made as on a real backend; its copies, fills and disk
// requests are only counted, complete at once, and touch no byte.
//
// Memory: allocations are address space reserved with no access (PROT_NONE, nothing committed),
// so a budget of terabytes costs nothing and any code that touched such memory would fault at
// once instead of reading a planner's fiction. Streams run nothing; events are always complete.
//
// Thread safety: as the Device and IoEngine interfaces require (the counters are atomic).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "core/device.h"
#include "core/io_engine.h"

namespace strata {

class CountingDevice final : public Device {
 public:
  CountingDevice() = default;
  DeviceKind kind() const override { return DeviceKind::kCpu; }
  int index() const override { return 0; }
  const std::string& name() const override { return name_; }
  Result<DeviceAllocation> allocate(uint64_t bytes) override;
  uint64_t memory_in_use() const override { return device_.in_use; }
  uint64_t memory_peak() const override { return peak_; }
  uint64_t memory_budget() const override { return kUnlimited; }
  Result<HostAllocation> allocate_pinned(uint64_t bytes) override;
  uint64_t pinned_in_use() const override { return pinned_.in_use; }
  std::unique_ptr<Stream> create_stream() override;
  std::unique_ptr<Event> create_event() override;
  void copy(void* dst, const void* src, uint64_t bytes, Stream& stream, const char* trace_name) override;
  void fill(void* dst, uint8_t value, uint64_t bytes, Stream& stream) override;

  uint64_t copied_bytes() const { return copied_; }
  uint64_t filled_bytes() const { return filled_; }

 private:
  // Gives reserved address space back and counts what is in use, one per memory space.
  struct Space final : MemoryOwner {
    void release(void* ptr, uint64_t bytes) override;
    std::atomic<uint64_t> in_use{0};
  };
  // Reserves `bytes` of inaccessible address space.
  static Result<void*> reserve(uint64_t bytes);

  const std::string name_ = "counting";
  Space device_, pinned_;
  std::atomic<uint64_t> peak_{0};
  std::atomic<uint64_t> copied_{0}, filled_{0};
};

// Requests complete at once with success; nothing is read or written. Files need not exist:
// moves_bytes() tells the nvme tier to number its slots without creating files.
class CountingIoEngine final : public IoEngine {
 public:
  const char* name() const override { return "counting"; }
  bool moves_bytes() const override { return false; }
  Result<int> register_file(int fd, const std::string& path) override;
  Result<IoTicket> submit(const IoRequest& request) override;
  Status wait(IoTicket ticket) override { return (void)ticket, Status::OK(); }
  bool done(IoTicket ticket) override { return (void)ticket, true; }

  uint64_t read_bytes() const { return read_; }
  uint64_t written_bytes() const { return written_; }

 private:
  std::atomic<int> files_{0};
  std::atomic<uint64_t> next_ticket_{1};
  std::atomic<uint64_t> read_{0}, written_{0};
};

}  // namespace strata
