#include "core/host_memory.h"

#include <algorithm>
#include <charconv>
#include <fstream>
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

// What the memory cgroup lets this process still allocate; UINT64_MAX when unlimited. Inside a
// container the cgroup's own folder is often mounted as the root, so the root is tried too.
std::pair<uint64_t, bool> cgroup_room(const std::string& root) {
  uint64_t limit = 0, usage = 0;
  for (const std::string& dir : {root + "sys/fs/cgroup" + cgroup_path(root, true), root + "sys/fs/cgroup"}) {
    if (read_u64(dir + "/memory.max", &limit) && read_u64(dir + "/memory.current", &usage))
      return {limit > usage ? limit - usage : 0, true};
  }
  for (const std::string& dir :
       {root + "sys/fs/cgroup/memory" + cgroup_path(root, false), root + "sys/fs/cgroup/memory"}) {
    // v1 reports "no limit" as a huge number (a page-rounded LONG_MAX).
    if (read_u64(dir + "/memory.limit_in_bytes", &limit) && read_u64(dir + "/memory.usage_in_bytes", &usage))
      return limit < (uint64_t{1} << 60) ? std::pair{limit > usage ? limit - usage : 0, true}
                                         : std::pair{UINT64_MAX, false};
  }
  return {UINT64_MAX, false};
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
