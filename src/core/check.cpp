#include "core/check.h"

#include <cstdio>
#include <cstdlib>

namespace strata {
namespace {
ProcessIdentity& identity_storage() {
  static ProcessIdentity id;
  return id;
}
}  // namespace

void set_process_identity(const ProcessIdentity& id) { identity_storage() = id; }
const ProcessIdentity& process_identity() { return identity_storage(); }

void check_failed(const char* expr, const char* file, int line, const std::string& msg) {
  const ProcessIdentity& id = process_identity();
  std::fprintf(stderr, "[rank %d/%d %s] CHECK failed: %s at %s:%d%s%s\n", id.rank, id.world_size,
               id.device.c_str(), expr, file, line, msg.empty() ? "" : ": ", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace strata
