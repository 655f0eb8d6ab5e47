// Names, dtypes, safetensors headers and the manifest of the checkpoint format.
#include "ckpt/format.h"

#include <fmt/format.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>

namespace strata::ckpt {
namespace {

using nlohmann::json;

constexpr const char* kKindPrefixes[kTensorKindCount] = {"", "master/", "adam_m/", "adam_v/", "state/"};
// safetensors refuses headers above 100 MB; so do we.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

bool is_hex16(const std::string& s) {
  if (s.size() != 16) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

}  // namespace

const char* tensor_kind_name(TensorKind kind) {
  switch (kind) {
    case TensorKind::kParam: return "param";
    case TensorKind::kMaster: return "master";
    case TensorKind::kAdamM: return "adam_m";
    case TensorKind::kAdamV: return "adam_v";
    case TensorKind::kState: return "state";
  }
  return "?";
}

std::string qualified_name(TensorKind kind, const std::string& name) {
  return kKindPrefixes[static_cast<int>(kind)] + name;
}

TensorKind kind_of_qualified(const std::string& qualified, std::string* name) {
  for (int k = 1; k < kTensorKindCount; ++k) {
    const size_t n = std::strlen(kKindPrefixes[k]);
    if (qualified.compare(0, n, kKindPrefixes[k]) == 0) {
      if (name != nullptr) *name = qualified.substr(n);
      return static_cast<TensorKind>(k);
    }
  }
  if (name != nullptr) *name = qualified;
  return TensorKind::kParam;
}

const char* file_of_kind(TensorKind kind) { return kind == TensorKind::kParam ? kModelFile : kOptimizerFile; }

std::string shard_file_name(const char* file, int rank, int world) {
  const std::string base(file);
  const size_t dot = base.rfind(".safetensors");
  return fmt::format("{}.rank-{:05d}-of-{:05d}.safetensors", base.substr(0, dot), rank, world);
}

namespace {
bool is_file_of(std::string_view name, std::string_view stem) {
  const std::string_view ext = ".safetensors";
  if (name.size() < stem.size() + ext.size() || name.substr(0, stem.size()) != stem ||
      name.substr(name.size() - ext.size()) != ext)
    return false;
  const std::string_view middle = name.substr(stem.size(), name.size() - stem.size() - ext.size());
  return middle.empty() || middle.substr(0, 6) == ".rank-";
}
}  // namespace

bool is_model_file(std::string_view name) { return is_file_of(name, "model"); }
bool is_optimizer_file(std::string_view name) { return is_file_of(name, "optimizer"); }

std::string step_dir_name(int64_t step) { return "step-" + std::to_string(step); }

std::optional<int64_t> parse_step_dir_name(std::string_view name) {
  if (name.size() <= 5 || name.substr(0, 5) != "step-" || name.size() > 5 + 18) return std::nullopt;
  int64_t v = 0;
  for (char c : name.substr(5)) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  return v;
}

std::string xxh3_hex(uint64_t hash) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, hash);
  return buf;
}

std::optional<uint64_t> checked_numel(const std::vector<int64_t>& shape) {
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) return std::nullopt;
  }
  return numel;
}

