#include "core/host_memory.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <optional>
#include <sstream>

namespace strata {
namespace {

bool read_u64(const std::string& path, uint64_t* out) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text)) return false;  // "max" (no limit) fails the parse below
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size();
}

// The cgroup this process is in, as /proc/self/cgroup names it: "0::/path" on v2, or the
// line of the memory controller on v1.
std::string cgroup_path(const std::string& root, bool v2) {
  std::ifstream in(root + "proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    if (v2 ? controllers.empty() : controllers.find("memory") != std::string::npos) return line.substr(b + 1);
  }
  return "/";
}

// A counter of a cgroup's memory.stat, 0 when absent.
uint64_t stat_value(const std::string& dir, const std::string& key) {
  std::ifstream in(dir + "/memory.stat");
  std::string name;
  uint64_t value = 0;
  while (in >> name >> value)
    if (name == key) return value;
  return 0;
}

// Room under one cgroup folder's limit, or nullopt when it sets none. Usage counts page cache
// the kernel would drop to make room, so the inactive file pages are not counted as used.
std::optional<uint64_t> room_in(const std::string& dir, bool v2) {
  uint64_t limit = 0, usage = 0;
  if (v2) {
    if (!read_u64(dir + "/memory.max", &limit) || !read_u64(dir + "/memory.current", &usage)) return std::nullopt;
    usage -= std::min(usage, stat_value(dir, "inactive_file"));
  } else {
    // v1 reports "no limit" as a huge number (a page-rounded LONG_MAX).
    if (!read_u64(dir + "/memory.limit_in_bytes", &limit) || limit >= (uint64_t{1} << 60) ||
        !read_u64(dir + "/memory.usage_in_bytes", &usage))
      return std::nullopt;
    usage -= std::min(usage, stat_value(dir, "total_inactive_file"));
  }
  return limit > usage ? limit - usage : 0;
}

// What the memory cgroups let this process still allocate: the least room under the limits of
// its cgroup and every cgroup above it; UINT64_MAX when none sets one. Inside a container the
// cgroup's own folder is often mounted as the root, so the root is tried too.
std::pair<uint64_t, bool> cgroup_room(const std::string& root) {
  uint64_t least = UINT64_MAX;
  bool limited = false;
  for (const bool v2 : {true, false}) {
    const std::string mount = root + (v2 ? "sys/fs/cgroup" : "sys/fs/cgroup/memory");
    for (std::string path = cgroup_path(root, v2);;) {
      if (const std::optional<uint64_t> room = room_in(mount + (path == "/" ? "" : path), v2)) {
        least = std::min(least, *room);
        limited = true;
      }
      if (path.empty() || path == "/") break;
      const size_t slash = path.find_last_of('/');
      path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
    if (limited) break;  // one hierarchy holds the memory controller
  }
  return {least, limited};
}

}  // namespace

HostMemory available_host_memory(const std::string& root_in) {
  const std::string root = root_in.ends_with('/') ? root_in : root_in + "/";
  HostMemory m;
  std::ifstream in(root + "proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    uint64_t kib = 0;
    if (fields >> kib) {
      m.known = true;
      m.available = kib * 1024;
      m.source = "MemAvailable";
    }
  }
  const auto [room, limited] = cgroup_room(root);
  if (limited && (!m.known || room < m.available)) {
    m.known = true;
    m.available = room;
    m.source = "the memory cgroup's limit";
  }
  return m;
}

}  // namespace strata
