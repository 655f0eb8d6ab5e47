#include "core/cpu_device.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <random>
#include <thread>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/trace.h"
#include "core/units.h"

namespace strata {
namespace {

constexpr uint64_t kPinnedAlignment = 4096;

// Host allocation that reports failure instead of throwing; `alignment` is a power of two.
void* aligned_host_alloc(uint64_t bytes, uint64_t alignment) {
  if (bytes > UINT64_MAX - alignment) return nullptr;
  return std::aligned_alloc(alignment, round_up(bytes == 0 ? 1 : bytes, alignment));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// CpuStream

Result<uint64_t> stream_chaos_from_env() {
  const char* env = std::getenv("STRATA_STREAM_CHAOS");
  if (env == nullptr || *env == '\0') return uint64_t{0};
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(env, &end, 10);
  if (*end != '\0' || errno != 0 || env[0] == '-' || env[0] == '+') {
    return Status::InvalidArgument(std::string("STRATA_STREAM_CHAOS='") + env +
                                   "' is not a seed (a non-negative integer; 0 turns chaos mode off)");
  }
  return static_cast<uint64_t>(v);
}

CpuStream::CpuStream(std::string name, uint64_t chaos_seed) : name_(std::move(name)), chaos_seed_(chaos_seed) {
  worker_ = std::thread([this] { run(); });
  // Thread names show up in debuggers and perf; Linux allows 15 characters.
  pthread_setname_np(worker_.native_handle(), name_.substr(0, 15).c_str());
}

CpuStream::~CpuStream() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_one();
  worker_.join();
}

void CpuStream::run() {
  // Chaos delays: the same sequence for the same seed and stream name.
  std::mt19937_64 chaos(chaos_seed_ ^ std::hash<std::string>{}(name_));
  std::uniform_int_distribution<uint32_t> delay_us(0, kChaosMaxDelayUs);
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything queued has run
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    if (chaos_seed_ != 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us(chaos)));
    task();
    task = nullptr;  // drop captured state (events, buffers) before reporting completion
    lock.lock();
    ++finished_;
    done_cv_.notify_all();
  }
}

void CpuStream::set_trace_name(const char* name) {
  enqueue([name] { trace::name_thread(name); });
}

void CpuStream::enqueue(std::function<void()> task) {
  CHECK(task != nullptr);
  {
    std::lock_guard<std::mutex> lock(mu_);
    CHECK_MSG(!stopping_, "task queued on stream '" + name_ + "' while it is being destroyed");
    queue_.push_back(std::move(task));
    ++enqueued_;
  }
  work_cv_.notify_one();
}

void CpuStream::synchronize() {
  CHECK_MSG(std::this_thread::get_id() != worker_.get_id(),
            "a task on stream '" + name_ + "' synchronized its own stream (deadlock)");
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t target = enqueued_;
  done_cv_.wait(lock, [&] { return finished_ >= target; });
}

void CpuStream::wait(Event& event) {
  auto* cpu_event = dynamic_cast<CpuEvent*>(&event);
  CHECK_MSG(cpu_event != nullptr, "a CPU stream can only wait on a CPU event");
  std::shared_ptr<CpuEvent::State> state = cpu_event->state_;
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    generation = state->latest;
    if (generation == 0 || state->pending.count(generation) == 0) return;  // already complete
  }
  enqueue([state = std::move(state), generation] {
    {
      std::lock_guard<std::mutex> lock(state->mu);
      if (state->pending.count(generation) == 0) return;
    }
    // Traced only when it blocks: a profile then tells the stream's own work from its waits
    // inside the phases it marks (kernels/cpu/queued_ops.h).
    trace::Span span("wait", "event");
    state->wait_for(generation);
  });
}

CpuStream& as_cpu_stream(Stream& stream) {
  auto* cpu = dynamic_cast<CpuStream*>(&stream);
  CHECK_MSG(cpu != nullptr, "expected a stream of the CPU backend");
  return *cpu;
}

// ---------------------------------------------------------------------------------------------
// CpuEvent

CpuEvent::CpuEvent() : state_(std::make_shared<State>()) {}

void CpuEvent::State::complete(uint64_t generation) {
  {
    std::lock_guard<std::mutex> lock(mu);
    pending.erase(generation);
  }
  cv.notify_all();
}

