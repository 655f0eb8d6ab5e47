// available_host_memory reads MemAvailable and lowers it to what the memory cgroup leaves, on
// both cgroup versions; tests lay out a fake root.
#include "core/host_memory.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace strata {
namespace {

namespace fs = std::filesystem;

class HostMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) /
            ("strata_hostmem_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(root_);
    write("proc/meminfo", "MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n");
  }
  void TearDown() override { fs::remove_all(root_); }
  void write(const std::string& rel, const std::string& text) {
    fs::create_directories((root_ / rel).parent_path());
    std::ofstream(root_ / rel) << text;
  }
  fs::path root_;
};

TEST_F(HostMemoryTest, MemAvailableWithoutACgroupLimit) {
  write("proc/self/cgroup", "0::/\n");
  write("sys/fs/cgroup/memory.max", "max\n");
  write("sys/fs/cgroup/memory.current", "123\n");
  const HostMemory m = available_host_memory(root_.string());
  EXPECT_EQ(m.available, 20000000ull * 1024);
  EXPECT_EQ(m.source, "MemAvailable");
}

TEST_F(HostMemoryTest, CgroupV2LimitLowersIt) {
  write("proc/self/cgroup", "0::/job/42\n");
  write("sys/fs/cgroup/job/42/memory.max", "8589934592\n");      // 8 GiB
  write("sys/fs/cgroup/job/42/memory.current", "1073741824\n");  // 1 GiB in use
  const HostMemory m = available_host_memory(root_.string());
  EXPECT_EQ(m.available, 7ull << 30);
  EXPECT_EQ(m.source, "the memory cgroup's limit");
}

TEST_F(HostMemoryTest, PageCacheIsNotUsedAndAParentsLimitCounts) {
  write("proc/self/cgroup", "0::/job/42\n");
  write("sys/fs/cgroup/job/42/memory.max", "8589934592\n");      // 8 GiB
  write("sys/fs/cgroup/job/42/memory.current", "6442450944\n");  // 6 GiB, of which 4 GiB is idle file cache
  write("sys/fs/cgroup/job/42/memory.stat", "anon 2147483648\nfile 4294967296\ninactive_file 4294967296\n");
  EXPECT_EQ(available_host_memory(root_.string()).available, 6ull << 30);
  // The job's parent allows less.
  write("sys/fs/cgroup/job/memory.max", "4294967296\n");
  write("sys/fs/cgroup/job/memory.current", "1073741824\n");
  EXPECT_EQ(available_host_memory(root_.string()).available, 3ull << 30);
}

TEST_F(HostMemoryTest, CgroupV1LimitAtTheMountRootInsideAContainer) {
  // The path /proc/self/cgroup names is not mounted inside the container; its root is.
  write("proc/self/cgroup", "4:memory:/outer/job\n0::/\n");
  write("sys/fs/cgroup/memory/memory.limit_in_bytes", "4294967296\n");
  write("sys/fs/cgroup/memory/memory.usage_in_bytes", "5368709120\n");  // over the limit: nothing left
  EXPECT_TRUE(available_host_memory(root_.string()).known);
  EXPECT_EQ(available_host_memory(root_.string()).available, 0u);
  write("sys/fs/cgroup/memory/memory.usage_in_bytes", "1073741824\n");
  EXPECT_EQ(available_host_memory(root_.string()).available, 3ull << 30);
  // v1's "unlimited" is a huge number, not a limit.
  write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(available_host_memory(root_.string()).available, 20000000ull * 1024);
}

TEST_F(HostMemoryTest, ThisMachineReportsSomething) {
  const HostMemory m = available_host_memory();
  EXPECT_TRUE(m.known);
  EXPECT_GT(m.available, 0u);
}

}  // namespace
}  // namespace strata
