// Hugging Face safetensors: reader and writer, single file and sharded.
//
// File format: an 8-byte little-endian header length N, N bytes of JSON header
//   {"__metadata__": {str: str}, NAME: {"dtype": "BF16", "shape": [...], "data_offsets": [b, e]}}
// (padded with spaces to a multiple of 8 bytes), then the raw little-endian row-major data;
// offsets count from the first byte after the header, and the tensors tile the data section
// with no holes and no overlaps. A sharded checkpoint is a directory holding
// model-0000K-of-0000N.safetensors files and model.safetensors.index.json
//   {"metadata": {"total_size": BYTES}, "weight_map": {NAME: "model-00001-of-00003.safetensors"}}.
//
// Reading streams: a tensor's bytes move in pieces of at most ReaderOptions::piece_bytes
// straight into the caller's buffer (F32) or through one bounded staging buffer (other dtypes),
// never a whole file. Writing is atomic per file (FILE.tmp, fsync, rename).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace strata {
class IoEngine;
}

namespace strata::model {

// Hugging Face's default max_shard_size ("5GB").
inline constexpr uint64_t kDefaultMaxShardBytes = 5'000'000'000ull;
inline constexpr const char* kSafetensorsIndexName = "model.safetensors.index.json";
inline constexpr const char* kSafetensorsSingleName = "model.safetensors";

// Bits per element of a dtype the safetensors format defines ("F32" -> 32, "F4" -> 4); 0 for a
// name it does not define, which open() refuses like the reference library does.
int safetensors_dtype_bits(std::string_view dtype);
// Bytes per element of a dtype of whole bytes ("F32" -> 4); 0 for sub-byte and unknown names.
int64_t safetensors_dtype_size(std::string_view dtype);
// True for the dtypes read_f32 converts: F32, F16, BF16, F8_E4M3, F8_E5M2.
bool safetensors_dtype_readable(std::string_view dtype);

// Scalar conversions, exposed for tests. FP8 follows the OCP 8-bit floating point spec:
// E4M3 (bias 7, no infinities, S.1111.111 is NaN, max 448) and E5M2 (bias 15, IEEE-like).
float bf16_to_f32(uint16_t bits);
float f16_to_f32(uint16_t bits);
float fp8_e4m3_to_f32(uint8_t bits);
float fp8_e5m2_to_f32(uint8_t bits);
// Round to nearest, ties to even; NaN stays a (quiet) NaN, overflow becomes infinity.
uint16_t f32_to_bf16(float value);
// IEEE binary16, round to nearest, ties to even (as torch's .half()): values from 65520 up
// become infinity, below 2^-14 subnormals, at most 2^-25 zero; NaN stays a (quiet) NaN.
uint16_t f32_to_f16(float value);

struct SafetensorsTensorInfo {
  std::string name;
  std::string dtype;            // as in the header: "F32", "BF16", "F8_E4M3", ...
  std::vector<int64_t> shape;   // row-major; {} for a scalar
  int64_t numel = 0;
  std::string file;             // path of the file holding the data
  int64_t offset = 0;           // absolute offset of the first data byte in `file`
  int64_t nbytes = 0;
};

struct ReaderOptions {
  // Reads go through this engine when set (not owned; must outlive the reader), with plain
  // pread otherwise.
  IoEngine* io = nullptr;
  // Largest single read and the size of the conversion staging buffer.
  int64_t piece_bytes = int64_t{64} << 20;
};

// An open checkpoint: one .safetensors file, or a sharded directory through its index. open()
// validates every header completely (sizes, bounds, holes, overlaps, the file size), so later
// reads only fail on I/O errors. It is as strict as the reference library (Hugging Face's
// safetensors): a dtype the format does not define, on any tensor, and bytes other than JSON
// whitespace around the header's JSON (NUL padding) are Corruption.
//
// Owns the open file descriptors (closed by the destructor); movable, not copyable.
// Thread safety: after open(), all const methods, read_f32 included, are safe for concurrent use.
class SafetensorsReader {
 public:
  // `path` is a .safetensors file, a model.safetensors.index.json, or a directory holding
  // either model.safetensors.index.json or model.safetensors. Errors name the file (and tensor):
  // NotFound for missing files (a shard named by the index included), Corruption for headers
  // that are malformed or lie about sizes.
  static Result<SafetensorsReader> open(const std::string& path, const ReaderOptions& options = {});

