#include "core/counting_backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/units.h"

namespace strata {
namespace {

class CountingStream final : public Stream {
 public:
  void synchronize() override {}
  void wait(Event& /*event*/) override {}
};

class CountingEvent final : public Event {
 public:
  void record(Stream& /*stream*/) override {}
  void synchronize() override {}
  bool query() override { return true; }
};

void raise_peak(std::atomic<uint64_t>& peak, uint64_t now) {
  uint64_t seen = peak.load();
  while (now > seen && !peak.compare_exchange_weak(seen, now)) {
  }
}

}  // namespace

Result<void*> CountingDevice::reserve(uint64_t bytes) {
  // At least a page, so that every allocation has an address of its own.
  void* p = ::mmap(nullptr, std::max<uint64_t>(bytes, 4096), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
  if (p == MAP_FAILED)
    return Status::OutOfMemory("cannot reserve " + format_bytes(bytes) +
                               " of address space for the planner's replay: " + std::strerror(errno));
  return p;
}

void CountingDevice::Space::release(void* ptr, uint64_t bytes) {
  ::munmap(ptr, std::max<uint64_t>(bytes, 4096));
  in_use -= bytes;
}

Result<DeviceAllocation> CountingDevice::allocate(uint64_t bytes) {
  ASSIGN_OR_RETURN(void* p, reserve(bytes));
  raise_peak(peak_, device_.in_use += bytes);
  return DeviceAllocation(p, bytes, &device_);
}

Result<HostAllocation> CountingDevice::allocate_pinned(uint64_t bytes) {
  ASSIGN_OR_RETURN(void* p, reserve(bytes));
  pinned_.in_use += bytes;
  return HostAllocation(p, bytes, &pinned_);
}

std::unique_ptr<Stream> CountingDevice::create_stream() { return std::make_unique<CountingStream>(); }
std::unique_ptr<Event> CountingDevice::create_event() { return std::make_unique<CountingEvent>(); }

void CountingDevice::copy(void* /*dst*/, const void* /*src*/, uint64_t bytes, Stream& /*stream*/,
                          const char* /*trace_name*/) {
  copied_ += bytes;
}

void CountingDevice::fill(void* /*dst*/, uint8_t /*value*/, uint64_t bytes, Stream& /*stream*/) { filled_ += bytes; }

Result<int> CountingIoEngine::register_file(int /*fd*/, const std::string& /*path*/) { return files_++; }

Result<IoTicket> CountingIoEngine::submit(const IoRequest& request) {
  (request.op == IoOp::kRead ? read_ : written_) += request.length;
  return next_ticket_++;
}

}  // namespace strata
