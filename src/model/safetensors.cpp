#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/io_engine.h"

namespace strata::model {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Every dtype the safetensors format defines (the reference library's Dtype enum, 0.8) and its
// bits per element; the sub-byte ones pack elements with no padding between them.
constexpr std::pair<std::string_view, int> kDtypes[] = {
    {"BOOL", 8},    {"F4", 4},      {"F6_E2M3", 6},     {"F6_E3M2", 6},     {"U8", 8},   {"I8", 8},
    {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8},     {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8},
    {"I16", 16},    {"U16", 16},    {"F16", 16},        {"BF16", 16},       {"I32", 32}, {"U32", 32},
    {"F32", 32},    {"C64", 64},    {"F64", 64},        {"I64", 64},        {"U64", 64},
};

// The safetensors format caps the header at 100 MB.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// No real tensor holds more bytes than this; larger products mean a corrupt header.
constexpr int64_t kMaxTensorBytes = int64_t{1} << 56;

float bits_to_float(uint32_t bits) { return std::bit_cast<float>(bits); }

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// pread until `length` bytes arrived; errors name the file.
Status pread_all(int fd, const std::string& path, void* out, int64_t length, int64_t offset) {
  auto* p = static_cast<char*>(out);
  int64_t done = 0;
  while (done < length) {
    const ssize_t n = ::pread(fd, p + done, static_cast<size_t>(length - done), offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error(IoOp::kRead, static_cast<uint64_t>(length), static_cast<uint64_t>(offset), path, errno,
                      static_cast<uint64_t>(done));
    }
    if (n == 0) return io_eof_error(static_cast<uint64_t>(length), static_cast<uint64_t>(offset), path,
                                    static_cast<uint64_t>(done));
    done += n;
  }
  return Status::OK();
}


// Reads and validates one file's header; *out receives its tensors in header order.
Status parse_header(int fd, const std::string& path, int64_t file_size, std::vector<SafetensorsTensorInfo>* out,
                    std::map<std::string, std::string>* metadata) {
  if (file_size < 8) {
    return Status::Corruption(fmt::format(
        "{}: {} bytes is too short for a safetensors file (it starts with an 8-byte header length)", path,
        file_size));
  }
  unsigned char length_bytes[8];
  RETURN_IF_ERROR(pread_all(fd, path, length_bytes, 8, 0));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | length_bytes[i];
  if (header_len > kMaxHeaderBytes) {
    return Status::Corruption(fmt::format(
        "{}: header length {} exceeds the format's 100 MB limit: not a safetensors file, or corrupted", path,
        header_len));
  }
  if (static_cast<int64_t>(8 + header_len) > file_size) {
    return Status::Corruption(fmt::format(
        "{}: header length {} does not fit in the file ({} bytes): truncated or not safetensors", path, header_len,
        file_size));
  }
  std::string header(header_len, '\0');
  RETURN_IF_ERROR(pread_all(fd, path, header.data(), static_cast<int64_t>(header_len), 8));
  // nlohmann stops at a NUL as at the end of the text; the reference library (serde_json)
  // allows only JSON whitespace after the object, so NUL padding is refused as there.
  if (const size_t nul = header.find('\0'); nul != std::string::npos) {
    return Status::Corruption(fmt::format(
        "{}: the safetensors header holds a NUL byte at header offset {}; the format pads the header with "
        "spaces only: the file is corrupt or written by a non-conforming tool (rewrite it with the safetensors "
        "library)",
        path, nul));
  }
  json parsed = json::parse(header, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded() || !parsed.is_object()) {
    return Status::Corruption(fmt::format("{}: the safetensors header is not a JSON object", path));
  }
  const int64_t data_start = static_cast<int64_t>(8 + header_len);
  const int64_t data_size = file_size - data_start;

  std::vector<SafetensorsTensorInfo> tensors;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // parallel to tensors, data-relative
  for (const auto& item : parsed.items()) {
    // Not a structured binding: the lambda below captures the name (clang 14 cannot).
    const std::string& name = item.key();
    const json& info = item.value();
    if (name == "__metadata__") {
      if (!info.is_object()) return Status::Corruption(fmt::format("{}: __metadata__ is not an object", path));
      for (const auto& [key, value] : info.items()) {
        if (!value.is_string()) {
          return Status::Corruption(fmt::format("{}: __metadata__ value of '{}' is not a string", path, key));
        }
        (*metadata)[key] = value.get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) {
      return Status::Corruption(fmt::format("{}: tensor '{}': {}", path, name, what));
    };
    if (!info.is_object()) return bad("header entry is not an object");
    const auto dtype = info.find("dtype");
    const auto shape = info.find("shape");
    const auto offsets = info.find("data_offsets");
    if (dtype == info.end() || !dtype->is_string() || shape == info.end() || !shape->is_array() ||
        offsets == info.end() || !offsets->is_array() || offsets->size() != 2) {
      return bad("header entry needs dtype, shape and data_offsets [begin, end]");
    }
    SafetensorsTensorInfo t;
    t.name = name;
    t.dtype = dtype->get<std::string>();
    t.numel = 1;
    for (const auto& d : *shape) {
      if (!d.is_number_unsigned()) return bad("shape must hold non-negative integers");
      const int64_t dim = d.get<int64_t>();
      if (dim < 0 || (dim > 0 && t.numel > kMaxTensorBytes / dim)) return bad("shape is impossibly large");
      t.shape.push_back(dim);
      t.numel *= dim;
    }
    if (!(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
      return bad("data_offsets must be non-negative integers");
    }
    const uint64_t begin = (*offsets)[0].get<uint64_t>();
    const uint64_t end = (*offsets)[1].get<uint64_t>();
    if (end < begin) return bad(fmt::format("data_offsets [{}, {}] end before they begin", begin, end));
    if (end > static_cast<uint64_t>(data_size)) {
      return bad(fmt::format(
          "data_offsets [{}, {}] reach past the {} data bytes the file holds: truncated file, or a header "
          "that lies about sizes",
          begin, end, data_size));
    }
    const int bits = safetensors_dtype_bits(t.dtype);
    if (bits == 0) {
      std::string known;  // (a plain loop: clang 14 cannot use libstdc++ 12's views)
      for (const auto& d : kDtypes) known += (known.empty() ? "" : ", ") + std::string(d.first);
      return bad(fmt::format("dtype '{}' is not a safetensors dtype (the format defines {}): the file is corrupt "
                             "or not safetensors",
                             t.dtype, known));
    }
    t.nbytes = static_cast<int64_t>(end - begin);
    if (t.numel * bits % 8 != 0) {  // numel < 2^56: no overflow
      return bad(fmt::format("shape {} of {} is {} bits, not a whole number of bytes", shape_text(t.shape), t.dtype,
                             t.numel * bits));
    }
    if (t.nbytes != t.numel * bits / 8) {
      return bad(fmt::format("data_offsets [{}, {}] hold {} bytes but shape {} of {} needs {}: the header lies "
                             "about sizes",
                             begin, end, t.nbytes, shape_text(t.shape), t.dtype, t.numel * bits / 8));
    }
    t.file = path;
    t.offset = data_start + static_cast<int64_t>(begin);
    ranges.emplace_back(static_cast<int64_t>(begin), static_cast<int64_t>(end));
    tensors.push_back(std::move(t));
  }

  // The tensors must tile the data section: no holes, no overlaps, nothing after the last.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ranges[a] < ranges[b]; });
  int64_t expected = 0;
  std::string previous;
  for (size_t i : order) {
    const auto [begin, end] = ranges[i];
    if (begin < expected) {
      return Status::Corruption(fmt::format("{}: tensor '{}': data_offsets [{}, {}] overlap tensor '{}' (which ends "
                                            "at byte {})",
                                            path, tensors[i].name, begin, end, previous, expected));
    }
    if (begin > expected) {
      return Status::Corruption(fmt::format(
          "{}: tensor '{}': data_offsets [{}, {}] leave a hole: data bytes [{}, {}) belong to no tensor", path,
          tensors[i].name, begin, end, expected, begin));
    }
    expected = end;
    previous = tensors[i].name;
  }
  if (expected != data_size) {
    return Status::Corruption(fmt::format(
        "{}: the file holds {} data bytes but its tensors end at byte {}{}: the file size does not match "
        "the header",
        path, data_size, expected, previous.empty() ? "" : fmt::format(" (last tensor '{}')", previous)));
  }
  *out = std::move(tensors);
  return Status::OK();
}

void convert_to_f32(std::string_view dtype, const uint8_t* in, int64_t n, float* out) {
  if (dtype == "BF16" || dtype == "F16") {
    const bool bf16 = dtype == "BF16";
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = static_cast<uint16_t>(in[2 * i] | (in[2 * i + 1] << 8));
      out[i] = bf16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
  } else if (dtype == "F8_E4M3") {
    for (int64_t i = 0; i < n; ++i) out[i] = fp8_e4m3_to_f32(in[i]);
  } else {
    CHECK(dtype == "F8_E5M2");
    for (int64_t i = 0; i < n; ++i) out[i] = fp8_e5m2_to_f32(in[i]);
  }
}

}  // namespace

// ---- dtypes ---------------------------------------------------------------------------------

int safetensors_dtype_bits(std::string_view dtype) {
  for (const auto& [name, bits] : kDtypes) {
    if (dtype == name) return bits;
  }
  return 0;
}

int64_t safetensors_dtype_size(std::string_view dtype) {
  const int bits = safetensors_dtype_bits(dtype);
  return bits % 8 == 0 ? bits / 8 : 0;
}

const char* safetensors_dtype_name(SafetensorsWriteDtype dtype) {
  switch (dtype) {
    case SafetensorsWriteDtype::kF32: return "F32";
    case SafetensorsWriteDtype::kBF16: return "BF16";
    case SafetensorsWriteDtype::kF16: return "F16";
  }
  CHECK_MSG(false, "unknown SafetensorsWriteDtype");
  return "";
}

bool safetensors_dtype_readable(std::string_view dtype) {
  return dtype == "F32" || dtype == "F16" || dtype == "BF16" || dtype == "F8_E4M3" || dtype == "F8_E5M2";
}

float bf16_to_f32(uint16_t bits) { return bits_to_float(static_cast<uint32_t>(bits) << 16); }

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));  // inf / NaN
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Zero and subnormals: mantissa * 2^-24, exact in fp32.
  const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
  return sign ? -magnitude : magnitude;
}

