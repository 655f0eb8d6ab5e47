#include "core/cpu_device.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "core/device.h"
#include "core/units.h"
#if STRATA_HAVE_CUDA
#include "core/cuda/cuda_device.h"
#endif

namespace strata {
namespace {

using namespace std::chrono_literals;

std::unique_ptr<CpuDevice> open_cpu(uint64_t budget) {
  Result<std::unique_ptr<CpuDevice>> device = CpuDevice::create(0, budget);
  CHECK_MSG(device.ok(), device.status().to_string());
  return std::move(device).value();
}

// Chaos mode: the seed comes from STRATA_STREAM_CHAOS; a malformed one is refused by name; a
// chaotic stream still runs its tasks in order, and fill() writes its bytes.
TEST(CpuDeviceChaos, SeedIsReadAndCheckedAndStreamsStayInOrder) {
  const char* before = std::getenv("STRATA_STREAM_CHAOS");
  const std::string saved = before ? before : "";
  setenv("STRATA_STREAM_CHAOS", "7", 1);
  EXPECT_EQ(stream_chaos_from_env().value(), 7u);
  setenv("STRATA_STREAM_CHAOS", "seven", 1);
  Result<uint64_t> bad = stream_chaos_from_env();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("STRATA_STREAM_CHAOS='seven'"), std::string::npos);
  EXPECT_FALSE(CpuDevice::create(0, 0).ok());
  setenv("STRATA_STREAM_CHAOS", "0", 1);
  EXPECT_EQ(stream_chaos_from_env().value(), 0u);
  if (before) setenv("STRATA_STREAM_CHAOS", saved.c_str(), 1); else unsetenv("STRATA_STREAM_CHAOS");

  auto dev = CpuDevice::create(0, 0, /*chaos_seed=*/3).value();
  EXPECT_EQ(dev->chaos_seed(), 3u);
  auto stream = dev->create_cpu_stream();
  std::vector<int> order;
  for (int i = 0; i < 50; ++i) stream->enqueue([&order, i] { order.push_back(i); });
  std::vector<unsigned char> bytes(4096, 0);
  dev->fill(bytes.data(), 0xFF, bytes.size(), *stream);
  stream->synchronize();
  std::vector<int> want(50);
  std::iota(want.begin(), want.end(), 0);
  EXPECT_EQ(order, want);
  EXPECT_EQ(bytes, std::vector<unsigned char>(4096, 0xFF));
}

TEST(CpuDevice, OpensWithKindNameAndBudget) {
  Result<std::unique_ptr<Device>> opened = open_device("cpu", 0, 64 * kMiB);
  ASSERT_TRUE(opened.ok()) << opened.status().to_string();
  std::unique_ptr<Device> device = std::move(opened).value();
  EXPECT_EQ(device->kind(), DeviceKind::kCpu);
  EXPECT_STREQ(device_kind_name(device->kind()), "cpu");
  EXPECT_EQ(device->name(), "cpu:0");
  EXPECT_EQ(device->index(), 0);
  EXPECT_EQ(device->memory_budget(), 64 * kMiB);
  EXPECT_EQ(device->memory_in_use(), 0u);

  auto unlimited = open_cpu(0);
  EXPECT_EQ(unlimited->memory_budget(), Device::kUnlimited);
}

TEST(CpuDevice, AutoPicksCpuWithoutAGpu) {
  Result<std::unique_ptr<Device>> device = open_device("auto", 0, 0);
  ASSERT_TRUE(device.ok()) << device.status().to_string();
#if !STRATA_HAVE_CUDA
  EXPECT_EQ((*device)->kind(), DeviceKind::kCpu);
#endif
}

TEST(CpuDevice, RejectsUnknownKindAndNegativeIndex) {
  Result<std::unique_ptr<Device>> bad_kind = open_device("gpu", 0, 0);
  ASSERT_FALSE(bad_kind.ok());
  EXPECT_EQ(bad_kind.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_kind.status().message().find("'gpu'"), std::string::npos);
  Result<std::unique_ptr<Device>> bad_index = open_device("cpu", -1, 0);
  ASSERT_FALSE(bad_index.ok());
  EXPECT_EQ(bad_index.status().code(), StatusCode::kInvalidArgument);
}

TEST(CpuDevice, CudaWithoutAGpuIsAClearError) {
#if STRATA_HAVE_CUDA
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
#endif
  Result<std::unique_ptr<Device>> device = open_device("cuda", 0, 0);
  ASSERT_FALSE(device.ok());
  EXPECT_TRUE(device.status().code() == StatusCode::kNotFound ||
              device.status().code() == StatusCode::kUnimplemented)
      << device.status().to_string();
  EXPECT_NE(device.status().message().find("cuda"), std::string::npos);
  EXPECT_NE(device.status().message().find("cpu"), std::string::npos)
      << "the message should say what to use instead: " << device.status().message();
}

TEST(CpuDevice, AllocationsCountAgainstTheBudgetAndFreeOnDestruction) {
  auto device = open_cpu(4 * kMiB);
  {
    Result<DeviceAllocation> a = device->allocate(3 * kMiB);
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    EXPECT_EQ(a->size(), 3 * kMiB);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 256, 0u);
    std::memset(a->data(), 0x5a, a->size());  // the memory is real and writable
    EXPECT_EQ(device->memory_in_use(), 3 * kMiB);

    Result<DeviceAllocation> b = device->allocate(3 * kMiB / 2);
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), StatusCode::kOutOfMemory);
    const std::string& msg = b.status().message();
    EXPECT_NE(msg.find("device (cpu:0)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("1.50 MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("4.00 MiB budget"), std::string::npos) << msg;
    EXPECT_NE(msg.find("3.00 MiB"), std::string::npos) << msg;

    DeviceAllocation moved = std::move(a).value();
    EXPECT_EQ(device->memory_in_use(), 3 * kMiB);
  }
  EXPECT_EQ(device->memory_in_use(), 0u);
  EXPECT_EQ(device->memory_peak(), 3 * kMiB);
  Result<DeviceAllocation> again = device->allocate(4 * kMiB);
  EXPECT_TRUE(again.ok()) << again.status().to_string();
}

