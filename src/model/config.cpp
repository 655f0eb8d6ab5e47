#include "model/config.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace strata::model {
namespace {

using nlohmann::json;

Status bad_key(const std::string& source, const std::string& key, const std::string& what) {
  return Status::InvalidArgument(fmt::format("{}: key '{}' {}", source, key, what));
}

// A key is "present" when it exists and is not null (transformers writes null for unset keys).
const json* find_key(const json& object, const std::string& key) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

// Reads an integer key (integral floats such as 4096.0 are accepted). Absent keys leave *out
// unchanged unless `required`. `path` is the key as the user sees it, e.g. "rope_scaling.factor".
Status read_int(const json& object, const std::string& key, const std::string& path,
                const std::string& source, bool required, int64_t* out) {
  const json* value = find_key(object, key);
  if (value == nullptr) {
    return required ? Status::NotFound(fmt::format("{}: required key '{}' is missing", source, path))
                    : Status::OK();
  }
  if (value->is_number_integer()) {
    *out = value->get<int64_t>();
    return Status::OK();
  }
  if (value->is_number_float()) {
    double d = value->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15) {
      *out = static_cast<int64_t>(d);
      return Status::OK();
    }
  }
  return bad_key(source, path, fmt::format("must be an integer, got {}", value->dump()));
}

Status read_double(const json& object, const std::string& key, const std::string& path,
                   const std::string& source, double* out) {
  const json* value = find_key(object, key);
  if (value == nullptr) return Status::OK();
  if (!value->is_number()) {
    return bad_key(source, path, fmt::format("must be a number, got {}", value->dump()));
  }
  *out = value->get<double>();
  return Status::OK();
}

Status read_bool(const json& object, const std::string& key, const std::string& source, bool* out) {
  const json* value = find_key(object, key);
  if (value == nullptr) return Status::OK();
  if (!value->is_boolean()) {
    return bad_key(source, key, fmt::format("must be true or false, got {}", value->dump()));
  }
  *out = value->get<bool>();
  return Status::OK();
}

// Reads a RoPE scaling description: `rope_scaling` ({rope_type | type, factor, ...}) or
// `rope_parameters` (the same plus rope_theta). "default" (or no type) means no scaling.
Status read_rope_object(const json& object, const std::string& name, const std::string& source,
                        kernels::RopeConfig* rope) {
  if (!object.is_object()) {
    return bad_key(source, name, fmt::format("must be an object, got {}", object.dump()));
  }
  RETURN_IF_ERROR(read_double(object, "rope_theta", name + ".rope_theta", source, &rope->theta));
  std::string type_key = "rope_type";
  const json* type = find_key(object, type_key);
  if (type == nullptr) {
    type_key = "type";  // older transformers releases
    type = find_key(object, type_key);
  }
  std::string type_name = "default";
  if (type != nullptr) {
    if (!type->is_string()) {
      return bad_key(source, name + "." + type_key, fmt::format("must be a string, got {}", type->dump()));
    }
    type_name = type->get<std::string>();
  }
  if (type_name == "default") {
    rope->llama3_scaling = false;
    return Status::OK();
  }
  if (type_name != "llama3") {
    return Status::Unimplemented(fmt::format(
        "{}: key '{}.{}' is \"{}\"; strata implements RoPE types \"default\" and \"llama3\"", source,
        name, type_key, type_name));
  }
  rope->llama3_scaling = true;
  RETURN_IF_ERROR(read_double(object, "factor", name + ".factor", source, &rope->factor));
  RETURN_IF_ERROR(read_double(object, "low_freq_factor", name + ".low_freq_factor", source,
                              &rope->low_freq_factor));
  RETURN_IF_ERROR(read_double(object, "high_freq_factor", name + ".high_freq_factor", source,
                              &rope->high_freq_factor));
  RETURN_IF_ERROR(read_int(object, "original_max_position_embeddings",
                           name + ".original_max_position_embeddings", source, /*required=*/false,
                           &rope->original_max_position_embeddings));
  return Status::OK();
}

Status positive(const std::string& source, const char* key, int64_t value) {
  if (value > 0) return Status::OK();
  return bad_key(source, key, fmt::format("must be positive, got {}", value));
}

}  // namespace