float fp8_e4m3_to_f32(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exponent = (b >> 3) & 0xFu;
  const uint32_t mantissa = b & 0x7u;
  if (exponent == 0xF && mantissa == 0x7) return bits_to_float(sign | 0x7FC00000u);  // the only NaN
  if (exponent != 0) return bits_to_float(sign | ((exponent + 120) << 23) | (mantissa << 20));
  const float magnitude = static_cast<float>(mantissa) * 0x1p-9f;  // subnormal: m/8 * 2^-6
  return sign ? -magnitude : magnitude;
}

float fp8_e5m2_to_f32(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exponent = (b >> 2) & 0x1Fu;
  const uint32_t mantissa = b & 0x3u;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000u | (mantissa << 21));  // inf / NaN
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 21));
  const float magnitude = static_cast<float>(mantissa) * 0x1p-16f;  // subnormal: m/4 * 2^-14
  return sign ? -magnitude : magnitude;
}

uint16_t f32_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

uint16_t f32_to_f16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));  // NaN
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 (a tie goes to even: inf)
  if (abs >= 0x38800000u) {                                              // normal: >= 2^-14
    const uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));  // rebias 127 -> 15
  }
  if (abs <= 0x33000000u) return sign;  // at most 2^-25, half the smallest subnormal: even is 0
  // Subnormal: the value in units of 2^-24, rounded to nearest even (1024 is the smallest normal).
  const uint32_t mantissa = (abs & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - (abs >> 23);  // 14..24
  const uint32_t half = 1u << (shift - 1), rest = mantissa & ((1u << shift) - 1u);
  uint32_t units = mantissa >> shift;
  if (rest > half || (rest == half && (units & 1u))) ++units;
  return static_cast<uint16_t>(sign | units);
}