TEST(CpuDevice, UnlimitedDeviceCountsBytes) {
  auto device = open_cpu(0);
  DeviceAllocation a = device->allocate(1000).value();
  DeviceAllocation b = device->allocate(256).value();
  EXPECT_EQ(device->memory_in_use(), 1024u + 256u);
  a.reset();
  EXPECT_EQ(device->memory_in_use(), 256u);
  EXPECT_EQ(device->memory_peak(), 1024u + 256u);
}

TEST(CpuDevice, PinnedAllocationsArePageAlignedAndCounted) {
  auto device = open_cpu(kMiB);
  {
    HostAllocation h = device->allocate_pinned(10000).value();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(h.data()) % 4096, 0u);
    EXPECT_EQ(device->pinned_in_use(), 10000u);
    EXPECT_EQ(device->memory_in_use(), 0u);  // not the device budget
  }
  EXPECT_EQ(device->pinned_in_use(), 0u);
}

TEST(CpuStream, RunsManyTasksInQueueOrder) {
  auto device = open_cpu(0);
  std::unique_ptr<Stream> stream = device->create_stream();
  CpuStream& cpu = as_cpu_stream(*stream);
  std::vector<int> order;  // touched only by the worker until synchronize()
  constexpr int kTasks = 10000;
  for (int i = 0; i < kTasks; ++i) {
    cpu.enqueue([&order, i] {
      if (i % 1000 == 0) std::this_thread::sleep_for(1ms);  // give reordering a chance
      order.push_back(i);
    });
  }
  stream->synchronize();
  ASSERT_EQ(order.size(), static_cast<size_t>(kTasks));
  for (int i = 0; i < kTasks; ++i) ASSERT_EQ(order[i], i);
}

TEST(CpuStream, RunsConcurrentlyWithTheCaller) {
  auto device = open_cpu(0);
  auto stream = device->create_cpu_stream();
  std::atomic<bool> release{false};
  std::atomic<bool> done{false};
  stream->enqueue([&] {
    while (!release.load()) std::this_thread::yield();
    done = true;
  });
  // enqueue returned although the task is blocked: the work runs on another thread.
  EXPECT_FALSE(done.load());
  release = true;
  stream->synchronize();
  EXPECT_TRUE(done.load());
}

TEST(CpuStream, DestructionFinishesQueuedWork) {
  auto device = open_cpu(0);
  std::atomic<int> count{0};
  {
    auto stream = device->create_cpu_stream();
    for (int i = 0; i < 100; ++i) {
      stream->enqueue([&] {
        std::this_thread::sleep_for(100us);
        ++count;
      });
    }
  }
  EXPECT_EQ(count.load(), 100);
}

TEST(CpuEvent, NeverRecordedCountsAsComplete) {
  auto device = open_cpu(0);
  auto event = device->create_event();
  EXPECT_TRUE(event->query());
  event->synchronize();  // must not block
  auto stream = device->create_stream();
  stream->wait(*event);  // must not block the stream either
  stream->synchronize();
}

TEST(CpuEvent, QueryAndSynchronizeFollowTheRecordedWork) {
  auto device = open_cpu(0);
  auto stream = device->create_cpu_stream();
  auto event = device->create_event();
  std::atomic<bool> release{false};
  std::atomic<bool> ran{false};
  stream->enqueue([&] {
    while (!release.load()) std::this_thread::yield();
    ran = true;
  });
  event->record(*stream);
  std::this_thread::sleep_for(5ms);
  EXPECT_FALSE(event->query());
  release = true;
  event->synchronize();
  EXPECT_TRUE(ran.load());
  EXPECT_TRUE(event->query());
}

