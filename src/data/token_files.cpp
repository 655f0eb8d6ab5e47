#include "data/token_files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata {

// Token files are little endian on disk and decoded with plain loads; every host strata
// targets (x86-64, aarch64) is little endian too.
static_assert(std::endian::native == std::endian::little, "token readers assume a little-endian host");

// ---------------------------------------------------------------------------------------------
// MappedFile

Result<MappedFile> MappedFile::open(const std::string& path) {
  MappedFile file;
  file.path_ = path;
  file.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file.fd_ < 0) {
    int err = errno;
    if (err == ENOENT) return Status::NotFound(path + ": no such file; check the data path");
    return Status::IOError(path + ": cannot open: " + std::strerror(err));
  }
  struct stat st;
  if (::fstat(file.fd_, &st) != 0) return Status::IOError(path + ": fstat failed: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return Status::InvalidArgument(path + ": not a regular file");
  file.size_ = static_cast<int64_t>(st.st_size);
  if (file.size_ > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(file.size_), PROT_READ, MAP_PRIVATE, file.fd_, 0);
    if (p == MAP_FAILED) return Status::IOError(path + ": mmap failed: " + std::strerror(errno));
    file.data_ = static_cast<const uint8_t*>(p);
  }
  return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept { *this = std::move(other); }

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() { release(); }

void MappedFile::unmap() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(size_));
  data_ = nullptr;
}

Status MappedFile::read_at(int64_t offset, int64_t bytes, void* dst) const {
  CHECK_MSG(offset >= 0 && bytes >= 0 && offset + bytes <= size_, path_ + ": read past the size it was opened with");
  auto* out = static_cast<uint8_t*>(dst);
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd_, out + done, static_cast<size_t>(bytes - done), offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::IOError(path_ + ": read of bytes [" + std::to_string(offset) + ", " +
                                      std::to_string(offset + bytes) + ") failed: " + std::strerror(errno));
    if (n == 0) {
      return Status::Corruption(path_ + ": the file ends at byte " + std::to_string(offset + done) + ", but it had " +
                                std::to_string(size_) + " bytes when the run opened it: it was truncated while the "
                                "run read it; restore it and resume from the last checkpoint");
    }
    done += n;
  }
  return Status::OK();
}

void MappedFile::release() {
  unmap();
  if (fd_ >= 0) ::close(fd_);
  data_ = nullptr;
  fd_ = -1;
  size_ = 0;
}

