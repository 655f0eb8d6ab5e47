// CheckpointReader: path resolution, manifest and header validation, tensor reads.
#include "ckpt/reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>

namespace strata::ckpt {
namespace {

namespace fs = std::filesystem;

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t b = 0;
  while (b < s.size() && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  return s.substr(b);
}

bool is_dir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

float bf16_to_f32(uint16_t bits) {
  const uint32_t u = uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

Status pread_all(int fd, const std::string& path, void* out, uint64_t bytes, uint64_t offset) {
  char* p = static_cast<char*>(out);
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, p + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return sys_error("read at offset " + std::to_string(offset + done) + " of", path, errno);
    }
    if (n == 0) {
      return Status::Corruption(path + " ends at offset " + std::to_string(offset + done) +
                                ", before the data its header describes; the file is truncated");
    }
    done += static_cast<uint64_t>(n);
  }
  return Status::OK();
}

}  // namespace

Result<std::string> resolve_checkpoint_path(const std::string& input) {
  std::string path = input;
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  std::string latest;
  if (is_dir(path) && exists(path + "/" + kManifestFile)) return path;
  if (is_dir(path)) {
    latest = path + "/" + kLatestFile;
    if (!exists(latest)) {
      // A step directory whose manifest is missing, or a directory with no checkpoint at all.
      if (parse_step_dir_name(fs::path(path).filename().string())) {
        return Status::NotFound("checkpoint " + path + " has no " + kManifestFile + " (" + path + "/" +
                                kManifestFile + " is missing); the save did not finish or the file was deleted");
      }
      return Status::NotFound("no checkpoint in " + path + ": " + latest +
                              " does not exist (pass a step-N directory to load a specific one)");
    }
  } else if (fs::path(path).filename() == kLatestFile) {
    latest = path;
  } else {
    return Status::NotFound("checkpoint " + path + " does not exist");
  }
  ASSIGN_OR_RETURN(const std::string name, read_latest_file(latest));
  const std::string dir = fs::path(latest).parent_path().string();
  const std::string step_dir = (dir.empty() ? std::string(".") : dir) + "/" + name;
  if (!is_dir(step_dir)) return Status::NotFound(latest + " names " + step_dir + ", which does not exist");
  if (!exists(step_dir + "/" + kManifestFile)) {
    return Status::NotFound("checkpoint " + step_dir + " has no " + kManifestFile + " (" + step_dir + "/" +
                            kManifestFile + " is missing)");
  }
  return step_dir;
}

Result<std::string> read_latest_file(const std::string& latest) {
  // `latest` may be anything (a link to /etc/passwd): read little, and never echo what is not a
  // step name.
  Result<std::string> text = read_small_file(latest, 256);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) return text.status();
    return Status::Corruption(latest + " is not a small file holding a step-N name; the file is damaged (" +
                              text.status().message() + ")");
  }
  const std::string name = trim(*text);
  if (parse_step_dir_name(name)) return name;
  const std::string shown = name.rfind("step-", 0) == 0 ? "holds " + quote_untrusted(name, 24) + ", which is" : "does";
  return Status::Corruption(latest + " " + shown + " not name a step directory (step-N) of " +
                            (fs::path(latest).parent_path().empty() ? std::string(".")
                                                                    : fs::path(latest).parent_path().string()) +
                            "; the file is damaged (point it at a committed step, e.g. echo step-N > " + latest + ")");
}

Result<uint64_t> hash_file(const std::string& path, Progress* progress) {
  return hash_and_scan_file(path, nullptr, progress);
}

Result<uint64_t> hash_and_scan_file(const std::string& path, FiniteScan* scan, Progress* progress) {
  ASSIGN_OR_RETURN(UniqueFd fd, open_file(path, O_RDONLY));
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  CHECK(state != nullptr);
  XXH3_64bits_reset(state.get());
  std::vector<char> buf(8 << 20);
  uint64_t offset = 0;
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return sys_error("read of", path, errno);
    }
    if (n == 0) break;
    XXH3_64bits_update(state.get(), buf.data(), static_cast<size_t>(n));
    if (progress != nullptr) progress->add(static_cast<uint64_t>(n));
    if (scan != nullptr) scan->feed(offset, buf.data(), static_cast<uint64_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return static_cast<uint64_t>(XXH3_64bits_digest(state.get()));
}