std::string build_safetensors_header(const std::vector<HeaderEntry>& entries,
                                     const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  h["__metadata__"] = metadata;
  json slices = json::object();
  for (const HeaderEntry& e : entries) {
    h[e.name] = {{"dtype", dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
    if (e.slice) slices[e.name] = json::array({e.slice->first, e.slice->count, e.slice->whole_shape});
  }
  // safetensors metadata values are strings: the slices go in as JSON text.
  if (!slices.empty()) h["__metadata__"][kSlicesMetadataKey] = slices.dump();
  std::string text = h.dump();
  const uint64_t data_start = round_up(8 + text.size(), kFileAlign);
  text.resize(data_start - 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

namespace {

// The slices __metadata__[kSlicesMetadataKey] records, set on the entries they name.
Status read_slices(const std::string& path, const json& header, std::vector<HeaderEntry>* entries) {
  auto meta = header.find("__metadata__");
  if (meta == header.end() || !meta->contains(kSlicesMetadataKey)) return Status::OK();
  const std::string where = path + ": __metadata__ " + kSlicesMetadataKey;
  const json& text = (*meta)[kSlicesMetadataKey];
  const json slices = text.is_string() ? json::parse(text.get<std::string>(), nullptr, false) : json();
  if (!slices.is_object()) {
    return Status::Corruption(where + " is not a JSON object in a string; the file is damaged");
  }
  std::map<std::string, HeaderEntry*> by_name;
  for (HeaderEntry& e : *entries) by_name[e.name] = &e;
  for (auto it = slices.begin(); it != slices.end(); ++it) {
    const std::string tensor = where + ": tensor '" + it.key() + "'";
    auto entry = by_name.find(it.key());
    if (entry == by_name.end()) return Status::Corruption(tensor + " is not in the file; the file is damaged");
    const json& v = *it;
    if (!v.is_array() || v.size() != 3 || !v[0].is_number_unsigned() || !v[1].is_number_unsigned() ||
        !v[2].is_array()) {
      return Status::Corruption(tensor + " is not [first, count, [shape]]; the file is damaged");
    }
    HeaderSlice slice;
    slice.first = v[0].get<uint64_t>();
    slice.count = v[1].get<uint64_t>();
    for (const json& d : v[2]) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > uint64_t(INT64_MAX)) {
        return Status::Corruption(tensor + " has a bad shape; the file is damaged");
      }
      slice.whole_shape.push_back(d.get<int64_t>());
    }
    const std::optional<uint64_t> numel = checked_numel(slice.whole_shape);
    if (!numel) return Status::Corruption(tensor + " has a bad shape; the file is damaged");
    HeaderEntry& e = *entry->second;
    if (slice.count == 0 || slice.count > *numel || slice.first > *numel - slice.count) {
      return Status::Corruption(tensor + " is a slice of " + std::to_string(slice.count) + " elements from element " +
                                std::to_string(slice.first) + ", not a non-empty range of its " +
                                std::to_string(*numel) + " elements; the file is damaged");
    }
    if (e.shape != std::vector<int64_t>{static_cast<int64_t>(slice.count)}) {
      return Status::Corruption(tensor + " is a slice of " + std::to_string(slice.count) +
                                " elements but its entry's shape is not [" + std::to_string(slice.count) +
                                "]; the file is damaged");
    }
    e.slice = std::move(slice);
  }
  return Status::OK();
}

}  // namespace

Result<ParsedHeader> parse_safetensors_header(const std::string& path, const std::string& prefix8,
                                              const std::string& json_text, uint64_t file_size) {
  ParsedHeader out;
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(static_cast<unsigned char>(prefix8[i])) << (8 * i);
  if (n != json_text.size()) return Status::Internal("header length mismatch reading " + path);
  out.data_start = 8 + n;
  const json h = json::parse(json_text, nullptr, false);
  if (h.is_discarded() || !h.is_object()) {
    return Status::Corruption(path + ": the safetensors header is not a JSON object; the file is damaged");
  }
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return Status::Corruption(path + ": __metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (m->is_string()) out.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const json& t = *it;
    const std::string where = path + ": tensor '" + it.key() + "'";
    if (!t.is_object()) return Status::Corruption(where + " is not an object");
    auto dt = t.find("dtype");
    auto sh = t.find("shape");
    auto off = t.find("data_offsets");
    if (dt == t.end() || !dt->is_string() || sh == t.end() || !sh->is_array() || off == t.end() ||
        !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned()) {
      return Status::Corruption(where + " lacks dtype, shape or data_offsets");
    }
    std::optional<DType> dtype = parse_dtype(dt->get<std::string>());
    if (!dtype || *dtype == DType::kF8E4M3) {
      return Status::Unimplemented(where + " has dtype " + dt->get<std::string>() +
                                   "; strata checkpoints hold F32 and BF16 only");
    }
    HeaderEntry e;
    e.name = it.key();
    e.dtype = *dtype;
    // Checked products: a shape whose element count wraps around must not match the bytes.
    uint64_t numel = 1;
    for (const json& d : *sh) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > uint64_t(INT64_MAX) ||
          __builtin_mul_overflow(numel, d.get<uint64_t>(), &numel)) {
        return Status::Corruption(where + " has a bad shape");
      }
      e.shape.push_back(d.get<int64_t>());
    }
    e.begin = (*off)[0].get<uint64_t>();
    e.end = (*off)[1].get<uint64_t>();
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, dtype_size(e.dtype), &nbytes) || e.end < e.begin || e.end - e.begin != nbytes) {
      return Status::Corruption(where + " has data_offsets that do not match its shape and dtype");
    }
    out.entries.push_back(std::move(e));
  }
  RETURN_IF_ERROR(read_slices(path, h, &out.entries));
  std::sort(out.entries.begin(), out.entries.end(),
            [](const HeaderEntry& a, const HeaderEntry& b) { return a.begin < b.begin; });
  uint64_t pos = 0;
  for (const HeaderEntry& e : out.entries) {
    if (e.begin != pos) {
      return Status::Corruption(path + ": tensor '" + e.name + "' does not start where the previous one ends " +
                                "(holes or overlaps); the file is damaged");
    }
    pos = e.end;
  }
  if (out.data_start + pos != file_size) {
    return Status::Corruption(path + " is " + std::to_string(file_size) + " bytes but its header describes " +
                              std::to_string(out.data_start + pos) + "; the file is truncated or damaged");
  }
  return out;
}