  SafetensorsReader(SafetensorsReader&&) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&&) noexcept;
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;
  ~SafetensorsReader();

  // What open() was given.
  const std::string& path() const { return path_; }
  // Every tensor, sorted by name.
  const std::vector<SafetensorsTensorInfo>& tensors() const { return tensors_; }
  // Null when absent.
  const SafetensorsTensorInfo* find(std::string_view name) const;
  // The data files, in the order they are numbered.
  std::vector<std::string> files() const;
  // "__metadata__" of the first data file.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Reads tensor `name` converted to fp32 into out (numel elements). Errors name the file and
  // tensor: NotFound when absent, InvalidArgument when its shape is not `expected_shape`,
  // Unimplemented for a dtype read_f32 cannot convert, IOError when a read fails.
  Status read_f32(std::string_view name, const std::vector<int64_t>& expected_shape, float* out) const;
  // The same without a shape check.
  Status read_f32(std::string_view name, float* out) const;
  // The raw little-endian bytes of tensor `name` (nbytes of them) into out.
  Status read_raw(std::string_view name, void* out) const;

 private:
  struct File;
  SafetensorsReader() = default;
  // Opens `path` into *file; NotFound carries `missing_message`.
  Status open_file(const std::string& path, const std::string& missing_message, File* file);
  Status read_bytes(const SafetensorsTensorInfo& t, int64_t begin, int64_t length, void* out) const;

  std::string path_;
  ReaderOptions options_;
  std::vector<File> files_;
  std::vector<SafetensorsTensorInfo> tensors_;
  std::vector<int> tensor_file_;  // index into files_, parallel to tensors_
  std::map<std::string, std::string> metadata_;
};

// The dtypes strata writes; BF16 and F16 round to nearest even.
enum class SafetensorsWriteDtype : uint8_t { kF32, kBF16, kF16 };
// The header's name: "F32", "BF16", "F16".
const char* safetensors_dtype_name(SafetensorsWriteDtype dtype);

struct SafetensorsWriteTensor {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;  // numel(shape) elements; not owned
  // Used when data is null: fills numel(shape) floats, called once when the tensor is written
  // (so only one tensor at a time is held in memory, e.g. read out of a chunk space).
  std::function<Status(float* out)> read;
  // Written in this dtype instead of WriterOptions::dtype when set (values routing compares, such
  // as DeepSeek's e_score_correction_bias, stay F32 in a bf16 export).
  std::optional<SafetensorsWriteDtype> dtype;
};

struct WriterOptions {
  SafetensorsWriteDtype dtype = SafetensorsWriteDtype::kF32;
  uint64_t max_shard_bytes = kDefaultMaxShardBytes;
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  // Largest single write and the size of the conversion staging buffer.
  int64_t piece_bytes = int64_t{64} << 20;
  // Called with the bytes of each piece of tensor data once written (e.g. Progress::add).
  std::function<void(uint64_t bytes)> on_written;
};

// Writes one .safetensors file holding `tensors` in the given order: PATH.tmp, fsync, rename.
Status write_safetensors_file(const std::string& path, const std::vector<SafetensorsWriteTensor>& tensors,
                              const WriterOptions& options = {});

// Writes `tensors` into directory `dir` (created if needed) as Hugging Face does: one
// model.safetensors when the data fits in max_shard_bytes, otherwise shards filled greedily in
// order (a tensor larger than a shard gets one of its own) named model-0000K-of-0000N.safetensors
// plus model.safetensors.index.json, written last. Every file is written atomically.
// REQUIRES: `dir` holds no other checkpoint (stale shards would stay); export_hf writes into
// a fresh directory.
Status write_safetensors_dir(const std::string& dir, const std::vector<SafetensorsWriteTensor>& tensors,
                             const WriterOptions& options = {});


}  // namespace strata::model
