// Token files on disk: llm.c shards, Megatron .bin/.idx pairs and plain text (one token per
// byte). Headers and indexes are parsed from a read-only memory map at open; the tokens are then
// read with pread at explicit offsets, so that a file truncated while a run reads it gives an
// error naming it (a mapping would raise SIGBUS and kill the process). A file replaced by
// rename keeps being read as it was opened (the descriptor holds the old file). open_dataset (data.h) picks the reader; these
// entry points are public so that a tool or a test can open one file with a known format.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"

namespace strata {

// A read-only view of a whole file: mapped at open, and readable with read_at() at any time.
// Owns the descriptor and the mapping; movable, not copyable. Safe for concurrent reads.
class MappedFile {
 public:
  static Result<MappedFile> open(const std::string& path);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const std::string& path() const { return path_; }
  // The mapping; null for an empty file and after unmap().
  const uint8_t* data() const { return data_; }
  // The size at open.
  int64_t size() const { return size_; }
  // Drops the mapping (read_at() still works): readers keep none past open.
  void unmap();
  // Copies bytes [offset, offset + bytes) of the file to dst with pread. Corruption naming the
  // file when it now ends before them (truncated since it was opened); IOError on a read error.
  // REQUIRES: 0 <= offset, 0 <= bytes, offset + bytes <= size().
  Status read_at(int64_t offset, int64_t bytes, void* dst) const;

 private:
  void release();

  std::string path_;
  int fd_ = -1;
  const uint8_t* data_ = nullptr;  // null for an empty file (mmap of 0 bytes is an error)
  int64_t size_ = 0;
};

// One file (or file pair) seen as a flat stream of token ids. Safe for concurrent reads.
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  // The file named in error messages (the .bin of a Megatron pair).
  virtual const std::string& path() const = 0;
  virtual int64_t num_tokens() const = 0;
  // 256 for byte-level text; -1 when the file does not say.
  virtual int64_t vocab_hint() const = 0;
  // Copies tokens [pos, pos + n) to out. Fails (Corruption) on an id that does not fit a
  // non-negative int32. REQUIRES: 0 <= pos, n >= 0, pos + n <= num_tokens().
  virtual Status read(int64_t pos, int64_t n, int32_t* out) const = 0;
};

// llm.c magic numbers (header[0]) for uint16 (GPT-2) and uint32 (Llama-3) tokens, and the
// header version (header[1]) llm.c writes and requires with each: dev/data/data_common.py
// writes version 1 with the uint16 magic and version 7 with the uint32 one.
inline constexpr int32_t kLlmcMagicU16 = 20240520;
inline constexpr int32_t kLlmcMagicU32 = 20240801;
inline constexpr int32_t kLlmcVersionU16 = 1;
inline constexpr int32_t kLlmcVersionU32 = 7;
inline constexpr int64_t kLlmcHeaderInts = 256;
inline constexpr int64_t kLlmcHeaderBytes = kLlmcHeaderInts * 4;

// The 9-byte magic at the start of a Megatron .idx file.
inline constexpr char kMegatronIdxMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};

// True when the file starts with an llm.c magic. Only reads the first 4 bytes.
bool has_llmc_magic(const std::string& path);
// True when the file starts with the Megatron .idx magic.
bool has_megatron_magic(const std::string& path);

// An llm.c shard: 256 little-endian int32 header (magic, version, token count, zeros) then the
// tokens. Accepts version 1 with uint16 tokens and version 7 with uint32 tokens, as llm.c does,
// and also version 1 with uint32 tokens, which strata wrote before it followed llm.c.
Result<std::unique_ptr<TokenSource>> open_llmc_shard(const std::string& path);
// A Megatron indexed dataset: `prefix` + ".idx" and `prefix` + ".bin". Its sequences are
// read back to back as one stream.
Result<std::unique_ptr<TokenSource>> open_megatron(const std::string& prefix);
// Any file, one token per byte.
Result<std::unique_ptr<TokenSource>> open_text(const std::string& path);

}  // namespace strata
