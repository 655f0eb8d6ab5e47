#include "core/cuda/cuda_device.h"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/trace.h"
#include "core/units.h"
#include "kernels/cuda/backend.h"

namespace strata {
namespace {

std::unique_ptr<Device> open_cuda(uint64_t budget) {
  Result<std::unique_ptr<Device>> device = open_device("cuda", 0, budget);
  CHECK_MSG(device.ok(), device.status().to_string());
  return std::move(device).value();
}

TEST(CudaDevice, AutoPicksCudaWhenADeviceExists) {
  Result<std::unique_ptr<Device>> device = open_device("auto", 0, 64 * kMiB);
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  EXPECT_EQ((*device)->kind(), DeviceKind::kCuda);
  EXPECT_EQ((*device)->name().rfind("cuda:0 (", 0), 0u) << (*device)->name();
}

TEST(CudaDevice, BudgetIsOneRegionCarvedWithoutFurtherCudaMalloc) {
  auto device = open_cuda(256 * kMiB);
  EXPECT_EQ(device->memory_budget(), 256 * kMiB);
  size_t free_before = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  std::vector<DeviceAllocation> blocks;
  for (int i = 0; i < 32; ++i) {
    Result<DeviceAllocation> a = device->allocate(4 * kMiB + 1);
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 256, 0u);
    blocks.push_back(std::move(a).value());
  }
  size_t free_after = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
  EXPECT_EQ(free_before, free_after) << "allocations must come from the reserved region";
  EXPECT_GE(device->memory_in_use(), 32 * (4 * kMiB + 1));
  blocks.clear();
  EXPECT_EQ(device->memory_in_use(), 0u);
}

TEST(CudaDevice, ExceedingTheBudgetIsOutOfMemoryNamingTheTier) {
  auto device = open_cuda(64 * kMiB);
  DeviceAllocation a = device->allocate(48 * kMiB).value();
  Result<DeviceAllocation> b = device->allocate(24 * kMiB);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kOutOfMemory);
  const std::string& msg = b.status().message();
  EXPECT_NE(msg.find("device (cuda:0)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("24.00 MiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("48.00 MiB of its 64.00 MiB budget"), std::string::npos) << msg;
}

TEST(CudaDevice, BudgetLargerThanTheCardIsInvalid) {
  size_t free_bytes = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  Result<std::unique_ptr<Device>> device = open_device("cuda", 0, uint64_t{total} * 2);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kInvalidArgument) << device.status().to_string();
}

TEST(CudaDevice, IndexBeyondTheVisibleDevicesIsInvalid) {
  Result<std::unique_ptr<Device>> device = open_device("cuda", cuda_device_count(), 0);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kInvalidArgument);
}

TEST(CudaDevice, HostToDeviceToHostRoundTripOnAStream) {
  auto device = open_cuda(128 * kMiB);
  constexpr uint64_t kBytes = 32 * kMiB + 12345;
  HostAllocation src = device->allocate_pinned(kBytes).value();
  HostAllocation dst = device->allocate_pinned(kBytes).value();
  EXPECT_EQ(device->pinned_in_use(), 2 * kBytes);
  DeviceAllocation dev = device->allocate(kBytes).value();
  auto* s = src.as<unsigned char>();
  for (uint64_t i = 0; i < kBytes; ++i) s[i] = static_cast<unsigned char>(i * 131 + 7);
  std::memset(dst.data(), 0, kBytes);

  auto stream = device->create_stream();
  device->copy(dev.data(), src.data(), kBytes, *stream);
  device->copy(dst.data(), dev.data(), kBytes, *stream);
  stream->synchronize();
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), kBytes), 0);
}

// Upload on one stream, download on another after an event: the download sees the upload.
TEST(CudaDevice, EventOrdersCopiesAcrossStreams) {
  auto device = open_cuda(256 * kMiB);
  constexpr int kN = 16 << 20;  // 64 MiB of floats: long enough to still be in flight
  HostAllocation up = device->allocate_pinned(kN * sizeof(float)).value();
  HostAllocation down = device->allocate_pinned(kN * sizeof(float)).value();
  DeviceAllocation dev = device->allocate(kN * sizeof(float)).value();
  std::iota(up.as<float>(), up.as<float>() + kN, 1.0f);
  std::memset(down.data(), 0, kN * sizeof(float));

  auto upload = device->create_stream();
  auto download = device->create_stream();
  auto uploaded = device->create_event();
  auto downloaded = device->create_event();
  EXPECT_TRUE(uploaded->query());  // never recorded
  device->copy(dev.data(), up.data(), kN * sizeof(float), *upload);
  uploaded->record(*upload);
  download->wait(*uploaded);
  device->copy(down.data(), dev.data(), kN * sizeof(float), *download);
  downloaded->record(*download);
  downloaded->synchronize();
  EXPECT_TRUE(downloaded->query());
  EXPECT_TRUE(uploaded->query());
  EXPECT_EQ(std::memcmp(down.data(), up.data(), kN * sizeof(float)), 0);
}

