// Training data input: token files opened as one dataset, cut into (T+1)-token windows and
// served as shuffled micro-batches. Readers for each file format live in token_files.h.
//
// Format detection (DataConfig::format == "auto"), per file:
//   1. X.idx, or X.bin with an X.idx beside it  -> Megatron pair (X.bin, X.idx), opened once.
//   2. a file starting with an llm.c magic        -> llm.c shard (any extension).
//   3. any other .bin                             -> error: binary but of no known kind; set
//                                                    the format explicitly to read it as text.
//   4. anything else (.txt, .md, no extension...) -> byte-level text, one token per byte.
// With "llmc", "megatron" or "text" every file is read with that reader (for "megatron" a
// path may also be the common prefix of the pair, as Megatron's own tools write it).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "data/token_files.h"

namespace strata {

struct DataConfig {
  // Files, directories (their regular files, not recursive, dot files skipped, sorted) or
  // glob patterns (sorted matches). Each file is read once even if several entries name it.
  std::vector<std::string> paths;
  std::string format = "auto";  // auto | llmc | megatron | text
  std::string what = "data";    // what the log line and messages call it ("eval data")
};

// All sources back to back as one token stream. Safe for concurrent reads.
class TokenDataset {
 public:
  // REQUIRES: every source non-null.
  explicit TokenDataset(std::vector<std::unique_ptr<TokenSource>> sources);
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  int64_t num_tokens() const { return offsets_.back(); }
  // 256 when every source is byte-level text, else -1 (unknown).
  int64_t vocab_hint() const { return vocab_hint_; }
  int64_t num_sources() const { return static_cast<int64_t>(sources_.size()); }
  const TokenSource& source(int64_t i) const { return *sources_[static_cast<size_t>(i)]; }

  // Copies tokens [pos, pos + n) of the stream to out, crossing file boundaries as needed.
  // REQUIRES: 0 <= pos, n >= 0, pos + n <= num_tokens().
  Status read(int64_t pos, int64_t n, int32_t* out) const;
  // Loss masks (written by `strata data tokenize` for chat data): source i's mask has one byte
  // per token, 1 = the token counts as a prediction target. Sources without one count fully.
  // InvalidArgument when the sizes differ.
  Status attach_mask(int64_t source, std::vector<uint8_t> mask);
  bool has_masks() const { return has_masks_; }
  // mask bytes of tokens [pos, pos + n) of the stream (1 where a source has no mask).
  void read_mask(int64_t pos, int64_t n, uint8_t* out) const;

  // "position P in FILE" for a stream position: how error messages name a token.
  std::string describe_position(int64_t pos) const;

 private:
  size_t source_index(int64_t pos) const;

