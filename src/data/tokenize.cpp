#include "data/tokenize.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/progress.h"
#include "data/conversation.h"
#include "data/tokenizer.h"
#include "data/token_files.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using model::Tokenizer;
using nlohmann::json;

constexpr size_t kWriteBuffer = size_t{1} << 20;
// A text file larger than this is encoded in pieces of about kTextChunk bytes, cut after a
// newline that a letter or digit follows (no pre-tokenizer piece spans such a cut).
constexpr size_t kTextChunk = size_t{4} << 20;

// One output file, written as PATH.tmp and renamed by finish(). Unfinished, it removes its
// .tmp when destroyed. Movable, not copyable. Not thread-safe.
class OutFile {
 public:
  static Result<std::unique_ptr<OutFile>> create(const std::string& path) {
    auto f = std::unique_ptr<OutFile>(new OutFile(path));
    f->fd_ = ::open(f->tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f->fd_ < 0) return Status::IOError(f->tmp_ + ": cannot create: " + std::strerror(errno));
    std::vector<uint8_t> header(kLlmcHeaderBytes, 0);  // rewritten by finish()
    RETURN_IF_ERROR(f->append(header.data(), header.size()));
    return f;
  }
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;
  ~OutFile() {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(tmp_.c_str());
    }
  }

  Status append(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    buffer_.insert(buffer_.end(), p, p + n);
    return buffer_.size() >= kWriteBuffer ? flush() : Status::OK();
  }

  // Writes the header (magic, version, count), syncs, and renames PATH.tmp to PATH.
  Status finish(int32_t magic, int32_t version, int64_t count) {
    RETURN_IF_ERROR(flush());
    int32_t header[3] = {magic, version, static_cast<int32_t>(count)};
    if (::pwrite(fd_, header, sizeof(header), 0) != static_cast<ssize_t>(sizeof(header))) {
      return Status::IOError(tmp_ + ": header write failed: " + std::strerror(errno));
    }
    if (::fsync(fd_) != 0) return Status::IOError(tmp_ + ": fsync failed: " + std::strerror(errno));
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) {
      ::unlink(tmp_.c_str());
      return Status::IOError(tmp_ + ": close failed: " + std::strerror(errno));
    }
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      ::unlink(tmp_.c_str());
      return Status::IOError(tmp_ + ": rename to " + path_ + " failed: " + std::strerror(errno));
    }
    return Status::OK();
  }

 private:
  explicit OutFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") { buffer_.reserve(kWriteBuffer); }

  Status flush() {
    size_t done = 0;
    while (done < buffer_.size()) {
      ssize_t n = ::write(fd_, buffer_.data() + done, buffer_.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return Status::IOError(tmp_ + ": write failed: " + std::strerror(errno));
      done += static_cast<size_t>(n);
    }
    buffer_.clear();
    return Status::OK();
  }

  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  std::vector<uint8_t> buffer_;
};

// Cuts a token stream into shards (and mask files). Not thread-safe.
class ShardWriter {
 public:
  ShardWriter(std::string dir, int64_t shard_tokens, bool uint16, bool masks, TokenizeSummary* summary)
      : dir_(std::move(dir)), shard_tokens_(shard_tokens), uint16_(uint16), masks_(masks), summary_(summary) {}

  // mask: empty, or one entry per id.
  Status add(std::span<const int32_t> ids, std::span<const uint8_t> mask) {
    size_t i = 0;
    while (i < ids.size()) {
      if (!shard_) RETURN_IF_ERROR(open_next());
      const size_t n = std::min(ids.size() - i, static_cast<size_t>(shard_tokens_ - count_));
      if (uint16_) {
        scratch16_.assign(ids.begin() + i, ids.begin() + i + n);
        RETURN_IF_ERROR(shard_->append(scratch16_.data(), n * 2));
      } else {
        RETURN_IF_ERROR(shard_->append(ids.data() + i, n * 4));
      }
      if (masks_) {
        if (mask.empty()) {
          scratch8_.assign(n, 1);
          RETURN_IF_ERROR(mask_->append(scratch8_.data(), n));
        } else {
          RETURN_IF_ERROR(mask_->append(mask.data() + i, n));
        }
      }
      count_ += static_cast<int64_t>(n);
      i += n;
      if (count_ == shard_tokens_) RETURN_IF_ERROR(close_current());
    }
    return Status::OK();
  }

  Status finish() { return shard_ ? close_current() : Status::OK(); }

 private:
  Status open_next() {
    const std::string path = fmt::format("{}/train_{:06d}.bin", dir_, summary_->shards.size());
    ASSIGN_OR_RETURN(shard_, OutFile::create(path));
    summary_->shards.push_back(path);
    if (masks_) {
      const std::string mpath = loss_mask_path(path);
      ASSIGN_OR_RETURN(mask_, OutFile::create(mpath));
      summary_->masks.push_back(mpath);
    }
    count_ = 0;
    return Status::OK();
  }