// ---- reader ---------------------------------------------------------------------------------

struct SafetensorsReader::File {
  std::string path;
  int fd = -1;
  int io_file = -1;  // index in options_.io when set
  int64_t size = 0;

  File() = default;
  File(File&& o) noexcept : path(std::move(o.path)), fd(o.fd), io_file(o.io_file), size(o.size) { o.fd = -1; }
  File& operator=(File&& o) noexcept {
    std::swap(path, o.path);
    std::swap(fd, o.fd);
    std::swap(io_file, o.io_file);
    std::swap(size, o.size);
    return *this;
  }
  ~File() {
    if (fd >= 0) ::close(fd);
  }
};

SafetensorsReader::SafetensorsReader(SafetensorsReader&&) noexcept = default;
SafetensorsReader& SafetensorsReader::operator=(SafetensorsReader&&) noexcept = default;
SafetensorsReader::~SafetensorsReader() = default;

Status SafetensorsReader::open_file(const std::string& path, const std::string& missing_message, File* file) {
  file->path = path;
  file->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file->fd < 0) {
    if (errno == ENOENT) return Status::NotFound(missing_message);
    return Status::IOError(fmt::format("cannot open {}: {}", path, std::strerror(errno)));
  }
  struct stat st;
  if (::fstat(file->fd, &st) != 0) return Status::IOError(fmt::format("cannot stat {}: {}", path, std::strerror(errno)));
  if (S_ISDIR(st.st_mode)) return Status::InvalidArgument(fmt::format("{} is a directory, not a safetensors file", path));
  file->size = static_cast<int64_t>(st.st_size);
  if (options_.io != nullptr) {
    ASSIGN_OR_RETURN(file->io_file, options_.io->register_file(file->fd, path));
  }
  return Status::OK();
}

