// Fuzzes both safetensors header parsers on one file's bytes: the Hugging Face reader
// (model/safetensors.h, which opens a path) and the checkpoint reader's header check
// (ckpt/format.h, which takes the bytes). Whatever they accept must be self-consistent.
#include <cstdlib>
#include <vector>

#include "ckpt/format.h"
#include "fuzz_util.h"
#include "model/safetensors.h"

namespace {

using namespace strata;

// Reading is bounded so that a large, valid tensor does not make one input slow.
constexpr int64_t kMaxReadBytes = int64_t{1} << 20;

void check(bool ok) {
  if (!ok) abort();
}

void fuzz_hf_reader(std::string_view bytes) {
  const std::string path = fuzz::write_scratch("fuzz.safetensors", bytes);
  auto reader = model::SafetensorsReader::open(path, {.piece_bytes = 4096});
  if (!reader.ok()) return;
  for (const model::SafetensorsTensorInfo& t : reader->tensors()) {
    check(t.offset >= 8 && t.nbytes >= 0 && t.offset + t.nbytes <= static_cast<int64_t>(bytes.size()));
    const int64_t element = model::safetensors_dtype_size(t.dtype);
    if (element != 0) check(t.numel * element == t.nbytes);
    if (t.nbytes > kMaxReadBytes) continue;
    std::vector<uint8_t> raw(static_cast<size_t>(t.nbytes));
    check(reader->read_raw(t.name, raw.data()).ok());
    if (model::safetensors_dtype_readable(t.dtype)) {
      std::vector<float> values(static_cast<size_t>(t.numel));
      check(reader->read_f32(t.name, t.shape, values.data()).ok());
    }
  }
}

void fuzz_ckpt_header(std::string_view bytes) {
  if (bytes.size() < 8) return;
  uint64_t n = 0;
  for (int b = 0; b < 8; ++b) n |= uint64_t(static_cast<unsigned char>(bytes[b])) << (8 * b);
  if (n > bytes.size() - 8) return;  // the checkpoint reader refuses this before parsing
  auto parsed = ckpt::parse_safetensors_header("fuzz.safetensors", std::string(bytes.substr(0, 8)),
                                               std::string(bytes.substr(8, n)), bytes.size());
  if (!parsed.ok()) return;
  for (const ckpt::HeaderEntry& e : parsed->entries) {
    check(e.begin <= e.end && parsed->data_start + e.end <= bytes.size());
    // The shape must account for exactly the entry's bytes, with no wrap-around.
    uint64_t numel = 1;
    for (int64_t d : e.shape) {
      check(d >= 0);
      check(!__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel));
    }
    uint64_t bytes_needed = 0;
    check(!__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(e.dtype)), &bytes_needed));
    check(bytes_needed == e.end - e.begin);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes = fuzz::as_view(data, size);
  fuzz_hf_reader(bytes);
  fuzz_ckpt_header(bytes);
  return 0;
}