Result<ModelConfig> ModelConfig::from_json(const json& json, const std::string& source) {
  if (!json.is_object()) {
    return Status::InvalidArgument(fmt::format("{}: a model config must be a JSON object", source));
  }
  ModelConfig c;
  if (const auto* archs = find_key(json, "architectures")) {
    if (!archs->is_array() || archs->empty() || !(*archs)[0].is_string()) {
      return bad_key(source, "architectures", "must be a non-empty list of strings");
    }
    c.architecture = (*archs)[0].get<std::string>();
  }
  if (const auto* model_type = find_key(json, "model_type")) {
    if (!model_type->is_string()) return bad_key(source, "model_type", "must be a string");
    const std::string type = model_type->get<std::string>();
    if (type != "llama" && type != "mistral" && type != "qwen2") {
      return Status::Unimplemented(fmt::format(
          "{}: key 'model_type' is \"{}\"; strata reads llama, mistral and qwen2 configs", source,
          type));
    }
  }
  if (const auto* act = find_key(json, "hidden_act")) {
    if (!act->is_string() || act->get<std::string>() != "silu") {
      return Status::Unimplemented(fmt::format(
          "{}: key 'hidden_act' is {}; strata implements \"silu\" (SwiGLU)", source, act->dump()));
    }
  }
  bool mlp_bias = false;
  RETURN_IF_ERROR(read_bool(json, "mlp_bias", source, &mlp_bias));
  if (mlp_bias) {
    return Status::Unimplemented(fmt::format("{}: key 'mlp_bias' is true; strata has no MLP biases", source));
  }

  RETURN_IF_ERROR(read_int(json, "vocab_size", "vocab_size", source, true, &c.vocab_size));
  RETURN_IF_ERROR(read_int(json, "hidden_size", "hidden_size", source, true, &c.hidden_size));
  RETURN_IF_ERROR(read_int(json, "intermediate_size", "intermediate_size", source, true, &c.intermediate_size));
  RETURN_IF_ERROR(read_int(json, "num_hidden_layers", "num_hidden_layers", source, true, &c.num_hidden_layers));
  RETURN_IF_ERROR(read_int(json, "num_attention_heads", "num_attention_heads", source, true,
                           &c.num_attention_heads));
  RETURN_IF_ERROR(read_int(json, "num_key_value_heads", "num_key_value_heads", source, false,
                           &c.num_key_value_heads));
  RETURN_IF_ERROR(read_int(json, "head_dim", "head_dim", source, false, &c.head_dim));
  RETURN_IF_ERROR(read_double(json, "rms_norm_eps", "rms_norm_eps", source, &c.rms_norm_eps));
  RETURN_IF_ERROR(read_int(json, "max_position_embeddings", "max_position_embeddings", source, false,
                           &c.max_position_embeddings));
  RETURN_IF_ERROR(read_bool(json, "tie_word_embeddings", source, &c.tie_word_embeddings));
  RETURN_IF_ERROR(read_bool(json, "attention_bias", source, &c.attention_bias));

  RETURN_IF_ERROR(read_double(json, "rope_theta", "rope_theta", source, &c.rope.theta));
  if (const auto* scaling = find_key(json, "rope_scaling")) {
    RETURN_IF_ERROR(read_rope_object(*scaling, "rope_scaling", source, &c.rope));
  }
  if (const auto* params = find_key(json, "rope_parameters")) {
    RETURN_IF_ERROR(read_rope_object(*params, "rope_parameters", source, &c.rope));
  }

  // Report a head count that does not divide the hidden size before it is hidden by defaults.
  if (c.head_dim == 0 && c.num_attention_heads > 0 && c.hidden_size > 0 &&
      c.hidden_size % c.num_attention_heads != 0) {
    return bad_key(source, "num_attention_heads",
                   fmt::format("({}) does not divide hidden_size ({}) and head_dim is not set",
                               c.num_attention_heads, c.hidden_size));
  }
  c.fill_defaults();
  RETURN_IF_ERROR(c.validate(source));
  return c;
}

Result<ModelConfig> ModelConfig::from_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(fmt::format("{}: cannot open the model config", path));
  std::stringstream text;
  text << in.rdbuf();
  json parsed = json::parse(text.str(), /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    return Status::InvalidArgument(fmt::format("{}: not valid JSON", path));
  }
  return from_json(parsed, path);
}

Result<ModelConfig> ModelConfig::preset(const std::string& name) {
  ModelConfig c;
  if (name == "tiny") {
    c.vocab_size = 256;
    c.hidden_size = 128;
    c.intermediate_size = 384;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.max_position_embeddings = 1024;
    c.rms_norm_eps = 1e-5;
    c.rope.theta = 10000.0;
  } else if (name == "llama3.2-1b") {
    c.vocab_size = 128256;
    c.hidden_size = 2048;
    c.intermediate_size = 8192;
    c.num_hidden_layers = 16;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 8;
    c.max_position_embeddings = 131072;
    c.rms_norm_eps = 1e-5;
    c.tie_word_embeddings = true;
    c.rope = {.theta = 500000.0, .llama3_scaling = true, .factor = 32.0, .low_freq_factor = 1.0,
              .high_freq_factor = 4.0, .original_max_position_embeddings = 8192};
  } else if (name == "llama3-8b") {
    c.vocab_size = 128256;
    c.hidden_size = 4096;
    c.intermediate_size = 14336;
    c.num_hidden_layers = 32;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 8;
    c.max_position_embeddings = 8192;
    c.rms_norm_eps = 1e-5;
    c.rope.theta = 500000.0;
  } else {
    return Status::NotFound(fmt::format(
        "unknown model preset '{}'; presets are tiny, llama3.2-1b, llama3-8b", name));
  }
  c.fill_defaults();
  return c;
}