void CpuEvent::State::wait_for(uint64_t generation) {
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return pending.count(generation) == 0; });
}

void CpuEvent::record(Stream& stream) {
  CpuStream& cpu_stream = as_cpu_stream(stream);
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    generation = ++state_->latest;
    state_->pending.insert(generation);
  }
  cpu_stream.enqueue([state = state_, generation] { state->complete(generation); });
}

void CpuEvent::synchronize() {
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    generation = state_->latest;
  }
  state_->wait_for(generation);
}

bool CpuEvent::query() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->pending.count(state_->latest) == 0;
}

// ---------------------------------------------------------------------------------------------
// CpuDevice memory

// An anonymous mapping reserved up front for a budgeted device. MAP_NORESERVE: pages are
// committed on first touch, so a 24 GiB budget costs nothing until it is used.
class CpuDevice::Region {
 public:
  static Result<std::unique_ptr<Region>> reserve(uint64_t bytes) {
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    if (bytes > UINT64_MAX - page) {
      return Status::InvalidArgument("cpu device budget " + format_bytes(bytes) + " is too large");
    }
    const uint64_t length = round_up(bytes, page);
    void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return Status::OutOfMemory("cannot reserve " + format_bytes(bytes) +
                                 " of address space for the cpu device budget (" +
                                 std::strerror(errno) + "); lower memory.device");
    }
    return std::unique_ptr<Region>(new Region(p, length));
  }
  ~Region() { munmap(base_, length_); }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  void* base() const { return base_; }

 private:
  Region(void* base, uint64_t length) : base_(base), length_(length) {}
  void* base_;
  uint64_t length_;
};

CpuDevice::DeviceMemory::DeviceMemory(std::string tier, std::unique_ptr<Region> region,
                                      uint64_t budget)
    : tier_(std::move(tier)), region_(std::move(region)) {
  if (region_ != nullptr) {
    ArenaOptions options;
    options.tier = tier_;
    options.alignment = kDeviceAlignment;
    arena_ = std::make_unique<Arena>(region_->base(), budget, std::move(options));
  }
}

CpuDevice::DeviceMemory::~DeviceMemory() {
  arena_.reset();  // CHECKs that nothing is live
  CHECK_MSG(in_use_ == 0,
            "tier '" + tier_ + "' destroyed with " + format_bytes(in_use_) + " still allocated");
}

Result<void*> CpuDevice::DeviceMemory::allocate(uint64_t bytes) {
  if (arena_ != nullptr) return arena_->allocate(bytes);
  void* p = aligned_host_alloc(bytes, kDeviceAlignment);
  if (p == nullptr) {
    return Status::OutOfMemory("tier '" + tier_ + "' cannot allocate " + format_bytes(bytes) +
                               ": the host is out of memory with " + format_bytes(in_use()) +
                               " in use; set memory.device or lower the micro-batch");
  }
  std::lock_guard<std::mutex> lock(mu_);
  in_use_ += round_up(bytes == 0 ? 1 : bytes, kDeviceAlignment);
  peak_ = std::max(peak_, in_use_);
  return p;
}