Result<SafetensorsReader> SafetensorsReader::open(const std::string& path, const ReaderOptions& options) {
  SafetensorsReader r;
  r.path_ = path;
  r.options_ = options;
  CHECK(options.piece_bytes >= 8);

  std::string index_path;
  std::string single_path = path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path dir(path);
    if (fs::exists(dir / kSafetensorsIndexName, ec)) {
      index_path = (dir / kSafetensorsIndexName).string();
    } else if (fs::exists(dir / kSafetensorsSingleName, ec)) {
      single_path = (dir / kSafetensorsSingleName).string();
    } else {
      return Status::NotFound(fmt::format("{}: holds neither {} nor {}; not a safetensors checkpoint", path,
                                          kSafetensorsSingleName, kSafetensorsIndexName));
    }
  } else if (path.ends_with(".index.json")) {
    index_path = path;
  }

  if (index_path.empty()) {
    File f;
    RETURN_IF_ERROR(r.open_file(single_path, fmt::format("{}: no such safetensors file", single_path), &f));
    RETURN_IF_ERROR(parse_header(f.fd, f.path, f.size, &r.tensors_, &r.metadata_));
    r.files_.push_back(std::move(f));
    r.tensor_file_.assign(r.tensors_.size(), 0);
  } else {
    // Sharded: the index names the file of every tensor.
    std::ifstream in(index_path);
    if (!in) return Status::NotFound(fmt::format("{}: cannot open the safetensors index", index_path));
    json index = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object()) {
      return Status::Corruption(fmt::format("{}: not a JSON object", index_path));
    }
    const auto map = index.find("weight_map");
    if (map == index.end() || !map->is_object()) {
      return Status::Corruption(fmt::format("{}: no \"weight_map\" object", index_path));
    }
    const fs::path dir = fs::path(index_path).parent_path();
    const std::string index_name = fs::path(index_path).filename().string();
    std::map<std::string, std::string> file_of;  // tensor -> shard file name
    std::map<std::string, std::string> first_tensor_of;  // shard file name -> a tensor it holds
    for (const auto& [name, file] : map->items()) {
      if (!file.is_string() || file.get<std::string>().empty() ||
          file.get<std::string>().find('/') != std::string::npos) {
        return Status::Corruption(
            fmt::format("{}: weight_map entry for tensor '{}' is not a file name in the same directory",
                        index_path, name));
      }
      file_of[name] = file.get<std::string>();
      first_tensor_of.emplace(file.get<std::string>(), name);
    }
    std::map<std::string, int> file_index;
    for (const auto& [shard, tensor] : first_tensor_of) {
      const std::string shard_path = (dir / shard).string();
      File f;
      RETURN_IF_ERROR(r.open_file(
          shard_path, fmt::format("{} listed in {} for tensor '{}' is missing", shard_path, index_name, tensor), &f));
      std::vector<SafetensorsTensorInfo> infos;
      std::map<std::string, std::string> meta;
      RETURN_IF_ERROR(parse_header(f.fd, f.path, f.size, &infos, &meta));
      if (r.files_.empty()) r.metadata_ = meta;
      const int fi = static_cast<int>(r.files_.size());
      file_index[shard] = fi;
      r.files_.push_back(std::move(f));
      for (auto& info : infos) {
        auto it = file_of.find(info.name);
        if (it == file_of.end() || it->second != shard) continue;  // the index decides
        r.tensors_.push_back(std::move(info));
        r.tensor_file_.push_back(fi);
      }
    }
    if (r.tensors_.size() != file_of.size()) {
      std::set<std::string> found;
      for (const auto& t : r.tensors_) found.insert(t.name);
      for (const auto& [name, shard] : file_of) {
        if (!found.count(name)) {
          return Status::Corruption(fmt::format("{}: tensor '{}' is listed in {} for this file but its header "
                                                "does not hold it",
                                                (dir / shard).string(), name, index_name));
        }
      }
    }
  }

  // Sort by name, keeping tensor_file_ parallel.
  std::vector<size_t> order(r.tensors_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return r.tensors_[a].name < r.tensors_[b].name; });
  std::vector<SafetensorsTensorInfo> sorted;
  std::vector<int> sorted_file;
  for (size_t i : order) {
    sorted.push_back(std::move(r.tensors_[i]));
    sorted_file.push_back(r.tensor_file_[i]);
  }
  r.tensors_ = std::move(sorted);
  r.tensor_file_ = std::move(sorted_file);
  return r;
}