namespace {

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Decodes n little-endian values of type T into int32 ids. Types whose range can leave
// [0, 2^31) are checked so that a corrupt or mistyped file fails instead of wrapping.
template <typename T>
Status decode(const uint8_t* src, int64_t n, int32_t* out, const std::string& path, int64_t first_pos) {
  for (int64_t i = 0; i < n; ++i) {
    T v = load<T>(src + i * static_cast<int64_t>(sizeof(T)));
    bool bad = false;
    if constexpr (std::is_signed_v<T>) bad = v < 0;
    if constexpr (sizeof(T) >= 4 && !std::is_same_v<T, int32_t>) {
      bad = bad || static_cast<int64_t>(v) > std::numeric_limits<int32_t>::max();
    }
    if (bad) {
      return Status::Corruption(path + ": token " + std::to_string(v) + " at position " +
                                std::to_string(first_pos + i) +
                                " is not a valid token id (negative or above 2^31-1); the file is "
                                "corrupt or was written with another dtype");
    }
    out[i] = static_cast<int32_t>(v);
  }
  return Status::OK();
}

// Element types a Megatron .idx may name (integer ones only) and llm.c shards use.
enum class TokenType : uint8_t { kU8, kI8, kI16, kI32, kI64, kU16, kU32 };

int64_t type_bytes(TokenType t) {
  switch (t) {
    case TokenType::kU8:
    case TokenType::kI8: return 1;
    case TokenType::kI16:
    case TokenType::kU16: return 2;
    case TokenType::kI32:
    case TokenType::kU32: return 4;
    case TokenType::kI64: return 8;
  }
  return 0;
}

Status decode_as(TokenType t, const uint8_t* src, int64_t n, int32_t* out, const std::string& path,
                 int64_t first_pos) {
  switch (t) {
    case TokenType::kU8: return decode<uint8_t>(src, n, out, path, first_pos);
    case TokenType::kI8: return decode<int8_t>(src, n, out, path, first_pos);
    case TokenType::kI16: return decode<int16_t>(src, n, out, path, first_pos);
    case TokenType::kU16: return decode<uint16_t>(src, n, out, path, first_pos);
    case TokenType::kI32: return decode<int32_t>(src, n, out, path, first_pos);
    case TokenType::kU32: return decode<uint32_t>(src, n, out, path, first_pos);
    case TokenType::kI64: return decode<int64_t>(src, n, out, path, first_pos);
  }
  return Status::Internal("unknown token type");
}

// n tokens of `type` at byte `offset` of `file`, decoded into out; pos names the first in errors.
Status read_tokens(const MappedFile& file, int64_t offset, TokenType type, int64_t n, int32_t* out, int64_t pos) {
  std::vector<uint8_t> bytes(static_cast<size_t>(n * type_bytes(type)));
  RETURN_IF_ERROR(file.read_at(offset, static_cast<int64_t>(bytes.size()), bytes.data()));
  return decode_as(type, bytes.data(), n, out, file.path(), pos);
}

void check_range(const TokenSource& s, int64_t pos, int64_t n) {
  CHECK_MSG(pos >= 0 && n >= 0 && pos + n <= s.num_tokens(),
            s.path() + ": read [" + std::to_string(pos) + ", " + std::to_string(pos + n) + ") of " +
                std::to_string(s.num_tokens()) + " tokens");
}

// A contiguous array of tokens inside one mapping: llm.c shards and text files.
class FlatSource final : public TokenSource {
 public:
  FlatSource(MappedFile file, int64_t offset, int64_t num_tokens, TokenType type, int64_t vocab_hint)
      : file_(std::move(file)), offset_(offset), num_tokens_(num_tokens), type_(type), vocab_hint_(vocab_hint) {}

  const std::string& path() const override { return file_.path(); }
  int64_t num_tokens() const override { return num_tokens_; }
  int64_t vocab_hint() const override { return vocab_hint_; }
  Status read(int64_t pos, int64_t n, int32_t* out) const override {
    check_range(*this, pos, n);
    if (n == 0) return Status::OK();
    return read_tokens(file_, offset_ + pos * type_bytes(type_), type_, n, out, pos);
  }

 private:
  MappedFile file_;
  int64_t offset_;  // bytes before the first token
  int64_t num_tokens_;
  TokenType type_;
  int64_t vocab_hint_;
};

// Megatron sequences concatenated into one stream. Sizes and byte offsets are copied out of
// the .idx at open (the .idx is not kept mapped); the .bin stays mapped.
class MegatronSource final : public TokenSource {
 public:
  MegatronSource(MappedFile bin, TokenType type, std::vector<int64_t> seq_start, std::vector<int64_t> pointers)
      : bin_(std::move(bin)), type_(type), seq_start_(std::move(seq_start)), pointers_(std::move(pointers)) {}

  const std::string& path() const override { return bin_.path(); }
  int64_t num_tokens() const override { return seq_start_.back(); }
  int64_t vocab_hint() const override { return -1; }
  Status read(int64_t pos, int64_t n, int32_t* out) const override {
    check_range(*this, pos, n);
    // The sequence holding `pos`: the last one starting at or before it.
    size_t seq = static_cast<size_t>(std::upper_bound(seq_start_.begin(), seq_start_.end(), pos) -
                                      seq_start_.begin()) - 1;
    while (n > 0) {
      int64_t in_seq = pos - seq_start_[seq];
      int64_t take = std::min(n, seq_start_[seq + 1] - pos);
      if (take > 0) {
        RETURN_IF_ERROR(read_tokens(bin_, pointers_[seq] + in_seq * type_bytes(type_), type_, take, out, pos));
      }
      pos += take;
      out += take;
      n -= take;
      ++seq;
    }
    return Status::OK();
  }