Result<std::unique_ptr<CheckpointReader>> CheckpointReader::open(const std::string& path,
                                                                 const ReaderOpenOptions& options) {
  std::unique_ptr<CheckpointReader> r(new CheckpointReader());
  ASSIGN_OR_RETURN(r->step_dir_, resolve_checkpoint_path(path));
  const std::string manifest_path = r->step_dir_ + "/" + kManifestFile;
  ASSIGN_OR_RETURN(std::string text, read_small_file(manifest_path));
  r->manifest_json_ = nlohmann::json::parse(text, nullptr, false);
  if (r->manifest_json_.is_discarded()) {
    return Status::Corruption(manifest_path + " is not valid JSON; the checkpoint is damaged");
  }
  ASSIGN_OR_RETURN(r->manifest_, manifest_from_json(manifest_path, r->step_dir_, r->manifest_json_));
  RETURN_IF_ERROR(r->open_files(manifest_path));
  if (options.verify) RETURN_IF_ERROR(r->verify());
  std::vector<FileEntry> entries;
  RETURN_IF_ERROR(r->read_headers(&entries));
  RETURN_IF_ERROR(r->join_tensors(entries));
  return r;
}

// The files the manifest lists, each present as a regular file of the recorded size.
Status CheckpointReader::open_files(const std::string& manifest_path) {
  // One model and one optimizer file, or each rank's shard of them (a sharded save).
  for (const char* name : {kModelFile, kOptimizerFile}) {
    bool listed = false;
    for (const auto& [file, rec] : manifest_.files)
      listed |= name == std::string(kModelFile) ? is_model_file(file) : is_optimizer_file(file);
    if (!listed) {
      return Status::Corruption(manifest_path + " does not list " + name + "; the checkpoint is damaged");
    }
  }
  for (const auto& [name, rec] : manifest_.files) {
    SavedFile f{name, step_dir_ + "/" + name, rec.size, rec.xxh3};
    // Names are plain (manifest_from_json); a link could still lead out of the checkpoint.
    struct stat st;
    if (::lstat(f.path.c_str(), &st) != 0) {
      return Status::NotFound("checkpoint file " + f.path + " is missing (listed in " + manifest_path + ")");
    }
    if (!S_ISREG(st.st_mode)) {
      return Status::Corruption("checkpoint file " + f.path + " is not a regular file (a link or a directory); " +
                                "a checkpoint holds its files itself (copy the real files in)");
    }
    if (static_cast<uint64_t>(st.st_size) != rec.size) {
      return Status::Corruption("checkpoint file " + f.path + " is " + std::to_string(st.st_size) +
                                " bytes but the manifest records " + std::to_string(rec.size) +
                                (static_cast<uint64_t>(st.st_size) < rec.size ? "; the file is truncated"
                                                                               : "; the file was modified"));
    }
    files_.push_back(std::move(f));
  }
  return Status::OK();
}

// Opens the model and optimizer files and appends the entries of their headers.
Status CheckpointReader::read_headers(std::vector<FileEntry>* entries) {
  for (size_t i = 0; i < files_.size(); ++i) {
    const SavedFile& f = files_[i];
    if (!is_model_file(f.name) && !is_optimizer_file(f.name)) {
      fds_.emplace_back();
      continue;
    }
    ASSIGN_OR_RETURN(UniqueFd fd, open_file(f.path, O_RDONLY));
    std::string prefix(8, '\0');
    if (f.size < 8) return Status::Corruption(f.path + " is " + std::to_string(f.size) + " bytes; too short for a header");
    RETURN_IF_ERROR(pread_all(fd.get(), f.path, prefix.data(), 8, 0));
    uint64_t n = 0;
    for (int b = 0; b < 8; ++b) n |= uint64_t(static_cast<unsigned char>(prefix[b])) << (8 * b);
    if (n > f.size - 8 || n > 100'000'000) {
      return Status::Corruption(f.path + " declares a " + std::to_string(n) +
                                "-byte header, larger than the file; the file is damaged");
    }
    std::string header(n, '\0');
    RETURN_IF_ERROR(pread_all(fd.get(), f.path, header.data(), n, 8));
    ASSIGN_OR_RETURN(ParsedHeader parsed, parse_safetensors_header(f.path, prefix, header, f.size));
    for (HeaderEntry& e : parsed.entries) {
      const uint64_t offset = parsed.data_start + e.begin;
      entries->push_back(FileEntry{std::move(e), static_cast<int>(i), offset});
    }
    fds_.push_back(std::move(fd));
  }
  return Status::OK();
}

