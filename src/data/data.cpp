#include "data/data.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include "core/log.h"
#include "data/tokenize.h"

namespace strata {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// TokenDataset

TokenDataset::TokenDataset(std::vector<std::unique_ptr<TokenSource>> sources) : sources_(std::move(sources)) {
  offsets_.reserve(sources_.size() + 1);
  offsets_.push_back(0);
  bool all_text = !sources_.empty();
  for (const auto& s : sources_) {
    CHECK(s != nullptr);
    offsets_.push_back(offsets_.back() + s->num_tokens());
    all_text = all_text && s->vocab_hint() == 256;
  }
  vocab_hint_ = all_text ? 256 : -1;
}

Status TokenDataset::attach_mask(int64_t source, std::vector<uint8_t> mask) {
  CHECK(source >= 0 && source < num_sources());
  const TokenSource& src = *sources_[static_cast<size_t>(source)];
  if (static_cast<int64_t>(mask.size()) != src.num_tokens())
    return Status::InvalidArgument("the loss mask of " + src.path() + " has " + std::to_string(mask.size()) +
                                   " entries but the shard has " + std::to_string(src.num_tokens()) +
                                   " tokens; re-run strata data tokenize");
  masks_.resize(sources_.size());
  masks_[static_cast<size_t>(source)] = std::move(mask);
  has_masks_ = true;
  return Status::OK();
}

void TokenDataset::read_mask(int64_t pos, int64_t n, uint8_t* out) const {
  for (int64_t i = 0; i < n; ++i) {
    const size_t s = source_index(pos + i);
    const bool masked = s < masks_.size() && !masks_[s].empty();
    out[i] = masked ? masks_[s][static_cast<size_t>(pos + i - offsets_[s])] : 1;
  }
}

size_t TokenDataset::source_index(int64_t pos) const {
  // The last source starting at or before pos; empty sources share their start with the next
  // source, and upper_bound steps past them.
  auto it = std::upper_bound(offsets_.begin(), offsets_.end(), pos);
  return static_cast<size_t>(it - offsets_.begin()) - 1;
}

Status TokenDataset::read(int64_t pos, int64_t n, int32_t* out) const {
  CHECK_MSG(pos >= 0 && n >= 0 && pos + n <= num_tokens(),
            "dataset read [" + std::to_string(pos) + ", " + std::to_string(pos + n) + ") of " +
                std::to_string(num_tokens()) + " tokens");
  if (n == 0) return Status::OK();
  size_t s = source_index(pos);
  while (n > 0) {
    int64_t take = std::min(n, offsets_[s + 1] - pos);
    if (take > 0) RETURN_IF_ERROR(sources_[s]->read(pos - offsets_[s], take, out));
    pos += take;
    out += take;
    n -= take;
    ++s;
  }
  return Status::OK();
}

std::string TokenDataset::describe_position(int64_t pos) const {
  CHECK(pos >= 0 && pos < num_tokens());
  size_t s = source_index(pos);
  return "position " + std::to_string(pos - offsets_[s]) + " in " + sources_[s]->path();
}

// ---------------------------------------------------------------------------------------------
// open_dataset

namespace {

// Directory entries without the throwing iterator increment that range-for would use.
std::vector<fs::path> list_directory(const std::string& dir, std::error_code* ec) {
  std::vector<fs::path> out;
  for (fs::directory_iterator it(dir, *ec), end; !*ec && it != end; it.increment(*ec)) out.push_back(it->path());
  return out;
}

bool is_glob(const std::string& p) { return p.find_first_of("*?[") != std::string::npos; }

bool is_regular(const std::string& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);  // follows symlinks
}

// Expands one DataConfig entry into files. A Megatron prefix (no file, but prefix.idx and
// prefix.bin exist) becomes prefix.idx, which detection maps back to the pair.
Status expand_path(const std::string& p, const std::string& format, std::vector<std::string>* files) {
  if (is_glob(p)) {
    glob_t g{};
    int rc = ::glob(p.c_str(), 0, nullptr, &g);
    std::vector<std::string> matches;
    if (rc == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) matches.emplace_back(g.gl_pathv[i]);
    }
    ::globfree(&g);
    if (rc != 0 && rc != GLOB_NOMATCH) return Status::IOError(p + ": glob failed (code " + std::to_string(rc) + ")");
    size_t before = files->size();
    for (const auto& m : matches) {
      if (is_regular(m)) files->push_back(m);
    }
    if (files->size() == before) {
      return Status::NotFound(p + ": pattern matches no files; check the data path and that the data was prepared");
    }
    return Status::OK();
  }
  std::error_code ec;
  if (fs::is_directory(p, ec)) {
    std::vector<std::string> found;
    for (const auto& e : list_directory(p, &ec)) {
      const std::string name = e.filename().string();
      if (!name.empty() && name[0] != '.' && is_regular(e.string())) found.push_back(e.string());
    }
    if (ec) return Status::IOError(p + ": cannot list directory: " + ec.message());
    if (found.empty()) return Status::NotFound(p + ": directory holds no data files");
    std::sort(found.begin(), found.end());
    files->insert(files->end(), found.begin(), found.end());
    return Status::OK();
  }
  if (fs::exists(p, ec)) {
    if (!is_regular(p)) return Status::InvalidArgument(p + ": not a regular file or directory");
    files->push_back(p);
    return Status::OK();
  }
  if ((format == "auto" || format == "megatron") && is_regular(p + ".idx") && is_regular(p + ".bin")) {
    files->push_back(p + ".idx");
    return Status::OK();
  }
  return Status::NotFound(p + ": no such file or directory; give a file, a directory or a glob pattern such as "
                          "data/*.bin (build a corpus without downloads with build_default_corpus)");
}

