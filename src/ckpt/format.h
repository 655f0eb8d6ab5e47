// The on-disk checkpoint format (docs/checkpoint-format.md): names, dtypes, the manifest and
// the safetensors headers of a step directory. Model-agnostic: tensors are (name, dtype, shape)
// and the model config is an opaque JSON object given by the caller.
//
//   DIR/latest                    "step-N", replaced atomically after each commit
//   DIR/step-N/model.safetensors  parameters, by their Hugging Face names
//   DIR/step-N/optimizer.safetensors  "master/NAME", "adam_m/NAME", "adam_v/NAME"
//   DIR/step-N/manifest.json      written last; step, cursors, RNG, per-file size and xxh3_64
//
// Both .safetensors files pad their JSON header with spaces so that the data starts at a
// multiple of kFileAlign (O_DIRECT writes), then hold the tensors back to back with no holes.
//
// Pure functions and value types; safe for concurrent use.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/status.h"
#include "core/units.h"

namespace strata::ckpt {

inline constexpr int kFormatVersion = 1;
inline constexpr uint64_t kFileAlign = 4096;
inline constexpr const char* kModelFile = "model.safetensors";
inline constexpr const char* kOptimizerFile = "optimizer.safetensors";
inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kLatestFile = "latest";
// Names the best checkpoint by a measure the trainer chose (ckpt.keep_best: the eval loss):
// the step directory on the first line, then a line saying why. Retention never removes it.
inline constexpr const char* kBestFile = "best";

// What a saved tensor is. kParam goes to model.safetensors under its own name; the others go
// to optimizer.safetensors under "<prefix>/<name>". kState is other training state a resume
// needs (e.g. the MoE routers' loss-free balancing bias).
enum class TensorKind : uint8_t { kParam, kMaster, kAdamM, kAdamV, kState };
inline constexpr int kTensorKindCount = 5;

// "param", "master", "adam_m", "adam_v", "state".
const char* tensor_kind_name(TensorKind kind);
// The name a tensor has in its file: "model.norm.weight" or "adam_m/model.norm.weight".
std::string qualified_name(TensorKind kind, const std::string& name);
// Splits a qualified name back; kParam for names without a known prefix.
TensorKind kind_of_qualified(const std::string& qualified, std::string* name);
// kModelFile for kParam, kOptimizerFile otherwise.
const char* file_of_kind(TensorKind kind);

// Tensor dtypes: core/dtype.h (strata::DType, dtype_name, dtype_size, parse_dtype).
using ::strata::DType;

// The element count of a row-major shape; nullopt for a negative dimension or a count past
// 2^64 - 1.
std::optional<uint64_t> checked_numel(const std::vector<int64_t>& shape);

// The largest step a checkpoint may record: 18 digits, as step-N names hold, so that step + 1
// never overflows.
inline constexpr int64_t kMaxStep = 999'999'999'999'999'999;

// The files of one rank's share of a sharded checkpoint (data-parallel ranks each write the
// tensors they own): "model.rank-00001-of-00004.safetensors". A checkpoint of one writer uses
// kModelFile and kOptimizerFile.
std::string shard_file_name(const char* file, int rank, int world);
// Whether a file of a step directory holds parameters (kModelFile or a shard of it) or
// optimizer state (kOptimizerFile or a shard of it).
bool is_model_file(std::string_view name);
bool is_optimizer_file(std::string_view name);

// "step-42"; parse_step_dir_name("step-42") == 42, nullopt for anything else ("step-42.tmp").
std::string step_dir_name(int64_t step);
std::optional<int64_t> parse_step_dir_name(std::string_view name);

// 16 lowercase hex digits.
std::string xxh3_hex(uint64_t hash);

// The header's __metadata__ key that records which entries are slices of larger tensors: a
// JSON object as a string, {"NAME": [first, count, [whole shape]], ...}.
inline constexpr const char* kSlicesMetadataKey = "strata_slices";

// Elements [first, first + count) of the row-major flattened tensor of shape `whole_shape`,
// stored under the tensor's own name as a 1-D entry of `count` elements (a rank's share of a
// tensor sharded by element ranges; docs/checkpoint-format.md, "Slices").
struct HeaderSlice {
  uint64_t first = 0;
  uint64_t count = 0;
  std::vector<int64_t> whole_shape;
};

// One tensor of a safetensors file: `begin`/`end` count from the first data byte. `shape` is
// the entry's shape in the file: {slice->count} for a slice.
struct HeaderEntry {
  std::string name;  // qualified
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
  std::optional<HeaderSlice> slice;
};

// The first data_start bytes of a safetensors file: 8-byte little-endian length, JSON, spaces
// up to a multiple of kFileAlign. `entries` must tile [0, total) in order. Entries with a slice
// are listed under kSlicesMetadataKey in __metadata__ (absent when none is).
std::string build_safetensors_header(const std::vector<HeaderEntry>& entries,
                                     const std::map<std::string, std::string>& metadata);

// A parsed header. Validates JSON, dtypes, shapes against byte counts, and that the tensors
// tile the data section with no holes or overlaps and end exactly at `file_size`; reads the
// slices kSlicesMetadataKey records (each naming an entry of shape {count}, inside its whole
// shape, count > 0). Messages name `path`.
struct ParsedHeader {
  uint64_t data_start = 0;
  std::vector<HeaderEntry> entries;  // sorted by begin
  std::map<std::string, std::string> metadata;
};
Result<ParsedHeader> parse_safetensors_header(const std::string& path, const std::string& prefix8,
                                              const std::string& json_text, uint64_t file_size);

struct DataCursor {
  int64_t epoch = 0;
  int64_t index = 0;
};

// The manifest fields the trainer supplies; the writer adds format_version, step and files.
// JSON members are opaque to the checkpoint layer and default to empty objects.
struct ManifestFields {
  std::string strata_version;
  uint64_t tokens_seen = 0;
  DataCursor data_cursor;
  int64_t optimizer_step = 0;
  nlohmann::json rng = nlohmann::json::object();          // RNG states, any JSON
  nlohmann::json lr_schedule = nlohmann::json::object();  // LR schedule state
  nlohmann::json precision = nlohmann::json::object();    // loss scale, FP8 amax histories, ...
  nlohmann::json model_config = nlohmann::json::object(); // the HF config.json, typically
  nlohmann::json layout = nlohmann::json::object();       // informational: how it was laid out
  nlohmann::json extra = nlohmann::json::object();        // future fields
};

struct FileRecord {
  uint64_t size = 0;
  uint64_t xxh3 = 0;
};

struct Manifest {
  int format_version = kFormatVersion;
  int64_t step = 0;
  ManifestFields fields;
  std::map<std::string, FileRecord> files;  // by file name within the step directory
};

nlohmann::json manifest_to_json(const Manifest& manifest);
// Messages name `path` and the field. A format_version above kFormatVersion is refused with
// "checkpoint <step_dir> was written by a newer strata (format 2; this build reads 1); upgrade strata".
// Every field is required and checked: step in [0, kMaxStep] and equal to N when step_dir is
// named step-N; tokens_seen and the data cursor non-negative integers; optimizer_step in
// [0, step]; the JSON members objects; file names plain (is_plain_file_name), sizes
// non-negative, xxh3_64 16 lowercase hex digits.
Result<Manifest> manifest_from_json(const std::string& path, const std::string& step_dir,
                                    const nlohmann::json& json);

// A name that stays inside the step directory: not empty, not "." or "..", no '/', no NUL.
bool is_plain_file_name(std::string_view name);

// Text read from a file that may not be what it claims (a `latest` pointing at /etc/passwd),
// quoted for an error message: at most max_chars, anything but printable ASCII as '?'.
std::string quote_untrusted(std::string_view text, size_t max_chars = 32);

}  // namespace strata::ckpt
