// Fuzzes model.safetensors.index.json: the input is the index, beside two small valid shards
// that it may (or may not) name correctly.
#include <cstdlib>
#include <vector>

#include "fuzz_util.h"
#include "model/safetensors.h"

namespace {

using namespace strata;

// Writes the shards once per process: model-00001-of-00002 holds "a" (2 floats) and "b"
// (1 float), model-00002-of-00002 holds "c" (2x2 floats). The seeds' valid index names these.
void write_shards() {
  static const bool done = [] {
    const float values[4] = {1, 2, 3, 4};
    std::vector<model::SafetensorsWriteTensor> first = {{"a", {2}, values, {}}, {"b", {1}, values, {}}};
    std::vector<model::SafetensorsWriteTensor> second = {{"c", {2, 2}, values, {}}};
    const std::string& dir = fuzz::scratch_dir();
    if (!model::write_safetensors_file(dir + "/model-00001-of-00002.safetensors", first).ok() ||
        !model::write_safetensors_file(dir + "/model-00002-of-00002.safetensors", second).ok()) {
      abort();
    }
    return true;
  }();
  (void)done;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  write_shards();
  const std::string path = fuzz::write_scratch(model::kSafetensorsIndexName, fuzz::as_view(data, size));
  auto reader = model::SafetensorsReader::open(path);
  if (!reader.ok()) return 0;
  for (const model::SafetensorsTensorInfo& t : reader->tensors()) {
    std::vector<float> values(static_cast<size_t>(t.numel));
    if (!reader->read_f32(t.name, values.data()).ok()) abort();
  }
  return 0;
}