void CpuDevice::DeviceMemory::release(void* ptr, uint64_t bytes) {
  if (arena_ != nullptr) {
    arena_->free(ptr);
    return;
  }
  std::free(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  in_use_ -= round_up(bytes == 0 ? 1 : bytes, kDeviceAlignment);
}

uint64_t CpuDevice::DeviceMemory::in_use() const {
  if (arena_ != nullptr) return arena_->in_use();
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

uint64_t CpuDevice::DeviceMemory::peak() const {
  if (arena_ != nullptr) return arena_->peak();
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

uint64_t CpuDevice::DeviceMemory::budget() const {
  return arena_ != nullptr ? arena_->capacity() : Device::kUnlimited;
}

CpuDevice::PinnedMemory::~PinnedMemory() {
  CHECK_MSG(in_use_ == 0, format_bytes(in_use_) +
                              " of pinned host memory still allocated when "
                              "its cpu device was destroyed");
}

Result<void*> CpuDevice::PinnedMemory::allocate(uint64_t bytes) {
  void* p = aligned_host_alloc(bytes, kPinnedAlignment);
  if (p == nullptr) {
    return Status::OutOfMemory("cannot allocate " + format_bytes(bytes) +
                               " of pinned host memory: the host is out of memory; lower "
                               "memory.host");
  }
  std::lock_guard<std::mutex> lock(mu_);
  in_use_ += bytes;
  return p;
}

void CpuDevice::PinnedMemory::release(void* ptr, uint64_t bytes) {
  std::free(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  in_use_ -= bytes;
}

uint64_t CpuDevice::PinnedMemory::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

// ---------------------------------------------------------------------------------------------
// CpuDevice

Result<std::unique_ptr<CpuDevice>> CpuDevice::create(int index, uint64_t budget_bytes) {
  ASSIGN_OR_RETURN(uint64_t chaos, stream_chaos_from_env());
  return create(index, budget_bytes, chaos);
}

Result<std::unique_ptr<CpuDevice>> CpuDevice::create(int index, uint64_t budget_bytes, uint64_t chaos_seed) {
  if (index < 0) {
    return Status::InvalidArgument("cpu device index must be >= 0, got " + std::to_string(index));
  }
  std::unique_ptr<Region> region;
  if (budget_bytes != 0) {
    ASSIGN_OR_RETURN(region, Region::reserve(budget_bytes));
  }
  std::string name = "cpu:" + std::to_string(index);
  return std::unique_ptr<CpuDevice>(
      new CpuDevice(index, std::move(name), std::move(region), budget_bytes, chaos_seed));
}

CpuDevice::CpuDevice(int index, std::string name, std::unique_ptr<Region> region, uint64_t budget,
                     uint64_t chaos_seed)
    : index_(index),
      chaos_seed_(chaos_seed),
      name_(std::move(name)),
      device_memory_("device (" + name_ + ")", std::move(region), budget) {}

CpuDevice::~CpuDevice() = default;

Result<DeviceAllocation> CpuDevice::allocate(uint64_t bytes) {
  ASSIGN_OR_RETURN(void* p, device_memory_.allocate(bytes));
  return DeviceAllocation(p, bytes, &device_memory_);
}

uint64_t CpuDevice::memory_in_use() const { return device_memory_.in_use(); }
uint64_t CpuDevice::memory_peak() const { return device_memory_.peak(); }
uint64_t CpuDevice::memory_budget() const { return device_memory_.budget(); }

Result<HostAllocation> CpuDevice::allocate_pinned(uint64_t bytes) {
  ASSIGN_OR_RETURN(void* p, pinned_memory_.allocate(bytes));
  return HostAllocation(p, bytes, &pinned_memory_);
}

uint64_t CpuDevice::pinned_in_use() const { return pinned_memory_.in_use(); }

std::unique_ptr<CpuStream> CpuDevice::create_cpu_stream() {
  uint64_t n;
  {
    std::lock_guard<std::mutex> lock(stream_mu_);
    n = streams_created_++;
  }
  return std::make_unique<CpuStream>("strata-c" + std::to_string(index_) + "s" + std::to_string(n), chaos_seed_);
}

std::unique_ptr<Stream> CpuDevice::create_stream() { return create_cpu_stream(); }

std::unique_ptr<Event> CpuDevice::create_event() { return std::make_unique<CpuEvent>(); }

void CpuDevice::copy(void* dst, const void* src, uint64_t bytes, Stream& stream, const char* trace_name) {
  CpuStream& cpu_stream = as_cpu_stream(stream);
  if (bytes == 0) return;
  CHECK(dst != nullptr && src != nullptr);
  cpu_stream.enqueue([dst, src, bytes, trace_name] {
    trace::Span span("copy", trace_name);
    span.arg("bytes", static_cast<double>(bytes));
    std::memcpy(dst, src, bytes);
  });
}

void CpuDevice::fill(void* dst, uint8_t value, uint64_t bytes, Stream& stream) {
  CpuStream& cpu_stream = as_cpu_stream(stream);
  if (bytes == 0) return;
  CHECK(dst != nullptr);
  cpu_stream.enqueue([dst, value, bytes] { std::memset(dst, value, bytes); });
}

}  // namespace strata