  Status close_current() {
    RETURN_IF_ERROR(uint16_ ? shard_->finish(kLlmcMagicU16, kLlmcVersionU16, count_)
                            : shard_->finish(kLlmcMagicU32, kLlmcVersionU32, count_));
    shard_.reset();
    if (mask_) {
      RETURN_IF_ERROR(mask_->finish(kLossMaskMagic, 1, count_));
      mask_.reset();
    }
    return Status::OK();
  }

  std::string dir_;
  int64_t shard_tokens_;
  bool uint16_;
  bool masks_;
  TokenizeSummary* summary_;
  std::unique_ptr<OutFile> shard_;
  std::unique_ptr<OutFile> mask_;
  int64_t count_ = 0;  // tokens in the open shard
  std::vector<uint16_t> scratch16_;
  std::vector<uint8_t> scratch8_;
};

// What is at `path`, for messages: "a directory", "a FIFO", ... ("" for a regular file), or the
// error when nothing can be stat'ed there.
std::string file_kind(const std::string& path, std::error_code* ec) {
  const fs::file_status st = fs::status(path, *ec);
  if (*ec) return {};
  switch (st.type()) {
    case fs::file_type::regular: return {};
    case fs::file_type::directory: return "a directory";
    case fs::file_type::fifo: return "a FIFO";
    case fs::file_type::socket: return "a socket";
    case fs::file_type::block: return "a block device";
    case fs::file_type::character: return "a character device";
    default: return "not a regular file";
  }
}

// A file the data layer reads whole: a regular file of at most kMaxWholeFileBytes, or an error
// naming the path and what is there instead.
constexpr uint64_t kMaxWholeFileBytes = uint64_t{16} << 30;
Status check_readable_file(const std::string& path, const char* what) {
  std::error_code ec;
  const std::string kind = file_kind(path, &ec);
  if (ec) return Status::NotFound(path + ": no such " + what + " file (" + ec.message() + ")");
  if (!kind.empty()) {
    return Status::InvalidArgument(path + ": is " + kind + ", where the " + what + " file should be; give the path of "
                                   "a regular file");
  }
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) return Status::IOError(path + ": cannot read its size: " + ec.message());
  if (size > kMaxWholeFileBytes) {
    return Status::InvalidArgument(path + ": " + std::to_string(size) + " bytes, more than the " +
                                   std::to_string(kMaxWholeFileBytes >> 30) + " GiB limit for " + what + " files");
  }
  return Status::OK();
}

Result<std::string> read_whole(const std::string& path, const char* what) {
  RETURN_IF_ERROR(check_readable_file(path, what));
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(path + ": cannot open");
  std::string s;
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size < 0) return Status::IOError(path + ": cannot read its size");
  s.resize(static_cast<size_t>(size));
  in.seekg(0);
  in.read(s.data(), static_cast<std::streamsize>(s.size()));
  if (!in) return Status::IOError(path + ": read failed");
  return s;
}