// Stream B waits on an event recorded on stream A after a slow write; B's read must see the
// write. Without the wait, B would run first because A is held back.
TEST(CpuEvent, WaitOrdersWorkAcrossStreams) {
  auto device = open_cpu(0);
  auto a = device->create_cpu_stream();
  auto b = device->create_cpu_stream();
  auto event = device->create_event();
  for (int round = 0; round < 50; ++round) {
    std::atomic<bool> release{false};
    int value = 0;  // written on A, read on B; the event provides the happens-before
    int seen = -1;
    std::atomic<bool> b_done{false};
    a->enqueue([&] {
      while (!release.load()) std::this_thread::yield();
      value = round + 1;
    });
    event->record(*a);
    b->wait(*event);
    b->enqueue([&] {
      seen = value;
      b_done = true;
    });
    std::this_thread::sleep_for(200us);
    EXPECT_FALSE(b_done.load()) << "stream B ran before the event it waits on fired";
    release = true;
    b->synchronize();
    EXPECT_EQ(seen, round + 1);
  }
}

// A wait refers to the record made before it: recording again later does not hold back a
// stream that already waits, and does not release a wait on an earlier, unfinished record.
TEST(CpuEvent, WaitUsesTheLatestRecordAtTheTimeOfTheCall) {
  auto device = open_cpu(0);
  auto a = device->create_cpu_stream();
  auto c = device->create_cpu_stream();
  auto waiter = device->create_cpu_stream();
  auto event = device->create_event();
  std::atomic<bool> release_a{false};
  std::atomic<bool> waiter_done{false};
  a->enqueue([&] {
    while (!release_a.load()) std::this_thread::yield();
  });
  event->record(*a);     // generation 1, pending until A is released
  waiter->wait(*event);  // waits for generation 1
  waiter->enqueue([&] { waiter_done = true; });
  event->record(*c);  // generation 2 on an idle stream: completes at once
  c->synchronize();
  EXPECT_TRUE(event->query());  // the latest record is complete
  std::this_thread::sleep_for(2ms);
  EXPECT_FALSE(waiter_done.load()) << "a later record released a wait on an earlier one";
  release_a = true;
  waiter->synchronize();
  EXPECT_TRUE(waiter_done.load());
}

TEST(CpuDevice, CopiesRoundTripThroughDeviceMemoryOnAStream) {
  auto device = open_cpu(16 * kMiB);
  constexpr uint64_t kBytes = 3 * kMiB + 17;
  HostAllocation src = device->allocate_pinned(kBytes).value();
  HostAllocation dst = device->allocate_pinned(kBytes).value();
  DeviceAllocation dev = device->allocate(kBytes).value();
  auto* s = src.as<unsigned char>();
  for (uint64_t i = 0; i < kBytes; ++i) s[i] = static_cast<unsigned char>(i * 131 + 7);
  std::memset(dst.data(), 0, kBytes);

  auto copy_stream = device->create_stream();
  device->copy(dev.data(), src.data(), kBytes, *copy_stream);
  device->copy(dst.data(), dev.data(), kBytes, *copy_stream);
  copy_stream->synchronize();
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), kBytes), 0);
}

// The prefetch pattern: upload on a copy stream, compute on another stream after an event.
TEST(CpuDevice, ComputeStreamSeesDataUploadedOnACopyStream) {
  auto device = open_cpu(16 * kMiB);
  auto upload = device->create_stream();
  auto compute = device->create_cpu_stream();
  auto uploaded = device->create_event();
  constexpr int kN = 1 << 20;
  HostAllocation host = device->allocate_pinned(kN * sizeof(float)).value();
  DeviceAllocation dev = device->allocate(kN * sizeof(float)).value();
  std::iota(host.as<float>(), host.as<float>() + kN, 0.0f);
  std::memset(dev.data(), 0, kN * sizeof(float));

  // Hold the upload back so that compute would read zeros if it did not wait.
  auto gate = std::make_shared<std::atomic<bool>>(false);
  as_cpu_stream(*upload).enqueue([gate] {
    while (!gate->load()) std::this_thread::yield();
  });
  device->copy(dev.data(), host.data(), kN * sizeof(float), *upload);
  uploaded->record(*upload);
  compute->wait(*uploaded);
  double sum = 0;
  compute->enqueue([&] {
    const float* x = dev.as<float>();
    for (int i = 0; i < kN; ++i) sum += x[i];
  });
  *gate = true;
  compute->synchronize();
  EXPECT_EQ(sum, double(kN) * (kN - 1) / 2);
}

TEST(CpuDeviceDeathTest, DestroyingTheDeviceWithLiveAllocationsAborts) {
  EXPECT_DEATH(
      {
        auto device = open_cpu(kMiB);
        DeviceAllocation a = device->allocate(100).value();
        device.reset();
      },
      "live blocks");
}

}  // namespace
}  // namespace strata