TEST(CudaDevice, StreamHandleIsUsableByTheRuntime) {
  auto device = open_cuda(16 * kMiB);
  auto stream = device->create_stream();
  DeviceAllocation dev = device->allocate(kMiB).value();
  CUDA_CHECK(cudaMemsetAsync(dev.data(), 0xab, kMiB, as_cuda_stream(*stream).handle()));
  std::vector<unsigned char> host(kMiB, 0);
  device->copy(host.data(), dev.data(), kMiB, *stream);  // pageable destination is allowed
  stream->synchronize();
  for (uint64_t i = 0; i < kMiB; i += 4093) ASSERT_EQ(host[i], 0xab) << i;
}

TEST(CudaDevice, WholeDeviceBudgetLeavesAMargin) {
  size_t free_bytes = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  auto device = open_cuda(0);
  EXPECT_LE(device->memory_budget() + CudaDevice::kReserveMargin, free_bytes);
  EXPECT_GT(device->memory_budget(), 0u);
}

// The spans a trace holds on the track named `track`.
std::vector<trace::Event> track_spans(const char* track) {
  std::vector<trace::Event> out;
  for (const trace::ThreadEvents& t : trace::collect())
    if (t.name == track)
      for (const trace::Event& e : t.events)
        if (e.phase == 'X') out.push_back(e);
  return out;
}

// A named stream's copies are timed on the GPU and shown on its own track, inside the host
// interval that queued and waited for them, in order, each taking time.
TEST(CudaDevice, ANamedStreamsCopiesAreTimedOnItsTrack) {
  auto device = open_cuda(256 * kMiB);
  constexpr uint64_t kBytes = 64 * kMiB;
  HostAllocation host = device->allocate_pinned(kBytes).value();
  DeviceAllocation dev = device->allocate(kBytes).value();
  auto stream = device->create_stream();
  stream->set_trace_name("copy test");
  trace::start();
  const int64_t t0 = trace::now_ns();
  device->copy(dev.data(), host.data(), kBytes, *stream, "up");
  device->copy(host.data(), dev.data(), kBytes, *stream, "down");
  stream->synchronize();
  const int64_t t1 = trace::now_ns();
  const std::vector<trace::Event> spans = track_spans("copy test");
  trace::stop();
  ASSERT_EQ(spans.size(), 2u) << "one span per copy";
  EXPECT_STREQ(spans[0].name, "up");
  EXPECT_STREQ(spans[1].name, "down");
  for (const trace::Event& e : spans) {
    EXPECT_STREQ(e.category, "copy");
    EXPECT_GT(e.dur_ns, 0) << e.name;
    // The anchor's wait ends within microseconds of the GPU instant it stands for.
    EXPECT_GE(e.ts_ns, t0 - 50'000) << e.name;
    EXPECT_LE(e.ts_ns + e.dur_ns, t1 + 50'000) << e.name;
  }
  EXPECT_LE(spans[0].ts_ns + spans[0].dur_ns, spans[1].ts_ns + 1000) << "the stream runs its copies in order";
}

// The CUDA op set's phases are timed on the GPU and shown on the "compute stream" track, which
// profile reports read (train/profile_report.h), as the CPU backend's stream thread shows them.
TEST(CudaDevice, TheComputeStreamsPhasesAreTimedOnItsTrack) {
  auto device = open_cuda(uint64_t{1} << 30);
  Result<kernels::CudaOps> created = kernels::CudaOps::create(*device);
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  kernels::CudaOps& ops = created.value();
  constexpr int64_t kN = int64_t{16} << 20;
  DeviceAllocation a = device->allocate(kN * 2).value(), b = device->allocate(kN * 2).value();
  CUDA_CHECK(cudaMemset(a.data(), 0, kN * 2));
  CUDA_CHECK(cudaMemset(b.data(), 0, kN * 2));
  CUDA_CHECK(cudaDeviceSynchronize());
  auto* pa = static_cast<kernels::cuda::bf16*>(a.data());
  const auto* pb = static_cast<const kernels::cuda::bf16*>(b.data());
  trace::start();
  const int64_t t0 = trace::now_ns();
  ops.trace_phase("forward", 3);
  for (int i = 0; i < 8; ++i) ops.add_inplace(pa, pb, kN);
  ops.trace_phase("backward", 3);
  for (int i = 0; i < 8; ++i) ops.add_inplace(pa, pb, kN);
  ops.trace_phase(nullptr);
  ops.synchronize();
  const int64_t t1 = trace::now_ns();
  const std::vector<trace::Event> spans = track_spans("compute stream");
  trace::stop();
  ASSERT_EQ(spans.size(), 2u) << "one span per phase";
  EXPECT_STREQ(spans[0].name, "forward");
  EXPECT_STREQ(spans[1].name, "backward");
  for (const trace::Event& e : spans) {
    EXPECT_STREQ(e.category, "compute");
    EXPECT_EQ(e.index, 3);
    EXPECT_GT(e.dur_ns, 0) << e.name;
    EXPECT_GE(e.ts_ns, t0 - 50'000) << e.name;
    EXPECT_LE(e.ts_ns + e.dur_ns, t1 + 50'000) << e.name;
  }
}

}  // namespace
}  // namespace strata