// One logical tensor per name: an entry stored whole, or the slices of several files joined.
Status CheckpointReader::join_tensors(const std::vector<FileEntry>& entries) {
  std::map<std::string, std::vector<const FileEntry*>> sliced;
  std::map<std::string, int> whole_file;
  for (const FileEntry& fe : entries) {
    const HeaderEntry& e = fe.entry;
    if (e.slice) {
      sliced[e.name].push_back(&fe);
      continue;
    }
    if (auto [it, added] = whole_file.emplace(e.name, fe.file); !added) {
      return Status::Corruption("checkpoint " + step_dir_ + ": tensor '" + e.name + "' appears twice, in " +
                                files_[it->second].path + " and " + files_[fe.file].path +
                                "; the checkpoint is damaged or its files are mixed up");
    }
    SavedTensor t;
    t.name = e.name;
    t.kind = is_model_file(files_[fe.file].name) ? TensorKind::kParam : kind_of_qualified(e.name, nullptr);
    t.dtype = e.dtype;
    t.shape = e.shape;
    t.nbytes = e.end - e.begin;
    t.numel = t.nbytes / dtype_size(e.dtype);
    t.file = fe.file;
    t.offset = fe.offset;
    tensors_.push_back(std::move(t));
  }
  for (const auto& [name, parts] : sliced) {
    if (auto it = whole_file.find(name); it != whole_file.end()) {
      return Status::Corruption("checkpoint " + step_dir_ + ": tensor '" + name + "' is stored whole in " +
                                files_[it->second].path + " and in slices in " + files_[parts[0]->file].path +
                                "; the checkpoint is damaged or its files are mixed up");
    }
    ASSIGN_OR_RETURN(SavedTensor t, join_slices(name, parts));
    tensors_.push_back(std::move(t));
  }
  std::sort(tensors_.begin(), tensors_.end(), [](const SavedTensor& a, const SavedTensor& b) {
    return a.file != b.file ? a.file < b.file : a.offset < b.offset;
  });
  for (size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace(tensors_[i].name, i);
  return Status::OK();
}

// The slices of tensor `name` as one tensor: one dtype, kind and shape, tiling [0, numel).
Result<SavedTensor> CheckpointReader::join_slices(const std::string& name, std::vector<const FileEntry*> parts) const {
  std::sort(parts.begin(), parts.end(),
            [](const FileEntry* a, const FileEntry* b) { return a->entry.slice->first < b->entry.slice->first; });
  const std::string tensor = "checkpoint " + step_dir_ + ": tensor '" + name + "'";
  const std::string hint = "; the checkpoint is damaged or its files are mixed up";
  auto path = [&](const FileEntry* p) { return files_[p->file].path; };
  auto kind = [&](const FileEntry* p) {
    return is_model_file(files_[p->file].name) ? TensorKind::kParam : kind_of_qualified(name, nullptr);
  };
  const HeaderEntry& head = parts[0]->entry;
  SavedTensor t;
  t.name = name;
  t.kind = kind(parts[0]);
  t.dtype = head.dtype;
  t.shape = head.slice->whole_shape;
  t.numel = *checked_numel(t.shape);  // checked by parse_safetensors_header
  t.file = parts[0]->file;
  t.offset = parts[0]->offset;
  uint64_t pos = 0;  // the elements before it are in the slices seen so far
  const FileEntry* last = nullptr;
  for (const FileEntry* p : parts) {
    const HeaderSlice& s = *p->entry.slice;
    if (p->entry.dtype != t.dtype || s.whole_shape != t.shape || kind(p) != t.kind) {
      return Status::Corruption(tensor + " has slices of different dtypes, shapes or kinds in " + path(parts[0]) +
                                " and " + path(p) + hint);
    }
    if (s.first > pos) {
      return Status::Corruption(tensor + " has no elements [" + std::to_string(pos) + ", " + std::to_string(s.first) +
                                "): no file holds them" +
                                (last != nullptr ? " (its slices in " + path(last) + " and " + path(p) + " leave a gap)"
                                                 : " (its first slice, in " + path(p) + ", starts after them)") +
                                hint);
    }
    if (s.first < pos) {
      return Status::Corruption(tensor + " has elements [" + std::to_string(s.first) + ", " +
                                std::to_string(std::min(pos, s.first + s.count)) + ") in two slices, in " + path(last) +
                                " and " + path(p) + hint);
    }
    t.slices.push_back(SavedSlice{s.first, s.count, p->file, p->offset});
    pos = s.first + s.count;
    last = p;
  }
  if (pos != t.numel) {
    return Status::Corruption(tensor + " has no elements [" + std::to_string(pos) + ", " + std::to_string(t.numel) +
                              "): no file holds them (its last slice is in " + path(last) + ")" + hint);
  }
  if (__builtin_mul_overflow(t.numel, dtype_size(t.dtype), &t.nbytes)) {
    return Status::Corruption(tensor + " has more bytes than 2^64" + hint);
  }
  return t;
}

const SavedTensor* CheckpointReader::find(const std::string& qualified) const {
  auto it = by_name_.find(qualified);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

Status CheckpointReader::read_at(int file, void* out, uint64_t bytes, uint64_t offset) const {
  return pread_all(fds_[file].get(), files_[file].path, out, bytes, offset);
}

Status CheckpointReader::read_elements(const SavedTensor& t, uint64_t first, uint64_t count, void* out) const {
  const uint64_t esize = dtype_size(t.dtype);
  char* dst = static_cast<char*>(out);
  if (t.slices.empty()) return read_at(t.file, dst, count * esize, t.offset + first * esize);
  // The first slice ending after `first`, then on through the slices the range spans.
  auto it = std::upper_bound(t.slices.begin(), t.slices.end(), first,
                             [](uint64_t e, const SavedSlice& s) { return e < s.first + s.count; });
  for (const uint64_t end = first + count; first < end; ++it) {
    const uint64_t n = std::min(end, it->first + it->count) - first;
    RETURN_IF_ERROR(read_at(it->file, dst, n * esize, it->offset + (first - it->first) * esize));
    dst += n * esize;
    first += n;
  }
  return Status::OK();
}

Status CheckpointReader::read_f32_elements(const SavedTensor& t, uint64_t first, uint64_t count, float* out) const {
  if (t.dtype == DType::kF32) return read_elements(t, first, count, out);
  // BF16: through a bounded staging buffer.
  constexpr uint64_t kPiece = uint64_t{1} << 20;  // elements
  std::vector<uint16_t> staging(std::min(count, kPiece));
  for (uint64_t i = 0; i < count; i += kPiece) {
    const uint64_t m = std::min(kPiece, count - i);
    RETURN_IF_ERROR(read_elements(t, first + i, m, staging.data()));
    for (uint64_t k = 0; k < m; ++k) out[i + k] = bf16_to_f32(staging[k]);
  }
  return Status::OK();
}

Status CheckpointReader::read_raw(const std::string& qualified, void* out, uint64_t bytes) const {
  const SavedTensor* t = find(qualified);
  if (t == nullptr) return Status::NotFound("checkpoint " + step_dir_ + " has no tensor '" + qualified + "'");
  if (bytes != t->nbytes) {
    return Status::InvalidArgument("tensor '" + qualified + "' in " + step_dir_ + " holds " + std::to_string(t->nbytes) +
                                   " bytes, not " + std::to_string(bytes));
  }
  return read_elements(*t, 0, t->numel, out);
}

Status CheckpointReader::check_f32(const std::string& qualified, uint64_t count) const {
  const SavedTensor* t = find(qualified);
  if (t == nullptr) return Status::NotFound("checkpoint " + step_dir_ + " has no tensor '" + qualified + "'");
  if (count != t->numel) {
    return Status::InvalidArgument("tensor '" + qualified + "' in " + step_dir_ + " has " + std::to_string(t->numel) +
                                   " elements, not " + std::to_string(count));
  }
  return Status::OK();
}

Status CheckpointReader::read_f32(const std::string& qualified, float* out, uint64_t count) const {
  RETURN_IF_ERROR(check_f32(qualified, count));
  return read_f32_elements(*find(qualified), 0, count, out);
}

Status CheckpointReader::read_f32_range(const std::string& qualified, uint64_t first, uint64_t count,
                                        float* out) const {
  const SavedTensor* t = find(qualified);
  if (t == nullptr) return Status::NotFound("checkpoint " + step_dir_ + " has no tensor '" + qualified + "'");
  if (count > t->numel || first > t->numel - count) {
    return Status::InvalidArgument("tensor '" + qualified + "' in " + step_dir_ + " has " + std::to_string(t->numel) +
                                   " elements; " + std::to_string(count) + " from element " + std::to_string(first) +
                                   " are not inside it");
  }
  return read_f32_elements(*t, first, count, out);
}

Status CheckpointReader::verify(std::vector<ScannedTensor>* non_finite) const {
  uint64_t total = 0;
  for (const SavedFile& f : files_) total += f.size;
  Progress progress("verifying " + step_dir_, total);
  std::vector<ScannedTensor> found;
  std::map<std::string, size_t> reported;  // index into found
  for (size_t i = 0; i < files_.size(); ++i) {
    const SavedFile& f = files_[i];
    FiniteScan scan;
    if (non_finite != nullptr) scan = FiniteScan(tensors_in_file(static_cast<int>(i)));
    ASSIGN_OR_RETURN(uint64_t h, hash_and_scan_file(f.path, non_finite != nullptr ? &scan : nullptr, &progress));
    for (const ScannedTensor& t : scan.tensors()) {
      if (t.non_finite == 0) continue;
      // A sliced tensor is reported once, with the count of all its slices.
      if (auto [it, added] = reported.emplace(t.name, found.size()); !added) {
        found[it->second].non_finite += t.non_finite;
      } else {
        found.push_back(t);
      }
    }
    if (h != f.xxh3) {
      if (non_finite != nullptr) non_finite->insert(non_finite->end(), found.begin(), found.end());
      return Status::Corruption("checksum mismatch in checkpoint file " + f.path + ": xxh3_64 is " + xxh3_hex(h) +
                                " but the manifest records " + xxh3_hex(f.xxh3) +
                                "; the file is corrupt (restore it or load an earlier step)");
    }
  }
  if (non_finite != nullptr) non_finite->insert(non_finite->end(), found.begin(), found.end());
  return Status::OK();
}

std::vector<ScannedTensor> CheckpointReader::tensors_in_file(int file) const {
  std::vector<ScannedTensor> out;
  for (const SavedTensor& t : tensors_) {
    if (t.slices.empty()) {
      if (t.file == file) out.push_back({t.name, t.dtype, t.offset, t.offset + t.nbytes, 0});
      continue;
    }
    for (const SavedSlice& s : t.slices)
      if (s.file == file) out.push_back({t.name, t.dtype, s.offset, s.offset + s.count * dtype_size(t.dtype), 0});
  }
  std::sort(out.begin(), out.end(), [](const ScannedTensor& a, const ScannedTensor& b) { return a.begin < b.begin; });
  return out;
}

}  // namespace strata::ckpt
