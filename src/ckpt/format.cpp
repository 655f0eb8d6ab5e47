// Names, dtypes, safetensors headers and the manifest of the checkpoint format.
#include "ckpt/format.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>

namespace strata::ckpt {
namespace {

using nlohmann::json;

constexpr const char* kKindPrefixes[kTensorKindCount] = {"", "master/", "adam_m/", "adam_v/", "state/"};
// safetensors refuses headers above 100 MB; so do we.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Reads json[key] as an int64 when it is an integer; false otherwise.
bool get_int(const json& j, const char* key, int64_t* out) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer()) return false;
  *out = it->get<int64_t>();
  return true;
}

json object_or_empty(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() ? json::object() : *it;
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

std::string build_safetensors_header(const std::vector<HeaderEntry>& entries,
                                     const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  h["__metadata__"] = metadata;
  for (const HeaderEntry& e : entries) {
    h[e.name] = {{"dtype", dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  }
  std::string text = h.dump();
  const uint64_t data_start = round_up(8 + text.size(), kFileAlign);
  text.resize(data_start - 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

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
    if (!dtype) {
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
  int64_t version = 0;
  if (!get_int(j, "format_version", &version)) {
    return Status::Corruption(path + " has no integer format_version; it is not a strata checkpoint manifest");
  }
  if (version > kFormatVersion) {
    return Status::Unimplemented("checkpoint " + step_dir + " was written by a newer strata (format " +
                                 std::to_string(version) + "; this build reads " + std::to_string(kFormatVersion) +
                                 "); upgrade strata");
  }
  if (version < 1) return Status::Corruption(path + " has format_version " + std::to_string(version));
  m.format_version = static_cast<int>(version);
  if (!get_int(j, "step", &m.step)) return Status::Corruption(path + " has no integer step");
  ManifestFields& f = m.fields;
  if (auto it = j.find("strata_version"); it != j.end() && it->is_string()) f.strata_version = it->get<std::string>();
  int64_t tokens = 0;
  if (get_int(j, "tokens_seen", &tokens)) f.tokens_seen = static_cast<uint64_t>(tokens);
  if (auto it = j.find("data_cursor"); it != j.end() && it->is_object()) {
    get_int(*it, "epoch", &f.data_cursor.epoch);
    get_int(*it, "index", &f.data_cursor.index);
  }
  get_int(j, "optimizer_step", &f.optimizer_step);
  f.rng = object_or_empty(j, "rng");
  f.lr_schedule = object_or_empty(j, "lr_schedule");
  f.precision = object_or_empty(j, "precision");
  f.model_config = object_or_empty(j, "model_config");
  f.layout = object_or_empty(j, "layout");
  f.extra = object_or_empty(j, "extra");
  auto files = j.find("files");
  if (files == j.end() || !files->is_object()) return Status::Corruption(path + " has no files table");
  for (auto it = files->begin(); it != files->end(); ++it) {
    int64_t size = 0;
    auto hash = it->is_object() ? it->find("xxh3_64") : it->end();
    if (!it->is_object() || !get_int(*it, "size", &size) || size < 0 || hash == it->end() || !hash->is_string() ||
        hash->get<std::string>().size() != 16) {
      return Status::Corruption(path + ": the entry for " + it.key() + " lacks size or xxh3_64");
    }
    FileRecord rec;
    rec.size = static_cast<uint64_t>(size);
    const std::string hex = hash->get<std::string>();
    if (std::sscanf(hex.c_str(), "%16" SCNx64, &rec.xxh3) != 1) {
      return Status::Corruption(path + ": the xxh3_64 of " + it.key() + " is not hex");
    }
    m.files[it.key()] = rec;
  }
  return m;
}

}  // namespace strata::ckpt
