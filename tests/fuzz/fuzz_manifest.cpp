// Fuzzes the checkpoint manifest (manifest.json) the way CheckpointReader::open reads it:
// JSON text, then manifest_from_json; what it accepts must survive a round trip.
#include <cstdlib>

#include "ckpt/format.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  const nlohmann::json json = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return 0;
  auto manifest = ckpt::manifest_from_json("fuzz/manifest.json", "fuzz", json);
  if (!manifest.ok()) return 0;
  // The writer's output of an accepted manifest must read back as the same manifest.
  auto again = ckpt::manifest_from_json("fuzz/manifest.json", "fuzz", ckpt::manifest_to_json(*manifest));
  if (!again.ok() || again->step != manifest->step || again->files.size() != manifest->files.size()) abort();
  return 0;
}
