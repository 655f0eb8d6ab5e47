#include "model/safetensors_min.h"

#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

namespace strata::model {
namespace {

using nlohmann::json;

// A header larger than this is not a safetensors file (the format caps it at 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

int64_t dtype_size(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2") return 1;
  return 0;
}

float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1F) {  // inf / nan
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {  // normal
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {  // zero
    bits = sign;
  } else {  // subnormal: renormalise
    int shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    bits = sign | (static_cast<uint32_t>(113 - shift) << 23) | ((mantissa & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace

Result<SafetensorsReader> SafetensorsReader::open(const std::string& path) {
  std::error_code ec;
  const auto file_size = static_cast<int64_t>(std::filesystem::file_size(path, ec));
  if (ec) return Status::NotFound(fmt::format("{}: cannot open safetensors file: {}", path, ec.message()));
  SafetensorsReader r;
  r.path_ = path;
  r.file_.open(path, std::ios::binary);
  if (!r.file_) return Status::IOError(fmt::format("{}: cannot open safetensors file", path));

  unsigned char length_bytes[8];
  if (file_size < 8 || !r.file_.read(reinterpret_cast<char*>(length_bytes), 8)) {
    return Status::Corruption(fmt::format("{}: truncated safetensors file (no header length)", path));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | length_bytes[i];
  if (header_len > kMaxHeaderBytes || static_cast<int64_t>(8 + header_len) > file_size) {
    return Status::Corruption(fmt::format(
        "{}: header length {} does not fit in the file ({} bytes): truncated or not safetensors",
        path, header_len, file_size));
  }
  std::string header(header_len, '\0');
  if (!r.file_.read(header.data(), static_cast<std::streamsize>(header_len))) {
    return Status::IOError(fmt::format("{}: reading the header failed", path));
  }
  json parsed = json::parse(header, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded() || !parsed.is_object()) {
    return Status::Corruption(fmt::format("{}: the safetensors header is not a JSON object", path));
  }
  r.data_start_ = static_cast<int64_t>(8 + header_len);
  const int64_t data_size = file_size - r.data_start_;

  for (const auto& [name, info] : parsed.items()) {
    if (name == "__metadata__") continue;
    auto bad = [&](const std::string& what) {
      return Status::Corruption(fmt::format("{}: tensor '{}': {}", path, name, what));
    };
    if (!info.is_object() || !info.contains("dtype") || !info["dtype"].is_string() ||
        !info.contains("shape") || !info["shape"].is_array() || !info.contains("data_offsets") ||
        !info["data_offsets"].is_array() || info["data_offsets"].size() != 2) {
      return bad("header entry needs dtype, shape and data_offsets [begin, end]");
    }
    SafetensorsEntry e;
    e.dtype = info["dtype"].get<std::string>();
    int64_t numel = 1;
    for (const auto& d : info["shape"]) {
      if (!d.is_number_unsigned()) return bad("shape must hold non-negative integers");
      e.shape.push_back(d.get<int64_t>());
      numel *= e.shape.back();
    }
    const auto& offsets = info["data_offsets"];
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
      return bad("data_offsets must be non-negative integers");
    }
    e.begin = offsets[0].get<int64_t>();
    e.end = offsets[1].get<int64_t>();
    if (e.end < e.begin) return bad("data_offsets end before they begin");
    if (e.end > data_size) {
      return bad(fmt::format("data ends at byte {} but the file holds {} data bytes: truncated file",
                             e.end, data_size));
    }
    const int64_t element = dtype_size(e.dtype);
    if (element != 0 && e.end - e.begin != numel * element) {
      return bad(fmt::format("{} bytes do not hold shape [{}] of {}", e.end - e.begin,
                             fmt::join(e.shape, ", "), e.dtype));
    }
    r.entries_.emplace(name, std::move(e));
  }
  return r;
}

Status SafetensorsReader::read_f32(const std::string& name, const std::vector<int64_t>& expected_shape,
                                   float* out) {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return Status::NotFound(fmt::format("{}: tensor '{}' is missing", path_, name));
  }
  const SafetensorsEntry& e = it->second;
  if (e.shape != expected_shape) {
    return Status::InvalidArgument(fmt::format("{}: tensor '{}' has shape [{}], expected [{}]", path_,
                                               name, fmt::join(e.shape, ", "),
                                               fmt::join(expected_shape, ", ")));
  }
  int64_t numel = 1;
  for (int64_t d : e.shape) numel *= d;
  const bool is_f32 = e.dtype == "F32";
  const bool is_16 = e.dtype == "BF16" || e.dtype == "F16";
  if (!is_f32 && !is_16) {
    return Status::Unimplemented(fmt::format(
        "{}: tensor '{}' has dtype {}; this reader takes F32, BF16 and F16", path_, name, e.dtype));
  }
  file_.clear();
  file_.seekg(data_start_ + e.begin);
  if (is_f32) {
    if (!file_.read(reinterpret_cast<char*>(out), numel * 4)) {
      return Status::IOError(fmt::format("{}: reading tensor '{}' failed", path_, name));
    }
    return Status::OK();
  }
  std::vector<uint16_t> half(static_cast<size_t>(numel));
  if (!file_.read(reinterpret_cast<char*>(half.data()), numel * 2)) {
    return Status::IOError(fmt::format("{}: reading tensor '{}' failed", path_, name));
  }
  const bool bf16 = e.dtype == "BF16";
  for (int64_t i = 0; i < numel; ++i) out[i] = bf16 ? bf16_to_f32(half[i]) : f16_to_f32(half[i]);
  return Status::OK();
}

Status write_safetensors_f32(const std::string& path, const std::vector<SafetensorsTensor>& tensors) {
  // nlohmann::ordered_json keeps the tensors in the order given, so data offsets increase.
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  int64_t offset = 0;
  for (const auto& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + numel * 4}}};
    offset += numel * 4;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Status::IOError(fmt::format("{}: cannot create file", path));
  unsigned char length_bytes[8];
  uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<unsigned char>(len >> (8 * i));
  out.write(reinterpret_cast<const char*>(length_bytes), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    out.write(reinterpret_cast<const char*>(t.data), numel * 4);
  }
  out.flush();
  if (!out) return Status::IOError(fmt::format("{}: write failed", path));
  return Status::OK();
}

}  // namespace strata::model