 private:
  MappedFile bin_;
  TokenType type_;
  std::vector<int64_t> seq_start_;  // (num_sequences + 1) stream position of each sequence
  std::vector<int64_t> pointers_;   // (num_sequences) byte offset of each sequence in .bin
};

std::string bytes_str(int64_t n) { return std::to_string(n) + " bytes"; }

bool starts_with_bytes(const std::string& path, const void* magic, size_t n) {
  auto file = MappedFile::open(path);
  if (!file.ok() || file->size() < static_cast<int64_t>(n)) return false;
  return std::memcmp(file->data(), magic, n) == 0;
}

}  // namespace

bool has_llmc_magic(const std::string& path) {
  auto file = MappedFile::open(path);
  if (!file.ok() || file->size() < 4) return false;
  int32_t magic = load<int32_t>(file->data());
  return magic == kLlmcMagicU16 || magic == kLlmcMagicU32;
}

bool has_megatron_magic(const std::string& path) {
  return starts_with_bytes(path, kMegatronIdxMagic, sizeof(kMegatronIdxMagic));
}

Result<std::unique_ptr<TokenSource>> open_llmc_shard(const std::string& path) {
  ASSIGN_OR_RETURN(MappedFile file, MappedFile::open(path));
  if (file.size() < kLlmcHeaderBytes) {
    return Status::Corruption(path + ": too short for an llm.c shard: " + bytes_str(file.size()) +
                              ", but the header alone is " + bytes_str(kLlmcHeaderBytes) +
                              "; re-create the shard");
  }
  const uint8_t* h = file.data();
  int32_t magic = load<int32_t>(h);
  int32_t version = load<int32_t>(h + 4);
  int32_t count = load<int32_t>(h + 8);
  TokenType type;
  if (magic == kLlmcMagicU16) {
    type = TokenType::kU16;
  } else if (magic == kLlmcMagicU32) {
    type = TokenType::kU32;
  } else {
    return Status::Corruption(path + ": bad magic " + std::to_string(magic) + ": expected " +
                              std::to_string(kLlmcMagicU16) + " (uint16 tokens) or " +
                              std::to_string(kLlmcMagicU32) +
                              " (uint32 tokens); not an llm.c shard (set the data format if it is another kind)");
  }
  // uint32 shards written by older strata carry version 1; llm.c itself writes 7.
  const bool version_ok = type == TokenType::kU16 ? version == kLlmcVersionU16
                                                  : (version == kLlmcVersionU32 || version == 1);
  if (!version_ok) {
    return Status::Corruption(path + ": unsupported llm.c shard version " + std::to_string(version) + ", expected " +
                              (type == TokenType::kU16 ? std::to_string(kLlmcVersionU16) + " for uint16 tokens"
                                                       : std::to_string(kLlmcVersionU32) + " for uint32 tokens") +
                              "; re-create the shard");
  }
  if (count < 0) {
    return Status::Corruption(path + ": header says " + std::to_string(count) + " tokens; re-create the shard");
  }
  int64_t expected = kLlmcHeaderBytes + int64_t{count} * type_bytes(type);
  if (file.size() != expected) {
    const char* what = file.size() < expected ? "truncated" : "size mismatch";
    return Status::Corruption(path + ": " + what + ": header says " + std::to_string(count) + " tokens (" +
                              bytes_str(expected) + ") but the file has " + bytes_str(file.size()) +
                              "; re-create the shard");
  }
  file.unmap();
  return std::unique_ptr<TokenSource>(
      std::make_unique<FlatSource>(std::move(file), kLlmcHeaderBytes, int64_t{count}, type, -1));
}