const SafetensorsTensorInfo* SafetensorsReader::find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const SafetensorsTensorInfo& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

std::vector<std::string> SafetensorsReader::files() const {
  std::vector<std::string> out;
  for (const auto& f : files_) out.push_back(f.path);
  return out;
}

Status SafetensorsReader::read_bytes(const SafetensorsTensorInfo& t, int64_t begin, int64_t length, void* out) const {
  const File& f = files_[static_cast<size_t>(tensor_file_[static_cast<size_t>(&t - tensors_.data())])];
  auto* dst = static_cast<char*>(out);
  for (int64_t done = 0; done < length;) {
    const int64_t n = std::min(options_.piece_bytes, length - done);
    const int64_t offset = t.offset + begin + done;
    Status st = options_.io != nullptr
                    ? options_.io->read(f.io_file, dst + done, static_cast<uint64_t>(n), static_cast<uint64_t>(offset))
                    : pread_all(f.fd, f.path, dst + done, n, offset);
    if (!st.ok()) return st.with_context(fmt::format("reading tensor '{}'", t.name));
    done += n;
  }
  return Status::OK();
}

Status SafetensorsReader::read_raw(std::string_view name, void* out) const {
  const SafetensorsTensorInfo* t = find(name);
  if (t == nullptr) return Status::NotFound(fmt::format("{}: tensor '{}' is missing", path_, name));
  return read_bytes(*t, 0, t->nbytes, out);
}

Status SafetensorsReader::read_f32(std::string_view name, const std::vector<int64_t>& expected_shape,
                                   float* out) const {
  const SafetensorsTensorInfo* t = find(name);
  if (t == nullptr) return Status::NotFound(fmt::format("{}: tensor '{}' is missing", path_, name));
  if (t->shape != expected_shape) {
    return Status::InvalidArgument(fmt::format("{}: tensor '{}' has shape {}, expected {}", t->file, name,
                                               shape_text(t->shape), shape_text(expected_shape)));
  }
  return read_f32(name, out);
}

Status SafetensorsReader::read_f32(std::string_view name, float* out) const {
  const SafetensorsTensorInfo* t = find(name);
  if (t == nullptr) return Status::NotFound(fmt::format("{}: tensor '{}' is missing", path_, name));
  if (!safetensors_dtype_readable(t->dtype)) {
    return Status::Unimplemented(fmt::format(
        "{}: tensor '{}' has dtype {}; strata reads F32, BF16, F16, F8_E4M3 and F8_E5M2", t->file, name, t->dtype));
  }
  if (t->dtype == "F32") return read_bytes(*t, 0, t->nbytes, out);
  const int64_t element = safetensors_dtype_size(t->dtype);
  const int64_t piece = std::max<int64_t>(element, options_.piece_bytes / element * element);
  std::vector<uint8_t> staging(static_cast<size_t>(std::min(piece, t->nbytes)));
  for (int64_t done = 0; done < t->nbytes;) {
    const int64_t n = std::min(piece, t->nbytes - done);
    RETURN_IF_ERROR(read_bytes(*t, done, n, staging.data()));
    convert_to_f32(t->dtype, staging.data(), n / element, out + done / element);
    done += n;
  }
  return Status::OK();
}