bool has_extension(const std::string& p, const char* ext) { return fs::path(p).extension() == ext; }

std::string strip_extension(const std::string& p) {
  fs::path path(p);
  return path.replace_extension().string();
}

std::string canonical_key(const std::string& p) {
  std::error_code ec;
  fs::path c = fs::weakly_canonical(p, ec);
  return ec ? p : c.string();
}

// Opens one expanded file; sets *skip when it is the second half of a pair already opened.
Result<std::unique_ptr<TokenSource>> open_file(const std::string& file, const std::string& format,
                                               std::set<std::string>* seen, bool* skip) {
  *skip = false;
  bool megatron = false;
  if (format == "megatron") {
    if (!has_extension(file, ".bin") && !has_extension(file, ".idx")) {
      return Status::InvalidArgument(file + ": a Megatron dataset is a .bin/.idx pair; give either file or "
                                            "their common prefix");
    }
    megatron = true;
  } else if (format == "auto") {
    megatron = has_extension(file, ".idx") ||
               (has_extension(file, ".bin") && is_regular(strip_extension(file) + ".idx"));
  }
  const std::string key = canonical_key(megatron ? strip_extension(file) + ".idx" : file);
  if (!seen->insert(key).second) {
    *skip = true;
    return std::unique_ptr<TokenSource>();
  }
  if (megatron) return open_megatron(strip_extension(file));
  if (format == "llmc") return open_llmc_shard(file);
  if (format == "text") return open_text(file);
  // auto: a .bin must be an llm.c shard (its reader explains what is wrong with it); other
  // files are text unless they carry the llm.c magic.
  if (has_extension(file, ".bin") || has_llmc_magic(file)) return open_llmc_shard(file);
  return open_text(file);
}

}  // namespace

