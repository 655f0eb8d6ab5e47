#include "core/cuda/cuda_device.h"

#include <utility>

#include "core/cuda/cuda_check.h"
#include "core/units.h"

namespace strata {
namespace {

// The region for "whole device" is rounded down to this, the granularity of large cudaMallocs.
constexpr uint64_t kRegionGranularity = uint64_t{2} << 20;

std::string cuda_error_text(cudaError_t error) {
  return std::string(cudaGetErrorName(error)) + ": " + cudaGetErrorString(error);
}

// For calls whose failure the environment causes (no driver, device busy, out of memory):
// the error becomes a Status and the runtime's last-error slot is cleared.
Status cuda_status(cudaError_t error, const std::string& what) {
  if (error == cudaSuccess) return Status::OK();
  (void)cudaGetLastError();
  return Status::Internal(what + " failed (" + cuda_error_text(error) + ")");
}

}  // namespace

Status cuda_use_device(int index) {
  const int count = cuda_device_count();
  if (index < 0 || index >= count)
    return Status::InvalidArgument("GPU " + std::to_string(index) + " does not exist: this node has " +
                                   std::to_string(count) + " visible (one process per GPU: launch at most that many "
                                   "ranks per node)");
  CUDA_CHECK(cudaSetDevice(index));
  return Status::OK();
}

int cuda_device_count() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

// ---------------------------------------------------------------------------------------------
// CudaStream / CudaEvent

CudaStream::CudaStream(int device) : device_(device) {
  CUDA_CHECK(cudaSetDevice(device_));
  // Non-blocking: no implicit ordering with the legacy default stream that libraries may use.
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

CudaStream::~CudaStream() {
  CUDA_CHECK(cudaSetDevice(device_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  timeline_.reset();
  CUDA_CHECK(cudaStreamDestroy(stream_));
}

void CudaStream::synchronize() {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::lock_guard<std::mutex> lock(trace_mu_);
  if (timeline_) timeline_->flush(/*wait=*/false);
}

void CudaStream::set_trace_name(const char* name) {
  std::lock_guard<std::mutex> lock(trace_mu_);
  CUDA_CHECK(cudaSetDevice(device_));
  timeline_ = std::make_unique<CudaTimeline>(name);
}

void CudaStream::trace_point(const char* category, const char* name) {
  if (!trace::enabled()) return;
  std::lock_guard<std::mutex> lock(trace_mu_);
  if (!timeline_) return;
  CUDA_CHECK(cudaSetDevice(device_));
  timeline_->point(stream_, category, name);
  timeline_->flush(/*wait=*/false);  // what has completed meanwhile
}

void CudaStream::wait(Event& event) {
  auto* cuda_event = dynamic_cast<CudaEvent*>(&event);
  CHECK_MSG(cuda_event != nullptr, "a CUDA stream can only wait on a CUDA event");
  CUDA_CHECK(cudaSetDevice(device_));
  CUDA_CHECK(cudaStreamWaitEvent(stream_, cuda_event->handle(), 0));
}

CudaStream& as_cuda_stream(Stream& stream) {
  auto* cuda = dynamic_cast<CudaStream*>(&stream);
  CHECK_MSG(cuda != nullptr, "expected a stream of the CUDA backend");
  return *cuda;
}

CudaEvent::CudaEvent(int device) : device_(device) {
  CUDA_CHECK(cudaSetDevice(device_));
  CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

CudaEvent::~CudaEvent() {
  CUDA_CHECK(cudaSetDevice(device_));
  CUDA_CHECK(cudaEventDestroy(event_));
}

void CudaEvent::record(Stream& stream) {
  CudaStream& cuda_stream = as_cuda_stream(stream);
  CHECK_MSG(cuda_stream.device() == device_,
            "event of cuda:" + std::to_string(device_) +
                " recorded on a stream of cuda:" + std::to_string(cuda_stream.device()));
  CUDA_CHECK(cudaSetDevice(device_));
  CUDA_CHECK(cudaEventRecord(event_, cuda_stream.handle()));
}

void CudaEvent::synchronize() { CUDA_CHECK(cudaEventSynchronize(event_)); }

bool CudaEvent::query() {
  const cudaError_t error = cudaEventQuery(event_);
  if (error == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error; keep it out of the last-error slot
    return false;
  }
  CUDA_CHECK(error);
  return true;
}

// ---------------------------------------------------------------------------------------------
// CudaDevice memory

CudaDevice::DeviceMemory::DeviceMemory(int device, void* base, uint64_t bytes, ArenaOptions options)
    : device_(device),
      base_(base),
      arena_(std::make_unique<Arena>(base, bytes, std::move(options))) {}

CudaDevice::DeviceMemory::~DeviceMemory() {
  arena_.reset();  // CHECKs that nothing is live
  CUDA_CHECK(cudaSetDevice(device_));
  CUDA_CHECK(cudaFree(base_));
}

CudaDevice::PinnedMemory::~PinnedMemory() {
  CHECK_MSG(in_use_ == 0, format_bytes(in_use_) +
                              " of pinned host memory still allocated when "
                              "its CUDA device was destroyed");
}

void CudaDevice::PinnedMemory::add(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  in_use_ += bytes;
}

void CudaDevice::PinnedMemory::release(void* ptr, uint64_t bytes) {
  CUDA_CHECK(cudaFreeHost(ptr));
  std::lock_guard<std::mutex> lock(mu_);
  in_use_ -= bytes;
}

uint64_t CudaDevice::PinnedMemory::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

Result<uint64_t> cuda_free_budget(int index) {
  if (index < 0 || index >= cuda_device_count())
    return Status::InvalidArgument("no CUDA device cuda:" + std::to_string(index) + " is visible");
  RETURN_IF_ERROR(cuda_status(cudaSetDevice(index), "cudaSetDevice(" + std::to_string(index) + ")"));
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  RETURN_IF_ERROR(cuda_status(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
  if (free_bytes <= CudaDevice::kReserveMargin + kRegionGranularity)
    return Status::OutOfMemory("cuda:" + std::to_string(index) + " has only " + format_bytes(free_bytes) +
                               " free of " + format_bytes(total_bytes) + "; free the GPU from other processes");
  return (free_bytes - CudaDevice::kReserveMargin) / kRegionGranularity * kRegionGranularity;
}

// ---------------------------------------------------------------------------------------------
// CudaDevice

Result<std::unique_ptr<CudaDevice>> CudaDevice::create(int index, uint64_t budget_bytes) {
  int count = 0;
  const cudaError_t count_error = cudaGetDeviceCount(&count);
  if (count_error != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return Status::NotFound(
        "device 'cuda' requested but no CUDA device is usable on this machine (" +
        (count_error != cudaSuccess ? cuda_error_text(count_error) : std::string("0 devices")) +
        "); use device \"cpu\" or \"auto\"");
  }
  if (index < 0 || index >= count) {
    return Status::InvalidArgument("device cuda:" + std::to_string(index) + " requested but " +
                                   std::to_string(count) + " CUDA device(s) are visible");
  }
  RETURN_IF_ERROR(
      cuda_status(cudaSetDevice(index), "cudaSetDevice(" + std::to_string(index) + ")"));
  cudaDeviceProp prop{};
  RETURN_IF_ERROR(cuda_status(cudaGetDeviceProperties(&prop, index), "cudaGetDeviceProperties"));
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  RETURN_IF_ERROR(cuda_status(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
  const std::string name = "cuda:" + std::to_string(index) + " (" + prop.name + ")";

  uint64_t region = budget_bytes;
  if (budget_bytes == 0) {
    if (free_bytes <= kReserveMargin + kRegionGranularity) {
      return Status::OutOfMemory(name + " has only " + format_bytes(free_bytes) + " free of " +
                                 format_bytes(total_bytes) + "; free the GPU from other processes");
    }
    region = (free_bytes - kReserveMargin) / kRegionGranularity * kRegionGranularity;
  } else if (budget_bytes > total_bytes) {
    return Status::InvalidArgument("device memory budget " + format_bytes(budget_bytes) +
                                   " exceeds the " + format_bytes(total_bytes) + " of " + name +
                                   "; lower memory.device");
  } else if (budget_bytes > free_bytes) {
    return Status::OutOfMemory("device memory budget " + format_bytes(budget_bytes) +
                               " does not fit: only " + format_bytes(free_bytes) + " of " +
                               format_bytes(total_bytes) + " is free on " + name +
                               "; lower memory.device or free the GPU from other processes");
  }
  void* base = nullptr;
  const cudaError_t malloc_error = cudaMalloc(&base, region);
  if (malloc_error != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::OutOfMemory("cannot reserve " + format_bytes(region) + " of device memory on " +
                               name + " (" + cuda_error_text(malloc_error) +
                               "); lower memory.device");
  }
  return std::unique_ptr<CudaDevice>(new CudaDevice(index, name, base, region));
}

CudaDevice::CudaDevice(int index, std::string name, void* base, uint64_t bytes)
    : index_(index),
      name_(std::move(name)),
      device_memory_(index, base, bytes,
                     ArenaOptions{"device (cuda:" + std::to_string(index) + ")", kDeviceAlignment,
                                  "raise memory.device or lower the micro-batch"}) {}

CudaDevice::~CudaDevice() = default;

void CudaDevice::make_current() const { CUDA_CHECK(cudaSetDevice(index_)); }

Result<DeviceAllocation> CudaDevice::allocate(uint64_t bytes) {
  ASSIGN_OR_RETURN(void* p, device_memory_.arena().allocate(bytes));
  return DeviceAllocation(p, bytes, &device_memory_);
}

Result<HostAllocation> CudaDevice::allocate_pinned(uint64_t bytes) {
  make_current();
  void* p = nullptr;
  // Portable: pinned for every device in the process, not only the current one.
  const cudaError_t error = cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocPortable);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::OutOfMemory("cannot allocate " + format_bytes(bytes) +
                               " of pinned host memory (" + cuda_error_text(error) +
                               "); lower memory.host or raise the locked-memory limit");
  }
  pinned_memory_.add(bytes);
  return HostAllocation(p, bytes, &pinned_memory_);
}

uint64_t CudaDevice::pinned_in_use() const { return pinned_memory_.in_use(); }

std::unique_ptr<Stream> CudaDevice::create_stream() { return std::make_unique<CudaStream>(index_); }

std::unique_ptr<Event> CudaDevice::create_event() { return std::make_unique<CudaEvent>(index_); }

void CudaDevice::copy(void* dst, const void* src, uint64_t bytes, Stream& stream, const char* trace_name) {
  CudaStream& cuda_stream = as_cuda_stream(stream);
  CHECK_MSG(cuda_stream.device() == index_, "copy on " + name_ + " queued on a stream of cuda:" +
                                                std::to_string(cuda_stream.device()));
  if (bytes == 0) return;
  make_current();
  cuda_stream.trace_point("copy", trace_name != nullptr ? trace_name : "copy");
  // cudaMemcpyDefault: unified addressing tells device and host pointers apart.
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cuda_stream.handle()));
  cuda_stream.trace_point("copy", nullptr);
}

void CudaDevice::fill(void* dst, uint8_t value, uint64_t bytes, Stream& stream) {
  CudaStream& cuda_stream = as_cuda_stream(stream);
  CHECK_MSG(cuda_stream.device() == index_, "fill on " + name_ + " queued on a stream of cuda:" +
                                                std::to_string(cuda_stream.device()));
  if (bytes == 0) return;
  make_current();
  CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, cuda_stream.handle()));
}

}  // namespace strata