json manifest_to_json(const Manifest& m) {
  json files = json::object();
  for (const auto& [name, rec] : m.files) files[name] = {{"size", rec.size}, {"xxh3_64", xxh3_hex(rec.xxh3)}};
  const ManifestFields& f = m.fields;
  return json{{"format_version", m.format_version},
              {"strata_version", f.strata_version},
              {"step", m.step},
              {"tokens_seen", f.tokens_seen},
              {"data_cursor", {{"epoch", f.data_cursor.epoch}, {"index", f.data_cursor.index}}},
              {"optimizer_step", f.optimizer_step},
              {"rng", f.rng},
              {"lr_schedule", f.lr_schedule},
              {"precision", f.precision},
              {"model_config", f.model_config},
              {"layout", f.layout},
              {"extra", f.extra},
              {"files", files}};
}

Result<Manifest> manifest_from_json(const std::string& path, const std::string& step_dir, const json& j) {
  if (!j.is_object()) return Status::Corruption(path + " is not a JSON object; the checkpoint is damaged");
  Manifest m;
  // Refusals name the manifest and the field; a hand-edited or damaged manifest must not steer
  // a resume (negative or overflowing steps, a cursor silently read as 0, a CHECK in AdamW).
  auto bad = [&](const std::string& field, const std::string& why) {
    return Status::Corruption(path + ": field '" + field + "' " + why +
                              "; the checkpoint is damaged or its manifest was edited (load another step)");
  };
  auto integer = [&](const json& obj, const char* key, const std::string& field, int64_t lo, int64_t hi,
                     int64_t* out) -> Status {
    auto it = obj.find(key);
    if (it == obj.end()) return bad(field, "is missing");
    const std::string range = "from " + std::to_string(lo) + " to " + std::to_string(hi);
    if (it->is_number_unsigned()) {  // JSON text's non-negative integers parse as unsigned
      const uint64_t v = it->get<uint64_t>();
      if (v > static_cast<uint64_t>(hi) || static_cast<int64_t>(v) < lo)
        return bad(field, "is " + std::to_string(v) + ", not an integer " + range);
      *out = static_cast<int64_t>(v);
    } else if (it->is_number_integer()) {
      const int64_t v = it->get<int64_t>();
      if (v < lo || v > hi) return bad(field, "is " + std::to_string(v) + ", not an integer " + range);
      *out = v;
    } else {
      return bad(field, "is " + quote_untrusted(it->dump()) + ", not an integer " + range);
    }
    return Status::OK();
  };
  auto object = [&](const char* key, json* out) -> Status {
    auto it = j.find(key);
    if (it == j.end()) return bad(key, "is missing");
    if (!it->is_object()) return bad(key, "is not a JSON object");
    *out = *it;
    return Status::OK();
  };
  int64_t version = 0;
  if (auto it = j.find("format_version"); it == j.end() || !it->is_number_integer()) {
    return Status::Corruption(path + " has no integer format_version; it is not a strata checkpoint manifest");
  }
  RETURN_IF_ERROR(integer(j, "format_version", "format_version", 1, std::numeric_limits<int64_t>::max(), &version));
  if (version > kFormatVersion) {
    return Status::Unimplemented("checkpoint " + step_dir + " was written by a newer strata (format " +
                                 std::to_string(version) + "; this build reads " + std::to_string(kFormatVersion) +
                                 "); upgrade strata");
  }
  m.format_version = static_cast<int>(version);
  constexpr int64_t kMaxCount = std::numeric_limits<int64_t>::max();
  RETURN_IF_ERROR(integer(j, "step", "step", 0, kMaxStep, &m.step));
  const std::string dir_name = std::filesystem::path(step_dir).filename().string();
  if (std::optional<int64_t> named = parse_step_dir_name(dir_name); named && *named != m.step) {
    return bad("step", "is " + std::to_string(m.step) + " but the directory is " + dir_name);
  }
  ManifestFields& f = m.fields;
  auto version_it = j.find("strata_version");
  if (version_it == j.end() || !version_it->is_string()) return bad("strata_version", "is not a string");
  f.strata_version = version_it->get<std::string>();
  int64_t tokens = 0;
  RETURN_IF_ERROR(integer(j, "tokens_seen", "tokens_seen", 0, kMaxCount, &tokens));
  f.tokens_seen = static_cast<uint64_t>(tokens);
  auto cursor = j.find("data_cursor");
  if (cursor == j.end() || !cursor->is_object()) return bad("data_cursor", "is not an object {epoch, index}");
  RETURN_IF_ERROR(integer(*cursor, "epoch", "data_cursor.epoch", 0, kMaxCount, &f.data_cursor.epoch));
  RETURN_IF_ERROR(integer(*cursor, "index", "data_cursor.index", 0, kMaxCount, &f.data_cursor.index));
  // A step makes at most one AdamW update.
  RETURN_IF_ERROR(integer(j, "optimizer_step", "optimizer_step", 0, m.step, &f.optimizer_step));
  RETURN_IF_ERROR(object("rng", &f.rng));
  RETURN_IF_ERROR(object("lr_schedule", &f.lr_schedule));
  RETURN_IF_ERROR(object("precision", &f.precision));
  RETURN_IF_ERROR(object("model_config", &f.model_config));
  RETURN_IF_ERROR(object("layout", &f.layout));
  RETURN_IF_ERROR(object("extra", &f.extra));
  auto files = j.find("files");
  if (files == j.end() || !files->is_object()) return Status::Corruption(path + " has no files table");
  for (auto it = files->begin(); it != files->end(); ++it) {
    const std::string field = "files." + quote_untrusted(it.key());
    if (!is_plain_file_name(it.key())) {
      return bad(field, "is not a plain file name inside the step directory (no '/', '..' or NUL)");
    }
    if (!it->is_object()) return bad(field, "is not an object {size, xxh3_64}");
    int64_t size = 0;
    RETURN_IF_ERROR(integer(*it, "size", field + ".size", 0, kMaxCount, &size));
    auto hash = it->find("xxh3_64");
    if (hash == it->end() || !hash->is_string() || !is_hex16(hash->get<std::string>())) {
      return bad(field + ".xxh3_64", "is not 16 lowercase hex digits");
    }
    FileRecord rec;
    rec.size = static_cast<uint64_t>(size);
    rec.xxh3 = std::stoull(hash->get<std::string>(), nullptr, 16);
    m.files[it.key()] = rec;
  }
  return m;
}

bool is_plain_file_name(std::string_view name) {
  if (name.empty() || name == "." || name == ".." || name.size() > 255) return false;
  return name.find('/') == std::string_view::npos && name.find('\0') == std::string_view::npos;
}

std::string quote_untrusted(std::string_view text, size_t max_chars) {
  std::string out = "'";
  for (size_t i = 0; i < text.size() && i < max_chars; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    out += c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?';
  }
  out += text.size() > max_chars ? "'..." : "'";
  return out;
}

}  // namespace strata::ckpt