Result<std::unique_ptr<TokenDataset>> open_dataset(const DataConfig& config) {
  const std::string& format = config.format;
  if (format != "auto" && format != "llmc" && format != "megatron" && format != "text") {
    return Status::InvalidArgument("data format '" + format + "' is not one of auto, llmc, megatron, text");
  }
  if (config.paths.empty()) {
    return Status::InvalidArgument("no data paths given; name token files, directories or glob patterns");
  }
  std::vector<std::string> files;
  for (const auto& p : config.paths) RETURN_IF_ERROR(expand_path(p, format, &files));

  std::set<std::string> seen;
  std::vector<std::unique_ptr<TokenSource>> sources;
  for (const auto& f : files) {
    bool skip = false;
    ASSIGN_OR_RETURN(auto source, open_file(f, format, &seen, &skip));
    if (!skip) sources.push_back(std::move(source));
  }
  auto dataset = std::make_unique<TokenDataset>(std::move(sources));
  for (int64_t i = 0; i < dataset->num_sources(); ++i) {
    const std::string mask_path = loss_mask_path(dataset->source(i).path());
    if (!std::filesystem::exists(mask_path)) continue;
    ASSIGN_OR_RETURN(std::vector<uint8_t> mask, read_loss_mask(mask_path));
    RETURN_IF_ERROR(dataset->attach_mask(i, std::move(mask)));
    LOG_INFO("data: {} masks the loss of {}", mask_path, dataset->source(i).path());
  }
  if (dataset->num_tokens() == 0) {
    std::string names;
    for (const auto& p : config.paths) names += (names.empty() ? "" : ", ") + p;
    return Status::InvalidArgument(config.what + " has no tokens: every file under " + names +
                                   " is empty; check that the data was prepared");
  }
  LOG_INFO("{}: {} files, {} tokens (format {})", config.what, dataset->num_sources(), dataset->num_tokens(), format);
  return dataset;
}

// ---------------------------------------------------------------------------------------------
// build_default_corpus

namespace {

class UniqueFd {
 public:
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now so that the caller sees the error close may report.
  int close() { return ::close(std::exchange(fd_, -1)); }

 private:
  int fd_;
};

Status write_all(int fd, const uint8_t* p, int64_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, static_cast<size_t>(n));
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::IOError(path + ": write failed: " + std::strerror(errno));
    }
    p += w;
    n -= w;
  }
  return Status::OK();
}

}  // namespace

Result<std::string> build_default_corpus(const std::string& out_path, const std::string& source_dir) {
  std::error_code ec;
  if (!fs::is_directory(source_dir, ec)) {
    return Status::NotFound(source_dir + ": folder not found; the default corpus is built from its license "
                                         "texts (Debian package base-files); give data paths instead");
  }
  std::vector<fs::path> entries = list_directory(source_dir, &ec);
  if (ec) return Status::IOError(source_dir + ": cannot list: " + ec.message());
  std::sort(entries.begin(), entries.end());

  // Several names may point at one text (GPL -> GPL-3); each target is written once.
  std::set<std::string> seen;
  std::vector<MappedFile> texts;
  for (const auto& e : entries) {
    fs::path target = fs::canonical(e, ec);
    if (ec || !fs::is_regular_file(target, ec) || !seen.insert(target.string()).second) continue;
    ASSIGN_OR_RETURN(MappedFile f, MappedFile::open(target.string()));
    if (f.size() > 0) texts.push_back(std::move(f));
  }
  if (texts.empty()) return Status::NotFound(source_dir + ": holds no non-empty files to build a corpus from");

  fs::path parent = fs::path(out_path).parent_path();
  if (!parent.empty()) {
    fs::create_directories(parent, ec);
    if (ec) return Status::IOError(parent.string() + ": cannot create directory: " + ec.message());
  }
  const std::string tmp = out_path + ".tmp";
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return Status::IOError(tmp + ": cannot create: " + std::strerror(errno));
  int64_t total = 0;
  for (const auto& t : texts) {
    RETURN_IF_ERROR(write_all(fd.get(), t.data(), t.size(), tmp));
    total += t.size();
    // Keeps one text from running into the next mid-line.
    if (t.data()[t.size() - 1] != '\n') {
      const uint8_t nl = '\n';
      RETURN_IF_ERROR(write_all(fd.get(), &nl, 1, tmp));
      ++total;
    }
  }
  if (::fsync(fd.get()) != 0) return Status::IOError(tmp + ": fsync failed: " + std::strerror(errno));
  if (fd.close() != 0) return Status::IOError(tmp + ": close failed: " + std::strerror(errno));
  if (::rename(tmp.c_str(), out_path.c_str()) != 0) {
    return Status::IOError(tmp + ": rename to " + out_path + " failed: " + std::strerror(errno));
  }
  // Makes the rename itself durable; a failure here only risks losing a rebuildable file.
  UniqueFd dir(::open(parent.empty() ? "." : parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.get() >= 0) ::fsync(dir.get());
  LOG_INFO("data: wrote default corpus {} ({} files, {} bytes)", out_path, texts.size(), total);
  return out_path;
}

}  // namespace strata
