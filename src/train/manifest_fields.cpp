#include "train/manifest_fields.h"

#include <functional>
#include <limits>
#include <string_view>

#include <fmt/format.h>

#include "kernels/moments.h"
#include "offload/state_layout.h"

namespace strata {
namespace {

using nlohmann::json;

// A key from the file, as it may appear in a message: at most 32 printable ASCII characters.
std::string printable(const std::string& key) {
  std::string out;
  for (char c : key.substr(0, 32)) out += c >= 0x20 && c < 0x7F && c != '\'' ? c : '?';
  return out;
}

// Checks one trainer-owned object of the manifest, field by field.
class FieldChecker {
 public:
  FieldChecker(const std::string& manifest_path, std::string object, const json& value)
      : path_(manifest_path), object_(std::move(object)), value_(value) {}

  Status bad(const std::string& key, const std::string& why) const {
    return Status::Corruption(fmt::format("{}: field '{}.{}' {}; the checkpoint is damaged or its manifest was "
                                          "edited (load another step)",
                                          path_, object_, key, why));
  }
  // Every key is one of `known`.
  Status only(std::initializer_list<std::string_view> known) const {
    for (auto it = value_.begin(); it != value_.end(); ++it) {
      bool listed = false;
      for (std::string_view k : known) listed = listed || it.key() == k;
      if (!listed) return bad(printable(it.key()), "is not a field strata writes");
    }
    return Status::OK();
  }
  const json* find(const char* key) const {
    auto it = value_.find(key);
    return it == value_.end() ? nullptr : &*it;
  }
  // The string at `key` (absent: OK), which must be one of `allowed` when given.
  Status string(const char* key, const std::function<bool(const std::string&)>& allowed, const char* expected) const {
    const json* v = find(key);
    if (v == nullptr) return Status::OK();
    if (!v->is_string()) return bad(key, "is not a string");
    if (!allowed(v->get<std::string>()))
      return bad(key, fmt::format("is \"{}\", not {}", ckpt::quote_untrusted(v->get<std::string>()), expected));
    return Status::OK();
  }
  // The unsigned integer at `key` (absent: OK) up to `hi`; *out holds it when given.
  Status unsigned_integer(const char* key, uint64_t hi, uint64_t* out = nullptr) const {
    const json* v = find(key);
    if (v == nullptr) return Status::OK();
    // JSON text's non-negative integers parse as unsigned; built in memory they may be signed.
    const bool integer = v->is_number_unsigned() || (v->is_number_integer() && v->get<int64_t>() >= 0);
    if (!integer || v->get<uint64_t>() > hi)
      return bad(key, fmt::format("is {}, not an integer from 0 to {}", ckpt::quote_untrusted(v->dump()), hi));
    if (out != nullptr) *out = v->get<uint64_t>();
    return Status::OK();
  }

 private:
  const std::string& path_;
  std::string object_;
  const json& value_;
};

// "bf16" or "bf16, int8 moments" or "fp8, bf16 moments (stochastic)": PagedEngine::recipe().
bool is_recipe_name(const std::string& text) {
  const size_t comma = text.find(", ");
  if (!parse_precision(text.substr(0, comma))) return false;
  if (comma == std::string::npos) return true;
  std::string rest = text.substr(comma + 2);
  constexpr std::string_view kStochastic = " (stochastic)";
  if (rest.ends_with(kStochastic)) rest.resize(rest.size() - kStochastic.size());
  constexpr std::string_view kMoments = " moments";
  if (!rest.ends_with(kMoments)) return false;
  return kernels::parse_moment_format(rest.substr(0, rest.size() - kMoments.size())).has_value();
}

Status check_sharding(const FieldChecker& layout, const std::string& path) {
  const json* sharding = layout.find("sharding");
  if (sharding == nullptr) return Status::OK();
  if (!sharding->is_object()) return layout.bad("sharding", "is not a JSON object");
  FieldChecker s(path, "layout.sharding", *sharding);
  RETURN_IF_ERROR(s.only({"world_size", "by", "group_owner", "expert_parallel"}));
  uint64_t world = 0;
  RETURN_IF_ERROR(s.unsigned_integer("world_size", 1u << 20, &world));
  if (s.find("world_size") == nullptr || world == 0) return s.bad("world_size", "is not a number of ranks from 1");
  // Expert groups of this many ranks (each expert's ranges written by the ranks holding it).
  uint64_t experts = 1;
  RETURN_IF_ERROR(s.unsigned_integer("expert_parallel", 1u << 20, &experts));
  if (s.find("expert_parallel") != nullptr && (experts == 0 || world % experts != 0))
    return s.bad("expert_parallel", fmt::format("is not a number of ranks that divides the world size {}", world));
  // "element ranges": each rank's range of every tensor; "parameter groups": whole groups per
  // rank, as checkpoints written before range sharding record it.
  RETURN_IF_ERROR(s.string("by", [](const std::string& v) { return v == "element ranges" || v == "parameter groups"; },
                           "\"element ranges\" or \"parameter groups\""));
  if (const json* owners = s.find("group_owner")) {
    if (!owners->is_array()) return s.bad("group_owner", "is not an array of ranks");
    for (const json& o : *owners)
      if (!o.is_number_integer() || o.get<int64_t>() < 0 || o.get<uint64_t>() >= world)
        return s.bad("group_owner", fmt::format("holds {}, not a rank below the world size {}",
                                                ckpt::quote_untrusted(o.dump()), world));
  }
  return Status::OK();
}

}  // namespace

Status check_trainer_fields(const ckpt::Manifest& m, const std::string& path) {
  const ckpt::ManifestFields& f = m.fields;
  FieldChecker rng(path, "rng", f.rng);
  RETURN_IF_ERROR(rng.only({"data_order_seed"}));
  RETURN_IF_ERROR(rng.unsigned_integer("data_order_seed", std::numeric_limits<uint64_t>::max()));

  FieldChecker schedule(path, "lr_schedule", f.lr_schedule);
  RETURN_IF_ERROR(schedule.only({"step"}));
  uint64_t step = static_cast<uint64_t>(m.step);
  RETURN_IF_ERROR(schedule.unsigned_integer("step", std::numeric_limits<int64_t>::max(), &step));
  if (step != static_cast<uint64_t>(m.step))
    return schedule.bad("step", fmt::format("is {} but the checkpoint is at step {}", step, m.step));

  FieldChecker precision(path, "precision", f.precision);
  RETURN_IF_ERROR(precision.only({"recipe", "moments", "moments_rounding"}));
  RETURN_IF_ERROR(precision.string("recipe", is_recipe_name,
                                   "a recipe strata trains (fp32, bf16 or fp8, with its moment format)"));
  RETURN_IF_ERROR(precision.string(
      "moments", [](const std::string& v) { return kernels::parse_moment_format(v).has_value(); },
      "a moment format (fp32, bf16 or int8)"));
  RETURN_IF_ERROR(precision.string(
      "moments_rounding", [](const std::string& v) { return v == "nearest" || v == "stochastic"; },
      "nearest or stochastic"));

  FieldChecker layout(path, "layout", f.layout);
  RETURN_IF_ERROR(layout.only({"kind", "tensors", "sharding"}));
  RETURN_IF_ERROR(layout.string("kind", [](const std::string& v) { return v == "flat fp32 per tensor"; },
                                "\"flat fp32 per tensor\""));
  RETURN_IF_ERROR(layout.unsigned_integer("tensors", std::numeric_limits<int64_t>::max()));
  return check_sharding(layout, path);
}

}  // namespace strata