bool ascii_alnum(char c) { return (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z'); }

class Tokenize {
 public:
  Tokenize(const TokenizeOptions& options, const Tokenizer& tok, ShardWriter* writer, Progress* progress,
           TokenizeSummary* summary)
      : options_(options), tok_(tok), writer_(writer), progress_(progress), summary_(summary) {}

  Status text_file(const std::string& path) {
    ASSIGN_OR_RETURN(std::string text, read_whole(path, "input"));
    const bool chunked = text.size() > kTextChunk && tok_.can_cut_after_newlines();
    if (options_.add_special_tokens) RETURN_IF_ERROR(emit(tok_.template_prefix(), {}));
    size_t begin = 0;
    while (begin < text.size()) {
      size_t end = text.size();
      if (chunked && text.size() - begin > 2 * kTextChunk) {
        size_t cut = text.find('\n', begin + kTextChunk);
        while (cut != std::string::npos && cut + 1 < text.size() && !ascii_alnum(text[cut + 1])) {
          cut = text.find('\n', cut + 1);
        }
        if (cut != std::string::npos && cut + 1 < text.size()) end = cut + 1;
      }
      ASSIGN_OR_RETURN(ids_, tok_.encode_all(std::string_view(text).substr(begin, end - begin), {}, path, begin));
      RETURN_IF_ERROR(emit(ids_, {}));
      summary_->bytes += static_cast<int64_t>(end - begin);
      progress_->set(static_cast<uint64_t>(summary_->bytes));
      begin = end;
    }
    if (options_.add_special_tokens) RETURN_IF_ERROR(emit(tok_.template_suffix(), {}));
    return end_document();
  }

  Status jsonl_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return Status::NotFound(path + ": cannot open");
    std::string line;
    int64_t number = 0;
    while (std::getline(in, line)) {
      ++number;
      summary_->bytes += static_cast<int64_t>(line.size()) + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string where = path + ":" + std::to_string(number);
      // Ordered: a conversation's keys reach the chat template in the order the line has them.
      const nlohmann::ordered_json doc = nlohmann::ordered_json::parse(line, nullptr, false);
      if (doc.is_discarded()) return Status::InvalidArgument(where + ": not valid JSON");
      if (!doc.is_object()) return Status::InvalidArgument(where + ": not a JSON object");
      if (options_.format == TokenizeFormat::kJsonl) {
        auto text = doc.find("text");
        if (text == doc.end() || !text->is_string()) return Status::InvalidArgument(where + ": no \"text\" string");
        ASSIGN_OR_RETURN(ids_, tok_.encode_all(text->get_ref<const std::string&>(),
                                               {.add_special_tokens = options_.add_special_tokens},
                                               where + ": \"text\""));
        RETURN_IF_ERROR(emit(ids_, {}));
        RETURN_IF_ERROR(end_document());
      } else {
        RETURN_IF_ERROR(chat_line(doc, where));
      }
      progress_->set(static_cast<uint64_t>(summary_->bytes));
    }
    if (in.bad()) return Status::IOError(path + ": read failed");
    return Status::OK();
  }

 private:
  Status chat_line(const nlohmann::ordered_json& doc, const std::string& where) {
    Result<nlohmann::ordered_json> messages = conversation_messages(doc);
    if (!messages.ok()) return messages.status().with_context(where);
    Result<model::EncodedChat> encoded = tok_.encode_chat(*messages);
    if (!encoded.ok()) return encoded.status().with_context(where);
    // The conversation exactly as the template renders it: no EOS after it (ChatML ends with
    // "<|im_end|>\n", the next conversation starts with its own header).
    RETURN_IF_ERROR(emit(encoded->ids, encoded->loss_mask));
    ++summary_->documents;
    return Status::OK();
  }

  Status emit(std::span<const int32_t> ids, std::span<const uint8_t> mask) {
    RETURN_IF_ERROR(writer_->add(ids, mask));
    summary_->tokens += static_cast<int64_t>(ids.size());
    if (mask.empty()) {
      summary_->loss_tokens += static_cast<int64_t>(ids.size());
    } else {
      for (uint8_t m : mask) summary_->loss_tokens += m;
    }
    return Status::OK();
  }

  // The EOS after a text document.
  Status end_document() {
    const int32_t eos = tok_.eos_id();
    ++summary_->documents;
    return emit(std::span<const int32_t>(&eos, 1), {});
  }

  const TokenizeOptions& options_;
  const Tokenizer& tok_;
  ShardWriter* writer_;
  Progress* progress_;
  TokenizeSummary* summary_;
  std::vector<int32_t> ids_;
};

Result<TokenizeSummary> run(const TokenizeOptions& options, TokenizeSummary* summary) {
  if (options.inputs.empty()) return Status::InvalidArgument("no input files");
  if (options.shard_tokens < 1 || options.shard_tokens > INT32_MAX) {
    return Status::InvalidArgument("shard_tokens must be between 1 and 2^31-1 (the llm.c header holds an int32 count)");
  }
  int64_t total_bytes = 0;
  for (const std::string& in : options.inputs) {
    std::error_code ec;
    RETURN_IF_ERROR(check_readable_file(in, "input"));
    total_bytes += static_cast<int64_t>(fs::file_size(in, ec));
  }
  ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::load(options.tokenizer));
  if (tok.eos_id() < 0) {
    return Status::InvalidArgument(options.tokenizer + ": the tokenizer has no EOS token to separate documents; set "
                                   "eos_token in tokenizer_config.json");
  }
  if (options.format == TokenizeFormat::kChat) {
    // Fails early, naming tokenizer_config.json, when there is no template.
    if (!tok.chat_template()) return tok.encode_chat(nlohmann::ordered_json::array()).status();
  }
  summary->vocab_size = tok.vocab_size();
  std::error_code ec;
  fs::create_directories(options.out_dir, ec);
  if (ec) return Status::IOError(options.out_dir + ": cannot create directory: " + ec.message());
  const std::string first = options.out_dir + "/train_000000.bin";
  if (fs::exists(first, ec)) {
    return Status::InvalidArgument(options.out_dir + " already holds shards (" + first +
                                   "); remove them or choose another output directory");
  }
  const bool masks = options.format == TokenizeFormat::kChat;
  if (masks) {
    fs::create_directories(options.out_dir + "/masks", ec);
    if (ec) return Status::IOError(options.out_dir + "/masks: cannot create directory: " + ec.message());
  }
  ShardWriter writer(options.out_dir, options.shard_tokens, tok.vocab_size() <= 65536, masks, summary);
  ProgressOptions po;
  po.enabled = options.progress;
  po.note = [summary] { return fmt::format("{} tokens", summary->tokens); };
  Progress progress("tokenize", static_cast<uint64_t>(total_bytes), po);
  Tokenize work(options, tok, &writer, &progress, summary);
  for (const std::string& in : options.inputs) {
    RETURN_IF_ERROR(options.format == TokenizeFormat::kText ? work.text_file(in) : work.jsonl_file(in));
  }
  RETURN_IF_ERROR(writer.finish());
  progress.set(static_cast<uint64_t>(summary->bytes));
  progress.finish();
  if (summary->tokens == 0) return Status::InvalidArgument("the inputs hold no documents");
  // Makes the renames durable.
  int dir = ::open(options.out_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
  return *summary;
}

}  // namespace