  std::vector<std::unique_ptr<TokenSource>> sources_;
  std::vector<int64_t> offsets_;  // (num_sources + 1) stream position where each source starts
  int64_t vocab_hint_ = -1;
  std::vector<std::vector<uint8_t>> masks_;  // per source; empty = no mask
  bool has_masks_ = false;
};

// Resolves config.paths, opens each file with the reader the format picks and concatenates
// them. An llm.c shard with a loss mask beside it (masks/NAME.mask) gets that mask attached. NotFound names a missing path; a dataset without tokens is InvalidArgument.
Result<std::unique_ptr<TokenDataset>> open_dataset(const DataConfig& config);

// Where a loader stands: the epoch and the position, within that epoch's window order, of
// the next window to serve (counted over all ranks). Saved in checkpoints.
struct DataCursor {
  uint64_t epoch = 0;
  uint64_t index = 0;
  bool operator==(const DataCursor&) const = default;
};

// How documents share a sequence (data.packing). Both cut the token stream into the same
// windows; they differ in what a window's tokens may see.
//   kConcat    the window is one sequence: attention and positions run across the documents in
//              it, and the token after an EOS is predicted from the document before (as
//              llm.c and Megatron train).
//   kDocument  each document in the window is a sequence of its own: a document ends at an EOS
//              token (eos_id), positions restart at 0 after it, attention never crosses it, and
//              the EOS token's target (the next document's first token) is not predicted.
enum class Packing : uint8_t { kConcat, kDocument };
const char* packing_name(Packing packing);  // "concat", "document"
// "concat" | "document"; InvalidArgument naming `key` and the values otherwise.
Result<Packing> parse_packing(std::string_view name, std::string_view key = "data.packing");

struct DataLoaderOptions {
  int64_t batch_size = 1;  // B: sequences per micro-batch on this rank
  int64_t seq_len = 1;     // T: tokens per sequence
  uint64_t seed = 0;       // window order of epoch e is a function of (seed, e) only
  int rank = 0;
  int world_size = 1;
  int64_t vocab_size = 0;  // > 0: a token id outside [0, vocab_size) fails next(); 0: unchecked
  Packing packing = Packing::kConcat;
  int64_t eos_id = -1;  // kDocument: the token id that ends a document (>= 0)
};

// Cuts the dataset into windows of T+1 tokens at stride T (inputs = window[0:T], targets =
// window[1:T+1]) and serves them in a pseudo-random order that depends only on (seed, epoch),
// the same on every platform. Each global step takes B * world_size windows from the order;
// rank r serves the r-th block of B, so ranks never share a window. The windows left over at
// the end of an epoch (fewer than B * world_size) are skipped and the next epoch starts.
// Borrows the dataset, which must outlive the loader. Not thread-safe.
class DataLoader {
 public:
  static Result<DataLoader> create(const TokenDataset* dataset, const DataLoaderOptions& options);

  // Fills one micro-batch and advances. inputs, targets: (B, T). On error nothing advances.
  // positions (B, T): with Packing::kDocument, each token's position in its document (what
  // Model::compute takes), and the targets of EOS tokens are -1; the first document of a row may
  // have begun before the window and counts from 0 at its start. REQUIRES: positions non-null
  // with kDocument; ignored (may be null) with kConcat.
  Status next(int32_t* inputs, int32_t* targets, int32_t* positions = nullptr);
  // The stream position of the first window the last next() read (for error messages).
  int64_t last_window_start() const { return last_start_; }

  int64_t num_windows() const { return num_windows_; }
  // Global steps (micro-batches per rank) in one epoch.
  int64_t batches_per_epoch() const { return num_windows_ / (options_.batch_size * options_.world_size); }
  const DataLoaderOptions& options() const { return options_; }

  DataCursor cursor() const { return cursor_; }
  // Resumes at a saved cursor. The index may come from a run with another batch size or
  // world size; it must not exceed num_windows().
  Status set_cursor(const DataCursor& cursor);

 private:
  DataLoader(const TokenDataset* dataset, const DataLoaderOptions& options, int64_t num_windows);
  void ensure_order(uint64_t epoch);

  const TokenDataset* dataset_;
  DataLoaderOptions options_;
  int64_t num_windows_;
  DataCursor cursor_;
  uint64_t order_epoch_ = 0;
  std::vector<int64_t> order_;   // window permutation for order_epoch_; empty until first use
  std::vector<int32_t> window_;  // (T + 1) scratch
  std::vector<uint8_t> mask_;    // (T + 1) scratch
  int64_t last_start_ = 0;
};

// The permutation of [0, n) that the loader uses for (seed, epoch): splitmix64 feeding a
// Fisher-Yates shuffle, unsigned 64-bit arithmetic only. Exposed for tests and tools.
std::vector<int64_t> window_order(int64_t n, uint64_t seed, uint64_t epoch);
// splitmix64's output function (Steele, Lea, Flood 2014): a 64-bit hash that is the same on every
// platform, behind the window order and data.eval_fraction's document split.
uint64_t splitmix64_mix(uint64_t z);

inline constexpr const char* kDefaultCorpusSource = "/usr/share/common-licenses";

// Writes a small English corpus that needs no download: the files of source_dir (sorted,
// symlinks resolved, each target once) concatenated into out_path, atomically (out_path.tmp,
// fsync, rename). Returns out_path. NotFound when source_dir is missing.
Result<std::string> build_default_corpus(const std::string& out_path,
                                         const std::string& source_dir = kDefaultCorpusSource);

}  // namespace strata
