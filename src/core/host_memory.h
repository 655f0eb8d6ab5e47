// How much host memory this process can still take: the kernel's estimate of what can be
// allocated without swapping (MemAvailable), lowered to what the memory cgroup's limit leaves.
// Budgets above it are refused before anything is allocated, rather than met by the OOM killer.
#pragma once

#include <cstdint>
#include <string>

namespace strata {

struct HostMemory {
  bool known = false;      // false when neither /proc/meminfo nor a cgroup limit could be read
  uint64_t available = 0;  // bytes
  std::string source;      // what bounded it, for messages: "MemAvailable" or the cgroup's limit
};

// Reads /proc/meminfo and the cgroup (v2 memory.max/memory.current, or v1's limit and usage)
// under `root` ("/" on a real machine; tests pass a folder laid out the same way).
HostMemory available_host_memory(const std::string& root = "/");

}  // namespace strata