Result<std::unique_ptr<TokenSource>> open_megatron(const std::string& prefix) {
  const std::string idx_path = prefix + ".idx";
  const std::string bin_path = prefix + ".bin";
  ASSIGN_OR_RETURN(MappedFile idx, MappedFile::open(idx_path));
  ASSIGN_OR_RETURN(MappedFile bin, MappedFile::open(bin_path));

  constexpr int64_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;
  if (idx.size() < kHeaderBytes) {
    return Status::Corruption(idx_path + ": too short for a Megatron index: " + bytes_str(idx.size()) +
                              ", the header alone is " + bytes_str(kHeaderBytes));
  }
  const uint8_t* p = idx.data();
  if (std::memcmp(p, kMegatronIdxMagic, sizeof(kMegatronIdxMagic)) != 0) {
    return Status::Corruption(idx_path + ": bad magic: expected \"MMIDIDX\\0\\0\"; not a Megatron index");
  }
  uint64_t version = load<uint64_t>(p + 9);
  if (version != 1) {
    return Status::Corruption(idx_path + ": unsupported Megatron index version " + std::to_string(version) +
                              ", expected 1");
  }
  uint8_t dtype = p[17];
  TokenType type;
  switch (dtype) {
    case 1: type = TokenType::kU8; break;
    case 2: type = TokenType::kI8; break;
    case 3: type = TokenType::kI16; break;
    case 4: type = TokenType::kI32; break;
    case 5: type = TokenType::kI64; break;
    case 8: type = TokenType::kU16; break;
    case 6:
    case 7:
      return Status::Corruption(idx_path + ": dtype code " + std::to_string(dtype) +
                                " is a float type; token files need an integer dtype (1-5 or 8)");
    default:
      return Status::Corruption(idx_path + ": unknown dtype code " + std::to_string(dtype) +
                                "; expected an integer type: 1-5 or 8");
  }
  uint64_t num_seq = load<uint64_t>(p + 18);
  uint64_t num_docs = load<uint64_t>(p + 26);
  // Checked in unsigned arithmetic with a cap first so that absurd counts cannot overflow.
  const uint64_t kMaxCount = uint64_t{1} << 40;
  uint64_t needed = num_seq < kMaxCount && num_docs < kMaxCount
                        ? static_cast<uint64_t>(kHeaderBytes) + num_seq * 12 + num_docs * 8
                        : std::numeric_limits<uint64_t>::max();
  if (needed > static_cast<uint64_t>(idx.size())) {
    return Status::Corruption(idx_path + ": truncated: header says " + std::to_string(num_seq) + " sequences and " +
                              std::to_string(num_docs) + " documents (" + std::to_string(needed) +
                              " bytes) but the file has " + bytes_str(idx.size()) + "; re-create the index");
  }
  const uint8_t* sizes = p + kHeaderBytes;
  const uint8_t* ptrs = sizes + num_seq * 4;
  const int64_t elem = type_bytes(type);
  std::vector<int64_t> seq_start(num_seq + 1, 0);
  std::vector<int64_t> pointers(num_seq);
  for (uint64_t i = 0; i < num_seq; ++i) {
    int64_t size = load<int32_t>(sizes + i * 4);
    int64_t ptr = load<int64_t>(ptrs + i * 8);
    if (size < 0 || ptr < 0 || ptr > bin.size() || size * elem > bin.size() - ptr) {
      return Status::Corruption(idx_path + ": sequence " + std::to_string(i) + " (" + std::to_string(size) +
                                " tokens at byte " + std::to_string(ptr) + ") lies outside " + bin_path +
                                ", which has " + bytes_str(bin.size()) +
                                "; the .idx and .bin do not belong together or one is truncated");
    }
    // Megatron writes each sequence at a multiple of its dtype's size; a pointer that is not
    // would be read shifted by a byte and train on garbage.
    if (ptr % elem != 0) {
      return Status::Corruption(idx_path + ": sequence " + std::to_string(i) + " starts at byte " + std::to_string(ptr) +
                                " of " + bin_path + ", not a multiple of its " + std::to_string(elem) +
                                "-byte tokens; the index is corrupt or was written for another dtype: re-create it");
    }
    seq_start[i + 1] = seq_start[i] + size;
    pointers[i] = ptr;
  }
  bin.unmap();
  return std::unique_ptr<TokenSource>(
      std::make_unique<MegatronSource>(std::move(bin), type, std::move(seq_start), std::move(pointers)));
}

Result<std::unique_ptr<TokenSource>> open_text(const std::string& path) {
  ASSIGN_OR_RETURN(MappedFile file, MappedFile::open(path));
  file.unmap();
  int64_t n = file.size();
  return std::unique_ptr<TokenSource>(std::make_unique<FlatSource>(std::move(file), 0, n, TokenType::kU8, 256));
}

}  // namespace strata