void ModelConfig::fill_defaults() {
  if (num_key_value_heads == 0) num_key_value_heads = num_attention_heads;
  if (head_dim == 0 && num_attention_heads > 0 && hidden_size % num_attention_heads == 0) {
    head_dim = hidden_size / num_attention_heads;
  }
}

Status ModelConfig::validate(const std::string& source) const {
  RETURN_IF_ERROR(positive(source, "vocab_size", vocab_size));
  RETURN_IF_ERROR(positive(source, "hidden_size", hidden_size));
  RETURN_IF_ERROR(positive(source, "intermediate_size", intermediate_size));
  RETURN_IF_ERROR(positive(source, "num_hidden_layers", num_hidden_layers));
  RETURN_IF_ERROR(positive(source, "num_attention_heads", num_attention_heads));
  RETURN_IF_ERROR(positive(source, "num_key_value_heads", num_key_value_heads));
  RETURN_IF_ERROR(positive(source, "max_position_embeddings", max_position_embeddings));
  if (head_dim == 0 && hidden_size % num_attention_heads != 0) {
    return bad_key(source, "num_attention_heads",
                   fmt::format("({}) does not divide hidden_size ({}) and head_dim is not set",
                               num_attention_heads, hidden_size));
  }
  RETURN_IF_ERROR(positive(source, "head_dim", head_dim));
  if (head_dim % 2 != 0) {
    return bad_key(source, "head_dim", fmt::format("must be even for rotary embeddings, got {}", head_dim));
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    return bad_key(source, "num_key_value_heads",
                   fmt::format("({}) must divide num_attention_heads ({})", num_key_value_heads,
                               num_attention_heads));
  }
  if (!(rms_norm_eps > 0) || !std::isfinite(rms_norm_eps)) {
    return bad_key(source, "rms_norm_eps", fmt::format("must be positive, got {}", rms_norm_eps));
  }
  if (!(rope.theta > 0) || !std::isfinite(rope.theta)) {
    return bad_key(source, "rope_theta", fmt::format("must be positive, got {}", rope.theta));
  }
  if (rope.llama3_scaling) {
    if (!(rope.factor > 0)) {
      return bad_key(source, "rope_scaling.factor", fmt::format("must be positive, got {}", rope.factor));
    }
    if (!(rope.low_freq_factor > 0) || !(rope.high_freq_factor > rope.low_freq_factor)) {
      return bad_key(source, "rope_scaling.high_freq_factor",
                     fmt::format("must exceed low_freq_factor > 0 (got low {}, high {})",
                                 rope.low_freq_factor, rope.high_freq_factor));
    }
    if (rope.original_max_position_embeddings <= 0) {
      return bad_key(source, "rope_scaling.original_max_position_embeddings",
                     fmt::format("must be positive, got {}", rope.original_max_position_embeddings));
    }
  }
  return Status::OK();
}

nlohmann::json ModelConfig::to_json() const {
  json j;
  j["architectures"] = json::array({architecture});
  j["model_type"] = "llama";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  // Written only when it is not the derived hidden_size / num_attention_heads, so that
  // overriding hidden_size or the head count on top of to_json() re-derives it.
  if (head_dim * num_attention_heads != hidden_size) j["head_dim"] = head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope.theta;
  if (rope.llama3_scaling) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", rope.factor},
                         {"low_freq_factor", rope.low_freq_factor},
                         {"high_freq_factor", rope.high_freq_factor},
                         {"original_max_position_embeddings", rope.original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["max_position_embeddings"] = max_position_embeddings;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["attention_bias"] = attention_bias;
  j["attention_dropout"] = 0.0;
  j["mlp_bias"] = false;
  j["initializer_range"] = 0.02;
  j["torch_dtype"] = "float32";
  return j;
}

int64_t ModelConfig::num_parameters() const {
  const int64_t C = hidden_size;
  int64_t per_layer = C                       // input_layernorm
                      + C * q_dim()           // q_proj
                      + 2 * C * kv_dim()      // k_proj, v_proj
                      + q_dim() * C           // o_proj
                      + C                     // post_attention_layernorm
                      + 3 * C * intermediate_size;  // gate, up, down
  if (attention_bias) per_layer += q_dim() + 2 * kv_dim();
  int64_t total = vocab_size * C + num_hidden_layers * per_layer + C;
  if (!tie_word_embeddings) total += vocab_size * C;
  return total;
}

}  // namespace strata::model