// ---- writer ---------------------------------------------------------------------------------

namespace {

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t write_element_size(SafetensorsWriteDtype dtype) { return dtype == SafetensorsWriteDtype::kF32 ? 4 : 2; }

}  // namespace

Status write_safetensors_file(const std::string& path, const std::vector<SafetensorsWriteTensor>& tensors,
                              const WriterOptions& options) {
  CHECK(options.piece_bytes >= 8);
  nlohmann::ordered_json header;
  if (!options.metadata.empty()) header["__metadata__"] = options.metadata;
  std::set<std::string> names;
  int64_t offset = 0;
  for (const auto& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second) {
      return Status::InvalidArgument(fmt::format("{}: tensor name '{}' is empty, reserved or repeated", path, t.name));
    }
    for (int64_t d : t.shape) {
      if (d < 0) return Status::InvalidArgument(fmt::format("{}: tensor '{}' has a negative dimension", path, t.name));
    }
    const SafetensorsWriteDtype dtype = t.dtype.value_or(options.dtype);
    const int64_t bytes = numel_of(t.shape) * write_element_size(dtype);
    CHECK_MSG(bytes == 0 || t.data != nullptr || t.read, fmt::format("tensor '{}' has no data", t.name));
    header[t.name] = {{"dtype", safetensors_dtype_name(dtype)}, {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char length_bytes[8];
  for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8 * i));

  AtomicFile out(path);
  RETURN_IF_ERROR(out.open());
  RETURN_IF_ERROR(out.write(length_bytes, 8));
  RETURN_IF_ERROR(out.write(text.data(), static_cast<int64_t>(text.size())));
  std::vector<uint16_t> staging;
  std::vector<float> fetched;  // a tensor given by its reader
  for (const auto& t : tensors) {
    const SafetensorsWriteDtype dtype = t.dtype.value_or(options.dtype);
    const int64_t element = write_element_size(dtype);
    const int64_t piece_elems = options.piece_bytes / element;
    const int64_t n = numel_of(t.shape);
    const float* data = t.data;
    if (data == nullptr && n > 0) {
      fetched.resize(static_cast<size_t>(n));
      RETURN_IF_ERROR(t.read(fetched.data()).with_context(fmt::format("{}: tensor '{}'", path, t.name)));
      data = fetched.data();
    }
    for (int64_t done = 0; done < n;) {
      const int64_t count = std::min(piece_elems, n - done);
      if (dtype == SafetensorsWriteDtype::kF32) {
        RETURN_IF_ERROR(out.write(data + done, count * 4));
      } else {
        staging.resize(static_cast<size_t>(count));
        uint16_t (*const round)(float) = dtype == SafetensorsWriteDtype::kBF16 ? f32_to_bf16 : f32_to_f16;
        for (int64_t i = 0; i < count; ++i) staging[static_cast<size_t>(i)] = round(data[done + i]);
        RETURN_IF_ERROR(out.write(staging.data(), count * 2));
      }
      if (options.on_written) options.on_written(static_cast<uint64_t>(count * element));
      done += count;
    }
  }
  return out.commit();
}

Status write_safetensors_dir(const std::string& dir, const std::vector<SafetensorsWriteTensor>& tensors,
                             const WriterOptions& options) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IOError(fmt::format("cannot create directory {}: {}", dir, ec.message()));

  // Greedy shards in order, as transformers' shard_checkpoint does.
  std::vector<std::vector<SafetensorsWriteTensor>> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (const auto& t : tensors) {
    const uint64_t bytes = static_cast<uint64_t>(numel_of(t.shape) * write_element_size(t.dtype.value_or(options.dtype)));
    if (!shards.back().empty() && shard_bytes + bytes > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(t);
    shard_bytes += bytes;
    total_bytes += bytes;
  }
  if (shards.size() == 1) {
    return write_safetensors_file((fs::path(dir) / kSafetensorsSingleName).string(), tensors, options);
  }
  json weight_map = json::object();
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, shards.size());
    RETURN_IF_ERROR(write_safetensors_file((fs::path(dir) / name).string(), shards[k], options));
    for (const auto& t : shards[k]) weight_map[t.name] = name;
  }
  json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  return write_file_atomic((fs::path(dir) / kSafetensorsIndexName).string(), index.dump(2) + "\n");
}

}  // namespace strata::model