Result<TokenizeFormat> parse_tokenize_format(std::string_view name) {
  if (name == "text") return TokenizeFormat::kText;
  if (name == "jsonl") return TokenizeFormat::kJsonl;
  if (name == "chat") return TokenizeFormat::kChat;
  return Status::InvalidArgument("unknown format '" + std::string(name) + "' (text, jsonl or chat)");
}

Result<int64_t> parse_token_count(std::string_view text) {
  const std::string s(text);
  const auto bad = [&] {
    return Status::InvalidArgument("'" + s + "' is not a token count (e.g. 100M, 1.5B, 250k, 4096)");
  };
  if (s.empty()) return bad();
  double scale = 1;
  std::string digits = s;
  switch (s.back() | 0x20) {
    case 'k': scale = 1e3; break;
    case 'm': scale = 1e6; break;
    case 'g': case 'b': scale = 1e9; break;
    case 't': scale = 1e12; break;
    default: break;
  }
  if (scale != 1) digits.pop_back();
  if (digits.empty() || digits.find_first_not_of("0123456789.") != std::string::npos ||
      std::count(digits.begin(), digits.end(), '.') > 1 || (scale == 1 && digits.find('.') != std::string::npos)) {
    return bad();
  }
  const double value = std::strtod(digits.c_str(), nullptr) * scale;
  if (!(value >= 1) || value > 9e18) return bad();
  return static_cast<int64_t>(std::floor(value));
}

Result<TokenizeSummary> tokenize_to_shards(const TokenizeOptions& options) {
  TokenizeSummary summary;
  Result<TokenizeSummary> result = run(options, &summary);
  if (!result.ok()) {  // leaves no partial dataset behind
    std::error_code ec;
    for (const std::string& p : summary.shards) fs::remove(p, ec);
    for (const std::string& p : summary.masks) fs::remove(p, ec);
  }
  return result;
}

std::string loss_mask_path(const std::string& shard_path) {
  const fs::path p(shard_path);
  return (p.parent_path() / "masks" / p.stem()).string() + ".mask";
}

Result<std::vector<uint8_t>> read_loss_mask(const std::string& path) {
  ASSIGN_OR_RETURN(std::string data, read_whole(path, "loss mask"));
  if (data.size() < static_cast<size_t>(kLlmcHeaderBytes)) return Status::Corruption(path + ": shorter than its header");
  int32_t header[3];
  std::memcpy(header, data.data(), sizeof(header));
  if (header[0] != kLossMaskMagic || header[1] != 1) {
    return Status::Corruption(path + ": not a loss mask (magic " + std::to_string(header[0]) + ", expected " +
                              std::to_string(kLossMaskMagic) + ")");
  }
  if (header[2] < 0 || data.size() != static_cast<size_t>(kLlmcHeaderBytes) + static_cast<size_t>(header[2])) {
    return Status::Corruption(path + ": header says " + std::to_string(header[2]) + " tokens but the file holds " +
                              std::to_string(data.size() - static_cast<size_t>(kLlmcHeaderBytes)));
  }
  std::vector<uint8_t> mask(data.begin() + kLlmcHeaderBytes, data.end());
  for (size_t i = 0; i < mask.size(); ++i) {
    if (mask[i] > 1) {
      return Status::Corruption(path + ": token " + std::to_string(i) + " has mask value " + std::to_string(mask[i]) +
                                "; a loss mask holds 0 (not counted) or 1 (counted); write it again with strata data "
                                "tokenize");
    }
  }
  return mask;
}

}  // namespace strata
