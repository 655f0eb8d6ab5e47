#include "core/cuda/cuda_device.h"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/units.h"

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

}  // namespace
}  // namespace strata
