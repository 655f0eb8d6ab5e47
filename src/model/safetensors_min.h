// A minimal single-file safetensors reader and F32 writer: an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}
// and the raw little-endian data after it. Reads F32, BF16 and F16 into fp32. Sharded files
// (model.safetensors.index.json) and the full reader/writer live elsewhere.
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "core/status.h"

namespace strata::model {

struct SafetensorsEntry {
  std::string dtype;           // "F32", "BF16", ...
  std::vector<int64_t> shape;
  int64_t begin = 0;           // byte offsets into the data section (after the header)
  int64_t end = 0;
};

// Owns an open file. Not thread-safe (reads seek the one stream).
class SafetensorsReader {
 public:
  // Reads and checks the header: every entry's range lies inside the file and matches its
  // dtype and shape. Truncated or malformed files are Corruption naming the file (and tensor).
  static Result<SafetensorsReader> open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }

  // Reads tensor `name` converted to fp32 into out (numel elements). Errors name the file and
  // tensor: NotFound when absent, InvalidArgument when its shape is not `expected_shape`,
  // Unimplemented for a dtype other than F32/BF16/F16, IOError when the read fails.
  Status read_f32(const std::string& name, const std::vector<int64_t>& expected_shape, float* out);

 private:
  std::string path_;
  std::ifstream file_;
  int64_t data_start_ = 0;  // 8 + header length
  std::map<std::string, SafetensorsEntry> entries_;
};

struct SafetensorsTensor {
  std::string name;
  std::vector<int64_t> shape;
  const float* data;  // numel(shape) elements
};

// Writes the tensors as F32 in the given order (header padded with spaces to 8 bytes).
Status write_safetensors_f32(const std::string& path, const std::vector<SafetensorsTensor>& tensors);

}  // namespace strata::model
