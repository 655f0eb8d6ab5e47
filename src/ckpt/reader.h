// CheckpointReader: opens a committed checkpoint, validates it and reads tensors by name.
//
// open(path) accepts DIR (follows DIR/latest), DIR/latest, or DIR/step-N. It parses and checks
// manifest.json (a newer format_version is refused with a message saying to upgrade), checks
// that every file the manifest lists exists with the recorded size, optionally recomputes the
// xxh3_64 checksums (verify=true), and validates both safetensors headers. Every error names
// the file: NotFound for a missing file, Corruption for truncation, checksum mismatches and
// malformed headers, Unimplemented for a newer format.
//
// Reads use pread on descriptors the reader owns (closed by the destructor).
// Thread safety: after open(), every const method is safe for concurrent use.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/finite.h"
#include "ckpt/format.h"
#include "ckpt/fs_util.h"
#include "core/progress.h"
#include "core/status.h"

namespace strata::ckpt {

struct ReaderOpenOptions {
  bool verify = false;  // recompute and compare every file's xxh3_64
};

// One slice of a tensor stored in slices (a checkpoint sharded by element ranges: each rank's
// files hold its range of every tensor).
struct SavedSlice {
  uint64_t first = 0;   // elements [first, first + count) of the tensor flattened row-major
  uint64_t count = 0;
  int file = 0;         // index into files()
  uint64_t offset = 0;  // absolute file offset of the slice's first byte
};

// One logical tensor, stored whole in one file or in slices across several.
struct SavedTensor {
  std::string name;            // qualified: "model.norm.weight", "adam_m/model.norm.weight"
  TensorKind kind = TensorKind::kParam;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // the whole tensor's, also when it is stored in slices
  uint64_t numel = 0;
  uint64_t nbytes = 0;         // numel * the dtype's size
  int file = 0;                // index into files(); for a sliced tensor, its first slice's
  uint64_t offset = 0;         // absolute file offset of the first byte (of the first slice)
  // Empty for a tensor stored whole; otherwise its slices by `first`, tiling [0, numel) with no
  // gap or overlap (open() refuses a checkpoint where they do not). Read them through the
  // reader's methods, which stitch them.
  std::vector<SavedSlice> slices;
};

struct SavedFile {
  std::string name;  // kModelFile, kOptimizerFile
  std::string path;
  uint64_t size = 0;
  uint64_t xxh3 = 0;  // from the manifest
};

class CheckpointReader {
 public:
  static Result<std::unique_ptr<CheckpointReader>> open(const std::string& path,
                                                        const ReaderOpenOptions& options = {});
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const std::string& step_dir() const { return step_dir_; }
  int64_t step() const { return manifest_.step; }
  const Manifest& manifest() const { return manifest_; }
  const nlohmann::json& manifest_json() const { return manifest_json_; }
  const std::vector<SavedFile>& files() const { return files_; }
  // The logical tensors, by the file and offset of their first bytes.
  const std::vector<SavedTensor>& tensors() const { return tensors_; }
  // nullptr when absent. `qualified` as in tensors(): use qualified_name(kind, name).
  const SavedTensor* find(const std::string& qualified) const;

  // Reads tensor `qualified` into out[0, count) as fp32 (BF16 converted). InvalidArgument
  // when count differs from the tensor's element count, NotFound for an unknown name.
  Status read_f32(const std::string& qualified, float* out, uint64_t count) const;
  // The checks of read_f32 alone: the tensor exists and has `count` elements.
  Status check_f32(const std::string& qualified, uint64_t count) const;
  // Reads the tensor's stored bytes unchanged; `bytes` must equal its nbytes.
  Status read_raw(const std::string& qualified, void* out, uint64_t bytes) const;
  // Reads elements [first, first + count) of the tensor flattened row-major into out[0, count)
  // as fp32, whether it is stored whole or in slices (a rank reading back its own range).
  // InvalidArgument when the range is not inside the tensor, NotFound for an unknown name.
  Status read_f32_range(const std::string& qualified, uint64_t first, uint64_t count, float* out) const;

  // Recomputes every file's xxh3_64; Corruption naming the first file that differs. With
  // `non_finite`, the same pass also appends every tensor holding NaN or Inf values (with
  // their count, over all its slices) to it. A long verification shows a progress line on
  // stderr.
  Status verify(std::vector<ScannedTensor>* non_finite = nullptr) const;

 private:
  // A tensor entry of one file's header, before the files' entries are joined into tensors.
  struct FileEntry {
    HeaderEntry entry;
    int file = 0;
    uint64_t offset = 0;  // absolute file offset of the first byte
  };

  CheckpointReader() = default;
  Status open_files(const std::string& manifest_path);
  Status read_headers(std::vector<FileEntry>* entries);
  Status join_tensors(const std::vector<FileEntry>& entries);
  Result<SavedTensor> join_slices(const std::string& name, std::vector<const FileEntry*> parts) const;
  Status read_at(int file, void* out, uint64_t bytes, uint64_t offset) const;
  // Stored bytes of elements [first, first + count) of `t`, across its slices.
  Status read_elements(const SavedTensor& t, uint64_t first, uint64_t count, void* out) const;
  Status read_f32_elements(const SavedTensor& t, uint64_t first, uint64_t count, float* out) const;
  // The tensors and slices whose bytes are in file `file`, by offset (what verify scans).
  std::vector<ScannedTensor> tensors_in_file(int file) const;

  std::string step_dir_;
  Manifest manifest_;
  nlohmann::json manifest_json_;
  std::vector<SavedFile> files_;
  std::vector<UniqueFd> fds_;
  std::vector<SavedTensor> tensors_;
  std::map<std::string, size_t> by_name_;
};

// Resolves DIR, DIR/latest or DIR/step-N to the step directory. NotFound naming what is missing.
Result<std::string> resolve_checkpoint_path(const std::string& path);

// The step-N name a `latest` file holds. Corruption naming the file otherwise, quoting at most
// a short sanitised prefix of what it holds (never the contents of some other file).
Result<std::string> read_latest_file(const std::string& latest);

// xxh3_64 of a whole file, read in large pieces; each piece is added to `progress` when set.
Result<uint64_t> hash_file(const std::string& path, Progress* progress = nullptr);
// The same, feeding every piece to `scan` (when not null) at its file offset.
Result<uint64_t> hash_and_scan_file(const std::string& path, FiniteScan* scan, Progress* progress = nullptr);

}  // namespace strata::ckpt
