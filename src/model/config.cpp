#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include <fmt/format.h>

#include "core/checked_math.h"

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

// The upper bound of each integer key (ModelLimits), by the key's last component.
struct KeyLimit {
  const char* key;
  int64_t max;
};
constexpr KeyLimit kKeyLimits[] = {
    {"vocab_size", ModelLimits::kVocabSize},
    {"hidden_size", ModelLimits::kHiddenSize},
    {"intermediate_size", ModelLimits::kIntermediateSize},
    {"moe_intermediate_size", ModelLimits::kIntermediateSize},
    {"shared_expert_intermediate_size", ModelLimits::kIntermediateSize},
    {"num_hidden_layers", ModelLimits::kLayers},
    {"decoder_sparse_step", ModelLimits::kLayers},
    {"mlp_only_layers", ModelLimits::kLayers},
    {"num_attention_heads", ModelLimits::kHeads},
    {"num_key_value_heads", ModelLimits::kHeads},
    {"head_dim", ModelLimits::kHeadDim},
    {"qk_nope_head_dim", ModelLimits::kHeadDim},
    {"qk_rope_head_dim", ModelLimits::kHeadDim},
    {"v_head_dim", ModelLimits::kHeadDim},
    {"q_lora_rank", ModelLimits::kLoraRank},
    {"kv_lora_rank", ModelLimits::kLoraRank},
    {"first_k_dense_replace", ModelLimits::kLayers},
    {"num_nextn_predict_layers", ModelLimits::kLayers},
    {"moe_layer_freq", ModelLimits::kLayers},
    {"n_routed_experts", ModelLimits::kExperts},
    {"n_shared_experts", ModelLimits::kExperts},
    {"n_group", ModelLimits::kExperts},
    {"topk_group", ModelLimits::kExperts},
    {"num_experts", ModelLimits::kExperts},
    {"num_local_experts", ModelLimits::kExperts},
    {"num_experts_per_tok", ModelLimits::kExperts},
    {"max_position_embeddings", ModelLimits::kPositions},
    {"sliding_window", ModelLimits::kPositions},
    {"original_max_position_embeddings", ModelLimits::kPositions},
};

int64_t limit_of(const std::string& path) {
  const std::string leaf = path.substr(path.rfind('.') + 1);
  for (const KeyLimit& l : kKeyLimits) {
    if (leaf == l.key) return l.max;
  }
  return std::numeric_limits<int64_t>::max();
}

Status too_large(const std::string& source, const std::string& path, const std::string& value_text) {
  return bad_key(source, path, fmt::format("is {}; strata accepts at most {} (ModelLimits, src/model/config.h)",
                                           value_text, limit_of(path)));
}

Status at_most(const std::string& source, const std::string& path, int64_t value) {
  if (value <= limit_of(path)) return Status::OK();
  return too_large(source, path, std::to_string(value));
}

// An integer JSON value as int64: integral floats such as 4096.0 are accepted; a value int64
// cannot hold is refused as written (not wrapped).
Status json_int(const json& value, const std::string& path, const std::string& source, const char* expected,
                int64_t* out) {
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return too_large(source, path, value.dump());
    *out = static_cast<int64_t>(u);
    return Status::OK();
  }
  if (value.is_number_integer()) {
    *out = value.get<int64_t>();
    return Status::OK();
  }
  if (value.is_number_float()) {
    const double d = value.get<double>();
    if (std::isfinite(d) && d == std::floor(d)) {
      // Beyond 2^53 a double no longer holds every integer; none of these keys gets near it.
      if (d >= 9e15) return too_large(source, path, value.dump());
      if (d > -9e15) {
        *out = static_cast<int64_t>(d);
        return Status::OK();
      }
    }
  }
  return bad_key(source, path, fmt::format("must be {}, got {}", expected, value.dump()));
}

// Reads an integer key. Absent keys leave *out unchanged unless `required`. `path` is the key as
// the user sees it, e.g. "rope_scaling.original_max_position_embeddings".
Status read_int(const json& object, const std::string& key, const std::string& path,
                const std::string& source, bool required, int64_t* out) {
  const json* value = find_key(object, key);
  if (value == nullptr) {
    return required ? Status::NotFound(fmt::format("{}: required key '{}' is missing", source, path))
                    : Status::OK();
  }
  return json_int(*value, path, source, "an integer", out);
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
    rope->scaling = kernels::RopeScaling::kNone;
    return Status::OK();
  }
  if (type_name == "linear" || type_name == "dynamic") {
    rope->scaling = type_name == "linear" ? kernels::RopeScaling::kLinear : kernels::RopeScaling::kDynamic;
    return read_double(object, "factor", name + ".factor", source, &rope->factor);
  }
  if (type_name == "yarn") {
    rope->scaling = kernels::RopeScaling::kYarn;
    rope->original_max_position_embeddings = 0;  // unset: max_position_embeddings stands for it
    // Optional keys may be written as null; transformers then takes their defaults.
    auto optional_double = [&](const char* key, double* out) -> Status {
      const json* value = find_key(object, key);
      if (value == nullptr || value->is_null()) return Status::OK();
      return read_double(object, key, name + "." + key, source, out);
    };
    // transformers requires the factor for yarn (the other types' 8.0 default is not one).
    const json* factor = find_key(object, "factor");
    if (factor == nullptr || factor->is_null())
      return bad_key(source, name + ".factor", "is required for yarn scaling");
    RETURN_IF_ERROR(read_double(object, "factor", name + ".factor", source, &rope->factor));
    if (const json* given = find_key(object, "attention_factor"); given && given->is_number() &&
        !(given->get<double>() > 0))
      return bad_key(source, name + ".attention_factor",
                     fmt::format("must be positive (it multiplies cos and sin), got {}", given->dump()));
    for (const auto& [key, out] : {std::pair{"beta_fast", &rope->beta_fast}, std::pair{"beta_slow", &rope->beta_slow},
                                   std::pair{"attention_factor", &rope->attention_factor},
                                   std::pair{"mscale", &rope->mscale}, std::pair{"mscale_all_dim", &rope->mscale_all_dim}}) {
      RETURN_IF_ERROR(optional_double(key, out));
    }
    if (const json* original = find_key(object, "original_max_position_embeddings"); original && !original->is_null()) {
      RETURN_IF_ERROR(read_int(object, "original_max_position_embeddings",
                               name + ".original_max_position_embeddings", source, /*required=*/false,
                               &rope->original_max_position_embeddings));
    }
    // transformers tests truncate for truth: null does not truncate.
    if (const auto truncate = object.find("truncate"); truncate != object.end() && truncate->is_null()) {
      rope->truncate = false;
      return Status::OK();
    }
    return read_bool(object, "truncate", source, &rope->truncate);
  }
  if (type_name != "llama3") {
    return Status::Unimplemented(fmt::format(
        "{}: key '{}.{}' is \"{}\"; strata implements RoPE types \"default\", \"linear\", \"dynamic\", "
        "\"llama3\" and \"yarn\"",
        source, name, type_key, type_name));
  }
  rope->scaling = kernels::RopeScaling::kLlama3;
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

// The architectures strata implements, with the model_type transformers pairs with each.
struct Architecture {
  const char* name;
  const char* model_type;
};
constexpr Architecture kArchitectures[] = {
    {"LlamaForCausalLM", "llama"},      {"MistralForCausalLM", "mistral"},
    {"Qwen2ForCausalLM", "qwen2"},      {"MixtralForCausalLM", "mixtral"},
    {"Qwen2MoeForCausalLM", "qwen2_moe"}, {"Qwen3ForCausalLM", "qwen3"},
    {"Qwen3MoeForCausalLM", "qwen3_moe"}, {"DeepseekV2ForCausalLM", "deepseek_v2"},
    {"DeepseekV3ForCausalLM", "deepseek_v3"},
};
constexpr const char* kMixtral = "MixtralForCausalLM";
constexpr const char* kQwen2 = "Qwen2ForCausalLM";
constexpr const char* kQwen2Moe = "Qwen2MoeForCausalLM";
constexpr const char* kQwen3 = "Qwen3ForCausalLM";
constexpr const char* kQwen3Moe = "Qwen3MoeForCausalLM";
constexpr const char* kMistral = "MistralForCausalLM";
constexpr const char* kDeepseekV2 = "DeepseekV2ForCausalLM";
constexpr const char* kDeepseekV3 = "DeepseekV3ForCausalLM";

const Architecture* find_architecture(const std::string& name, bool by_model_type) {
  for (const Architecture& a : kArchitectures) {
    if (name == (by_model_type ? a.model_type : a.name)) return &a;
  }
  return nullptr;
}

std::string supported_list(bool by_model_type) {
  std::string out;
  for (const Architecture& a : kArchitectures) {
    out += (out.empty() ? "" : ", ") + std::string(by_model_type ? a.model_type : a.name);
  }
  return out;
}

Status read_int_list(const json& object, const std::string& key, const std::string& source,
                     std::vector<int64_t>* out) {
  const json* value = find_key(object, key);
  if (value == nullptr) return Status::OK();
  if (!value->is_array()) {
    return bad_key(source, key, fmt::format("must be a list of integers, got {}", value->dump()));
  }
  // Each entry names a distinct layer, so a longer list than there can be layers is a mistake
  // (and would make every is_moe_layer() call slow).
  if (value->size() > static_cast<size_t>(ModelLimits::kLayers)) {
    return bad_key(source, key, fmt::format("lists {} layers; strata accepts at most {} (ModelLimits, "
                                            "src/model/config.h)", value->size(), ModelLimits::kLayers));
  }
  out->clear();
  for (const json& item : *value) {
    if (!item.is_number_integer()) {
      return bad_key(source, key, fmt::format("must be a list of integers, got {}", value->dump()));
    }
    int64_t layer = 0;
    RETURN_IF_ERROR(json_int(item, key, source, "a list of integers", &layer));
    out->push_back(layer);
  }
  return Status::OK();
}

// The Hugging Face key that holds the expert count of this architecture.
const char* experts_key(const std::string& architecture) {
  if (architecture == kDeepseekV2 || architecture == kDeepseekV3) return "n_routed_experts";
  return architecture == kMixtral ? "num_local_experts" : "num_experts";
}

// A string key among `allowed`; absent keys leave *out unchanged.
Status read_choice(const json& object, const std::string& key, const std::string& source,
                   std::initializer_list<const char*> allowed, std::string* out) {
  const json* value = find_key(object, key);
  if (value == nullptr) return Status::OK();
  std::string list;
  for (const char* a : allowed) list += (list.empty() ? "\"" : ", \"") + std::string(a) + "\"";
  if (value->is_string()) {
    for (const char* a : allowed) {
      if (value->get<std::string>() == a) {
        *out = a;
        return Status::OK();
      }
    }
  }
  return Status::Unimplemented(
      fmt::format("{}: key '{}' is {}; strata implements {}", source, key, value->dump(), list));
}

// An integer key that may be null (DeepSeek's q_lora_rank: null = no low-rank q); null reads as 0.
Status read_int_or_null(const json& object, const std::string& key, const std::string& source, int64_t* out) {
  if (auto it = object.find(key); it != object.end() && it->is_null()) {
    *out = 0;
    return Status::OK();
  }
  return read_int(object, key, key, source, false, out);
}

// DeepSeek-V2/V3: multi-head latent attention and DeepSeekMoE (DeepseekV2Config's and
// DeepseekV3Config's defaults for absent keys). Keys that would change the math in a way strata
// does not implement are refused by name.
Status read_deepseek_keys(const json& json, const std::string& source, ModelConfig* c) {
  const bool v3 = c->architecture == kDeepseekV3;
  c->attention_bias = false;
  bool bias = false;
  RETURN_IF_ERROR(read_bool(json, "attention_bias", source, &bias));
  if (bias) {
    return Status::Unimplemented(fmt::format(
        "{}: key 'attention_bias' is true; DeepSeek's latent attention in strata has no projection biases", source));
  }
  c->q_lora_rank = 1536;
  c->kv_lora_rank = 512;
  c->qk_nope_head_dim = 128;
  c->qk_rope_head_dim = 64;
  c->v_head_dim = 128;
  RETURN_IF_ERROR(read_int_or_null(json, "q_lora_rank", source, &c->q_lora_rank));
  RETURN_IF_ERROR(read_int(json, "kv_lora_rank", "kv_lora_rank", source, false, &c->kv_lora_rank));
  RETURN_IF_ERROR(read_int(json, "qk_nope_head_dim", "qk_nope_head_dim", source, false, &c->qk_nope_head_dim));
  RETURN_IF_ERROR(read_int(json, "qk_rope_head_dim", "qk_rope_head_dim", source, false, &c->qk_rope_head_dim));
  RETURN_IF_ERROR(read_int(json, "v_head_dim", "v_head_dim", source, false, &c->v_head_dim));
  if (c->kv_lora_rank <= 0) {
    return bad_key(source, "kv_lora_rank",
                   fmt::format("must be positive (latent attention), got {}", c->kv_lora_rank));
  }
  // The q/k head and the heads' count follow from these (fill_defaults); config.json's own
  // head_dim and num_key_value_heads do not enter DeepSeek's attention.
  c->head_dim = 0;
  c->num_key_value_heads = 0;

  // Experts: n_routed_experts null or 0 means a dense model (V2's default; V3's is 256).
  c->num_experts = v3 ? 256 : 0;
  RETURN_IF_ERROR(read_int(json, "n_routed_experts", "n_routed_experts", source, false, &c->num_experts));
  c->num_experts_per_tok = v3 ? 8 : 0;  // V2's default is none: an MoE config names it
  RETURN_IF_ERROR(read_int(json, "num_experts_per_tok", "num_experts_per_tok", source, false,
                           &c->num_experts_per_tok));
  c->moe_intermediate_size = v3 ? 2048 : 1407;
  RETURN_IF_ERROR(read_int(json, "moe_intermediate_size", "moe_intermediate_size", source, false,
                           &c->moe_intermediate_size));
  int64_t shared = v3 ? 1 : 0;
  // null: none.
  if (auto it = json.find("n_shared_experts"); it != json.end() && it->is_null()) shared = 0;
  RETURN_IF_ERROR(read_int(json, "n_shared_experts", "n_shared_experts", source, false, &shared));
  if (shared < 0) return bad_key(source, "n_shared_experts", fmt::format("must not be negative, got {}", shared));
  RETURN_IF_ERROR(at_most(source, "n_shared_experts", shared));
  RETURN_IF_ERROR(at_most(source, "moe_intermediate_size", c->moe_intermediate_size));
  c->shared_expert_intermediate_size = shared * c->moe_intermediate_size;
  c->shared_expert_gated = false;
  c->first_k_dense_replace = v3 ? 3 : 0;
  c->moe_layer_freq = 1;
  RETURN_IF_ERROR(read_int(json, "first_k_dense_replace", "first_k_dense_replace", source, false,
                           &c->first_k_dense_replace));
  RETURN_IF_ERROR(read_int(json, "moe_layer_freq", "moe_layer_freq", source, false, &c->moe_layer_freq));

  // Routing: scores, group limiting, normalisation and scaling (kernels/moe.h).
  std::string scoring = v3 ? "sigmoid" : "softmax";
  RETURN_IF_ERROR(read_choice(json, "scoring_func", source, {"softmax", "sigmoid"}, &scoring));
  std::string method = v3 ? "noaux_tc" : "greedy";
  RETURN_IF_ERROR(read_choice(json, "topk_method", source, {"greedy", "group_limited_greedy", "noaux_tc"}, &method));
  c->router_scoring =
      scoring == "sigmoid" ? kernels::RouterScoring::kSigmoidThenTopK : kernels::RouterScoring::kSoftmaxThenTopK;
  c->norm_topk_prob = v3;
  RETURN_IF_ERROR(read_bool(json, "norm_topk_prob", source, &c->norm_topk_prob));
  // DeepSeek normalises only when it routes to more than one expert.
  c->norm_topk_prob = c->norm_topk_prob && c->num_experts_per_tok > 1;
  c->n_group = v3 ? 8 : 1;
  c->topk_group = v3 ? 4 : 1;
  RETURN_IF_ERROR(read_int(json, "n_group", "n_group", source, false, &c->n_group));
  RETURN_IF_ERROR(read_int(json, "topk_group", "topk_group", source, false, &c->topk_group));
  if (method == "greedy") {
    c->n_group = 1;  // the groups are not read
    c->topk_group = 1;
  }
  c->group_score = method == "noaux_tc" ? kernels::GroupScore::kTopTwoSum : kernels::GroupScore::kMax;
  c->router_selection_bias = method == "noaux_tc";
  double scale = v3 ? 2.5 : 1.0;
  RETURN_IF_ERROR(read_double(json, "routed_scaling_factor", "routed_scaling_factor", source, &scale));
  // DeepSeek-V2 scales the weights only where it does not normalise them; V3 always.
  c->routed_scale = !v3 && c->norm_topk_prob && c->num_experts_per_tok > 1 ? 1.0 : scale;
  if (!(c->routed_scale > 0) || !std::isfinite(c->routed_scale)) {
    return bad_key(source, "routed_scaling_factor", fmt::format("must be positive, got {}", scale));
  }
  // DeepSeek-V2 trains with a sequence-wise auxiliary loss strata does not compute; balancing
  // comes from the selection bias (router_bias_update_rate). V3's published modeling code routes
  // with noaux_tc and applies no auxiliary loss, whatever aux_loss_alpha says.
  double alpha = 0.001;  // both versions' default
  RETURN_IF_ERROR(read_double(json, "aux_loss_alpha", "aux_loss_alpha", source, &alpha));
  if (alpha != 0.0 && method != "noaux_tc" && c->num_experts > 0) {
    return Status::Unimplemented(fmt::format(
        "{}: key 'aux_loss_alpha' is {}; strata trains DeepSeek's experts without its sequence-wise "
        "auxiliary loss: set it to 0 (model.set aux_loss_alpha=0), and balance with router_bias_update_rate",
        source, alpha));
  }
  c->router_aux_loss_coef = 0.0;
  c->output_router_logits = false;
  RETURN_IF_ERROR(read_double(json, "router_bias_update_rate", "router_bias_update_rate", source,
                              &c->router_bias_update_rate));
  c->num_nextn_predict_layers = v3 ? 1 : 0;
  RETURN_IF_ERROR(read_int(json, "num_nextn_predict_layers", "num_nextn_predict_layers", source, false,
                           &c->num_nextn_predict_layers));
  return Status::OK();
}

// Reads the architecture-specific keys: attention variants, sliding window and experts. Absent
// keys take transformers' defaults for that architecture.
Status read_architecture_keys(const json& json, const std::string& source, ModelConfig* c) {
  const std::string& arch = c->architecture;
  if (arch == kDeepseekV2 || arch == kDeepseekV3) return read_deepseek_keys(json, source, c);
  const bool qwen = arch == kQwen2 || arch == kQwen2Moe || arch == kQwen3 || arch == kQwen3Moe;
  if (arch == kQwen2 || arch == kQwen2Moe) {
    c->attention_bias = true;  // Qwen2 attention always has q/k/v biases
  } else if (arch == kMistral || arch == kMixtral) {
    c->attention_bias = false;
  } else {
    RETURN_IF_ERROR(read_bool(json, "attention_bias", source, &c->attention_bias));
  }
  c->qk_norm = arch == kQwen3 || arch == kQwen3Moe;

  if (arch == kMistral || arch == kMixtral) {
    if (arch == kMistral && json.find("sliding_window") == json.end()) c->sliding_window = 4096;
    RETURN_IF_ERROR(read_int(json, "sliding_window", "sliding_window", source, false, &c->sliding_window));
  } else if (qwen) {
    bool use_sliding_window = false;
    RETURN_IF_ERROR(read_bool(json, "use_sliding_window", source, &use_sliding_window));
    if (use_sliding_window) {
      c->sliding_window = 4096;
      RETURN_IF_ERROR(read_int(json, "sliding_window", "sliding_window", source, false, &c->sliding_window));
    }
  }

  if (arch == kMixtral) {
    c->num_experts = 8;
    c->num_experts_per_tok = 2;
    c->moe_intermediate_size = c->intermediate_size;
    c->router_scoring = kernels::RouterScoring::kTopKThenSoftmax;
    c->router_aux_loss_coef = 0.001;
    double jitter = 0.0;
    RETURN_IF_ERROR(read_double(json, "router_jitter_noise", "router_jitter_noise", source, &jitter));
    if (jitter != 0.0) {
      return Status::Unimplemented(fmt::format(
          "{}: key 'router_jitter_noise' is {}; strata implements 0 (no router jitter)", source, jitter));
    }
  } else if (arch == kQwen2Moe || arch == kQwen3Moe) {
    const bool v2 = arch == kQwen2Moe;
    c->num_experts = v2 ? 60 : 128;
    c->num_experts_per_tok = v2 ? 4 : 8;
    c->moe_intermediate_size = v2 ? 1408 : 768;
    c->shared_expert_intermediate_size = v2 ? 5632 : 0;
    c->router_scoring = kernels::RouterScoring::kSoftmaxThenTopK;
    c->router_aux_loss_coef = 0.001;
    RETURN_IF_ERROR(read_int(json, "moe_intermediate_size", "moe_intermediate_size", source, false,
                             &c->moe_intermediate_size));
    if (v2) {
      RETURN_IF_ERROR(read_int(json, "shared_expert_intermediate_size", "shared_expert_intermediate_size",
                               source, false, &c->shared_expert_intermediate_size));
    }
    RETURN_IF_ERROR(read_bool(json, "norm_topk_prob", source, &c->norm_topk_prob));
    RETURN_IF_ERROR(read_int(json, "decoder_sparse_step", "decoder_sparse_step", source, false,
                             &c->decoder_sparse_step));
    RETURN_IF_ERROR(read_int_list(json, "mlp_only_layers", source, &c->mlp_only_layers));
  } else {
    return Status::OK();  // dense architectures have no expert keys
  }
  const char* ek = experts_key(arch);
  RETURN_IF_ERROR(read_int(json, ek, ek, source, false, &c->num_experts));
  RETURN_IF_ERROR(read_int(json, "num_experts_per_tok", "num_experts_per_tok", source, false,
                           &c->num_experts_per_tok));
  RETURN_IF_ERROR(read_double(json, "router_aux_loss_coef", "router_aux_loss_coef", source,
                              &c->router_aux_loss_coef));
  RETURN_IF_ERROR(read_bool(json, "output_router_logits", source, &c->output_router_logits));
  RETURN_IF_ERROR(read_double(json, "router_bias_update_rate", "router_bias_update_rate", source,
                              &c->router_bias_update_rate));
  return Status::OK();
}

}  // namespace

Result<ModelConfig> ModelConfig::from_json(const json& json, const std::string& source) {
  if (!json.is_object()) {
    return Status::InvalidArgument(fmt::format("{}: a model config must be a JSON object", source));
  }
  ModelConfig c;
  const Architecture* arch = nullptr;
  if (const auto* model_type = find_key(json, "model_type")) {
    if (!model_type->is_string()) return bad_key(source, "model_type", "must be a string");
    const std::string type = model_type->get<std::string>();
    arch = find_architecture(type, /*by_model_type=*/true);
    if (arch == nullptr) {
      return Status::Unimplemented(fmt::format(
          "{}: key 'model_type' is \"{}\"; strata reads {} configs", source, type, supported_list(true)));
    }
  }
  if (const auto* archs = find_key(json, "architectures")) {
    if (!archs->is_array() || archs->empty() || !(*archs)[0].is_string()) {
      return bad_key(source, "architectures", "must be a non-empty list of strings");
    }
    const std::string name = (*archs)[0].get<std::string>();
    arch = find_architecture(name, /*by_model_type=*/false);
    if (arch == nullptr) {
      return Status::Unimplemented(fmt::format("{}: key 'architectures' is \"{}\"; strata implements {}",
                                               source, name, supported_list(false)));
    }
  }
  if (arch != nullptr) c.architecture = arch->name;
  if (c.architecture == kMixtral) {  // MixtralConfig defaults that differ from Llama's
    c.rope.theta = 1e6;
    c.rms_norm_eps = 1e-5;
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
  RETURN_IF_ERROR(read_architecture_keys(json, source, &c));

  RETURN_IF_ERROR(read_double(json, "rope_theta", "rope_theta", source, &c.rope.theta));
  if (const auto* scaling = find_key(json, "rope_scaling")) {
    RETURN_IF_ERROR(read_rope_object(*scaling, "rope_scaling", source, &c.rope));
  }
  if (const auto* params = find_key(json, "rope_parameters")) {
    RETURN_IF_ERROR(read_rope_object(*params, "rope_parameters", source, &c.rope));
  }

  // Report a head count that does not divide the hidden size before it is hidden by defaults.
  if (c.head_dim == 0 && !c.is_mla() && c.num_attention_heads > 0 && c.hidden_size > 0 &&
      c.hidden_size % c.num_attention_heads != 0) {
    return bad_key(source, "num_attention_heads",
                   fmt::format("({}) does not divide hidden_size ({}) and head_dim is not set",
                               c.num_attention_heads, c.hidden_size));
  }
  c.fill_defaults();
  RETURN_IF_ERROR(c.validate(source));
  return c;
}

const std::vector<std::string>& ModelConfig::known_keys() {
  // Every key from_json (and read_architecture_keys) reads, for any architecture.
  static const std::vector<std::string> keys = {
      "architectures", "model_type", "hidden_act", "mlp_bias", "vocab_size", "hidden_size",
      "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
      "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "rope_theta",
      "rope_scaling", "rope_parameters", "sliding_window", "use_sliding_window", "router_jitter_noise",
      "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
      "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
      "router_aux_loss_coef", "output_router_logits", "router_bias_update_rate",
      // DeepSeek-V2/V3
      "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
      "n_shared_experts", "n_group", "topk_group", "topk_method", "scoring_func", "routed_scaling_factor",
      "first_k_dense_replace", "moe_layer_freq", "num_nextn_predict_layers", "aux_loss_alpha",
  };
  return keys;
}

bool ModelConfig::is_known_key(const std::string& key) {
  const std::vector<std::string>& keys = known_keys();
  return std::find(keys.begin(), keys.end(), key) != keys.end();
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
    c.rope = {.theta = 500000.0, .scaling = kernels::RopeScaling::kLlama3, .factor = 32.0, .low_freq_factor = 1.0,
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
  if (is_mla()) {
    // Every head has its own keys (from the shared latent), q and k heads of nope + rope dims.
    num_key_value_heads = num_attention_heads;
    head_dim = qk_nope_head_dim + qk_rope_head_dim;
  }
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
  // Bounds before any product is formed from these values.
  RETURN_IF_ERROR(at_most(source, "vocab_size", vocab_size));
  RETURN_IF_ERROR(at_most(source, "hidden_size", hidden_size));
  RETURN_IF_ERROR(at_most(source, "intermediate_size", intermediate_size));
  RETURN_IF_ERROR(at_most(source, "num_hidden_layers", num_hidden_layers));
  RETURN_IF_ERROR(at_most(source, "num_attention_heads", num_attention_heads));
  RETURN_IF_ERROR(at_most(source, "num_key_value_heads", num_key_value_heads));
  RETURN_IF_ERROR(at_most(source, "head_dim", head_dim));
  RETURN_IF_ERROR(at_most(source, "max_position_embeddings", max_position_embeddings));
  RETURN_IF_ERROR(at_most(source, "sliding_window", sliding_window));
  RETURN_IF_ERROR(at_most(source, experts_key(architecture), num_experts));
  RETURN_IF_ERROR(at_most(source, "num_experts_per_tok", num_experts_per_tok));
  RETURN_IF_ERROR(at_most(source, uses_mixtral_tensor_names() ? "intermediate_size" : "moe_intermediate_size",
                          moe_intermediate_size));
  RETURN_IF_ERROR(at_most(source, "shared_expert_intermediate_size", shared_expert_intermediate_size));
  RETURN_IF_ERROR(at_most(source, "decoder_sparse_step", decoder_sparse_step));
  RETURN_IF_ERROR(at_most(source, "q_lora_rank", q_lora_rank));
  RETURN_IF_ERROR(at_most(source, "kv_lora_rank", kv_lora_rank));
  RETURN_IF_ERROR(at_most(source, "qk_nope_head_dim", qk_nope_head_dim));
  RETURN_IF_ERROR(at_most(source, "qk_rope_head_dim", qk_rope_head_dim));
  RETURN_IF_ERROR(at_most(source, "v_head_dim", v_head_dim));
  RETURN_IF_ERROR(at_most(source, "first_k_dense_replace", first_k_dense_replace));
  RETURN_IF_ERROR(at_most(source, "moe_layer_freq", moe_layer_freq));
  RETURN_IF_ERROR(at_most(source, "num_nextn_predict_layers", num_nextn_predict_layers));
  if (num_nextn_predict_layers < 0) {
    return bad_key(source, "num_nextn_predict_layers",
                   fmt::format("must not be negative, got {}", num_nextn_predict_layers));
  }
  if (num_nextn_predict_layers > 0 && !is_deepseek()) {
    return bad_key(source, "num_nextn_predict_layers",
                   fmt::format("is {}; multi-token prediction modules exist for the DeepSeek architectures only",
                               num_nextn_predict_layers));
  }
  if (!(mtp_loss_weight >= 0) || !std::isfinite(mtp_loss_weight)) {
    return Status::InvalidArgument(
        fmt::format("{}: the MTP loss weight (train.mtp_weight) must be finite and not negative, got {}", source,
                    mtp_loss_weight));
  }
  RETURN_IF_ERROR(lora.validate(source));
  if (lora.enabled() && is_mla())
    return Status::Unimplemented(source + ": LoRA adapters on multi-head latent attention (" + architecture +
                                 ") are not supported yet; use train.method=full");
  RETURN_IF_ERROR(at_most(source, "n_group", n_group));
  RETURN_IF_ERROR(at_most(source, "topk_group", topk_group));
  if (rope.scaling == kernels::RopeScaling::kLlama3 || rope.scaling == kernels::RopeScaling::kYarn) {
    RETURN_IF_ERROR(at_most(source, "rope_scaling.original_max_position_embeddings",
                            rope.original_max_position_embeddings));
  }
  if (mlp_only_layers.size() > static_cast<size_t>(ModelLimits::kLayers)) {
    return bad_key(source, "mlp_only_layers", fmt::format("lists {} layers; strata accepts at most {}",
                                                          mlp_only_layers.size(), ModelLimits::kLayers));
  }
  RETURN_IF_ERROR(validate_shape(source));
  // The whole model, once each key is within bounds (so these counts cannot overflow).
  if (num_tensors() > ModelLimits::kTensors) {
    return Status::InvalidArgument(fmt::format(
        "{}: the model has {} parameter tensors (num_hidden_layers {}, {} {}); strata accepts at most {} "
        "(ModelLimits, src/model/config.h)",
        source, num_tensors(), num_hidden_layers, experts_key(architecture), num_experts, ModelLimits::kTensors));
  }
  const std::optional<int64_t> params = count_parameters();
  if (!params || *params > ModelLimits::kParameters) {
    return Status::InvalidArgument(fmt::format(
        "{}: the model has {} parameters (vocab_size {}, hidden_size {}, intermediate_size {}, num_hidden_layers "
        "{}, {} {}); strata accepts at most {} (ModelLimits, src/model/config.h)",
        source, params ? std::to_string(*params) : "more than 2^63", vocab_size, hidden_size, intermediate_size,
        num_hidden_layers, experts_key(architecture), num_experts, ModelLimits::kParameters));
  }
  return Status::OK();
}

// Multi-head latent attention's keys (ModelConfig::is_mla).
Status validate_mla(const ModelConfig& c, const std::string& source) {
  RETURN_IF_ERROR(positive(source, "qk_nope_head_dim", c.qk_nope_head_dim));
  RETURN_IF_ERROR(positive(source, "qk_rope_head_dim", c.qk_rope_head_dim));
  RETURN_IF_ERROR(positive(source, "v_head_dim", c.v_head_dim));
  if (c.qk_rope_head_dim % 2 != 0) {
    return bad_key(source, "qk_rope_head_dim",
                   fmt::format("must be even for rotary embeddings, got {}", c.qk_rope_head_dim));
  }
  if (c.q_lora_rank < 0) return bad_key(source, "q_lora_rank", fmt::format("must not be negative, got {}", c.q_lora_rank));
  if (c.head_dim != c.qk_nope_head_dim + c.qk_rope_head_dim || c.num_key_value_heads != c.num_attention_heads) {
    return bad_key(source, "qk_nope_head_dim",
                   fmt::format("and qk_rope_head_dim give heads of {} with {} key heads; latent attention's heads "
                               "are qk_nope_head_dim + qk_rope_head_dim = {} wide, one per attention head ({})",
                               c.head_dim, c.num_key_value_heads, c.qk_nope_head_dim + c.qk_rope_head_dim,
                               c.num_attention_heads));
  }
  if (c.qk_norm || c.attention_bias) {
    return bad_key(source, c.qk_norm ? "qk_norm" : "attention_bias",
                   "does not combine with latent attention (kv_lora_rank)");
  }
  return Status::OK();
}

Status ModelConfig::validate_shape(const std::string& source) const {
  if (is_mla()) RETURN_IF_ERROR(validate_mla(*this, source));
  if (head_dim == 0 && hidden_size % num_attention_heads != 0) {
    return bad_key(source, "num_attention_heads",
                   fmt::format("({}) does not divide hidden_size ({}) and head_dim is not set",
                               num_attention_heads, hidden_size));
  }
  RETURN_IF_ERROR(positive(source, "head_dim", head_dim));
  if (head_dim % 2 != 0 && !is_mla()) {  // latent attention turns qk_rope_head_dim dims only
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
  if (rope.scaling != kernels::RopeScaling::kNone && (!(rope.factor > 0) || !std::isfinite(rope.factor))) {
    return bad_key(source, "rope_scaling.factor", fmt::format("must be positive, got {}", rope.factor));
  }
  if (rope.scaling == kernels::RopeScaling::kLlama3) {
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
  if (rope.scaling == kernels::RopeScaling::kYarn) {
    if (rope.original_max_position_embeddings < 0)
      return bad_key(source, "rope_scaling.original_max_position_embeddings",
                     fmt::format("must be positive, got {}", rope.original_max_position_embeddings));
    const std::pair<const char*, double> keys[] = {{"beta_fast", rope.beta_fast},
                                                   {"beta_slow", rope.beta_slow},
                                                   {"attention_factor", rope.attention_factor},
                                                   {"mscale", rope.mscale},
                                                   {"mscale_all_dim", rope.mscale_all_dim}};
    for (const auto& [key, value] : keys) {
      if (!(value >= 0) || !std::isfinite(value))
        return bad_key(source, std::string("rope_scaling.") + key,
                       fmt::format("must be a finite number >= 0, got {}", value));
    }
    // The ramp's boundaries take the logarithm of the base and of the context over the turns.
    if (rope.theta <= 1.0)
      return bad_key(source, "rope_theta", fmt::format("must exceed 1 for yarn scaling, got {}", rope.theta));
  }
  if (sliding_window < 0) {
    return bad_key(source, "sliding_window", fmt::format("must be positive or null, got {}", sliding_window));
  }
  if (num_experts < 0) {
    return bad_key(source, experts_key(architecture), fmt::format("must not be negative, got {}", num_experts));
  }
  if (num_experts == 0) return Status::OK();
  if (num_experts_per_tok < 1 || num_experts_per_tok > num_experts) {
    return bad_key(source, "num_experts_per_tok",
                   fmt::format("must be between 1 and {} ({}), got {}", experts_key(architecture),
                               num_experts, num_experts_per_tok));
  }
  RETURN_IF_ERROR(positive(source, uses_mixtral_tensor_names() ? "intermediate_size" : "moe_intermediate_size",
                           moe_intermediate_size));
  if (shared_expert_intermediate_size < 0) {
    return bad_key(source, "shared_expert_intermediate_size",
                   fmt::format("must not be negative, got {}", shared_expert_intermediate_size));
  }
  RETURN_IF_ERROR(positive(source, "decoder_sparse_step", decoder_sparse_step));
  for (int64_t layer : mlp_only_layers) {
    if (layer < 0 || layer >= num_hidden_layers) {
      return bad_key(source, "mlp_only_layers",
                     fmt::format("lists layer {}, outside [0, num_hidden_layers = {})", layer, num_hidden_layers));
    }
  }
  if (!(router_aux_loss_coef >= 0) || !std::isfinite(router_aux_loss_coef)) {
    return bad_key(source, "router_aux_loss_coef", fmt::format("must be >= 0, got {}", router_aux_loss_coef));
  }
  if (!(router_bias_update_rate >= 0) || !std::isfinite(router_bias_update_rate)) {
    return bad_key(source, "router_bias_update_rate",
                   fmt::format("must be >= 0, got {}", router_bias_update_rate));
  }
  if (first_k_dense_replace < 0) {
    return bad_key(source, "first_k_dense_replace",
                   fmt::format("must not be negative, got {}", first_k_dense_replace));
  }
  RETURN_IF_ERROR(positive(source, "moe_layer_freq", moe_layer_freq));
  if (n_group < 1 || num_experts % n_group != 0) {
    return bad_key(source, "n_group",
                   fmt::format("must divide the {} experts into equal groups, got {}", num_experts, n_group));
  }
  if (topk_group < 1 || topk_group > n_group) {
    return bad_key(source, "topk_group", fmt::format("must be between 1 and n_group ({}), got {}", n_group, topk_group));
  }
  const char* why = nullptr;
  if (!kernels::router_config_ok(router_config(), &why)) {
    return bad_key(source, n_group > 1 ? "topk_group" : "num_experts_per_tok",
                   fmt::format("gives a routing strata cannot compute: {}", why != nullptr ? why : "?"));
  }
  return Status::OK();
}

Status ModelConfig::check_generation() const {
  if (!is_mla()) return Status::OK();
  return Status::Unimplemented(fmt::format(
      "generating from a {} model: its latent attention has no KV cache in strata yet (training and export "
      "work; sample with the model's own code)",
      architecture));
}

Status ModelConfig::check_sequence_length(int64_t seq_len, const std::string& source) const {
  if (sliding_window == 0 || seq_len <= sliding_window) return Status::OK();
  return Status::Unimplemented(fmt::format(
      "{}: key 'sliding_window' is {}, shorter than the sequence length {}; strata implements full "
      "causal attention only, so use sequences of at most {} tokens (or set sliding_window to null)",
      source, sliding_window, seq_len, sliding_window));
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
  if (num_experts <= 0) return false;
  if (is_deepseek()) return layer >= first_k_dense_replace && moe_layer_freq > 0 && layer % moe_layer_freq == 0;
  if (decoder_sparse_step <= 0) return false;
  for (int64_t dense : mlp_only_layers) {
    if (dense == layer) return false;
  }
  return (layer + 1) % decoder_sparse_step == 0;
}

int64_t ModelConfig::num_moe_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_hidden_layers; ++l) n += is_moe_layer(l) ? 1 : 0;
  return n;
}

int64_t ModelConfig::dense_mlp_width() const {
  int64_t width = 0;
  for (int64_t l = 0; l < num_blocks(); ++l) {
    width = std::max(width, is_moe_layer(l) ? shared_expert_intermediate_size : intermediate_size);
  }
  return width;
}

nlohmann::json ModelConfig::to_json() const {
  json j;
  const Architecture* arch = find_architecture(architecture, /*by_model_type=*/false);
  j["architectures"] = json::array({architecture});
  j["model_type"] = arch != nullptr ? arch->model_type : "llama";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  // Written only when it is not the derived hidden_size / num_attention_heads, so that
  // overriding hidden_size or the head count on top of to_json() re-derives it.
  if (head_dim * num_attention_heads != hidden_size || qk_norm) j["head_dim"] = head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope.theta;
  if (rope.scaling == kernels::RopeScaling::kLinear) {
    j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", rope.factor}};
  } else if (rope.scaling == kernels::RopeScaling::kDynamic) {
    // "type": the key every transformers release reads for it (later ones copy it to rope_type;
    // earlier ones refuse any third key).
    j["rope_scaling"] = {{"type", "dynamic"}, {"factor", rope.factor}};
  } else if (rope.scaling == kernels::RopeScaling::kLlama3) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", rope.factor},
                         {"low_freq_factor", rope.low_freq_factor},
                         {"high_freq_factor", rope.high_freq_factor},
                         {"original_max_position_embeddings", rope.original_max_position_embeddings}};
  } else if (rope.scaling == kernels::RopeScaling::kYarn) {
    // What was read, with transformers' defaults for the rest (its validation warns about
    // unknown keys, so only the ones it knows are written).
    j["rope_scaling"] = {{"rope_type", "yarn"},
                         {"factor", rope.factor},
                         {"beta_fast", rope.beta_fast != 0 ? rope.beta_fast : 32.0},
                         {"beta_slow", rope.beta_slow != 0 ? rope.beta_slow : 1.0},
                         {"truncate", rope.truncate}};
    if (rope.original_max_position_embeddings > 0)
      j["rope_scaling"]["original_max_position_embeddings"] = rope.original_max_position_embeddings;
    if (rope.attention_factor != 0) j["rope_scaling"]["attention_factor"] = rope.attention_factor;
    if (rope.mscale != 0) j["rope_scaling"]["mscale"] = rope.mscale;
    if (rope.mscale_all_dim != 0) j["rope_scaling"]["mscale_all_dim"] = rope.mscale_all_dim;
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
  const bool qwen =
      architecture == kQwen2 || architecture == kQwen2Moe || architecture == kQwen3 || architecture == kQwen3Moe;
  if (architecture == kMistral || architecture == kMixtral) {
    j["sliding_window"] = sliding_window > 0 ? json(sliding_window) : json(nullptr);
  } else if (qwen) {
    j["use_sliding_window"] = sliding_window > 0;
    if (sliding_window > 0) j["sliding_window"] = sliding_window;
  }
  if (architecture == kMixtral) {
    j["num_local_experts"] = num_experts;
    j["router_jitter_noise"] = 0.0;
  } else if (architecture == kQwen2Moe || architecture == kQwen3Moe) {
    j["num_experts"] = num_experts;
    j["moe_intermediate_size"] = moe_intermediate_size;
    if (architecture == kQwen2Moe) j["shared_expert_intermediate_size"] = shared_expert_intermediate_size;
    j["norm_topk_prob"] = norm_topk_prob;
    j["decoder_sparse_step"] = decoder_sparse_step;
    j["mlp_only_layers"] = mlp_only_layers;
  }
  if (is_deepseek()) {
    // DeepseekV2Config / DeepseekV3Config keys; head_dim and num_key_value_heads follow from them.
    j.erase("head_dim");
    j["q_lora_rank"] = q_lora_rank > 0 ? json(q_lora_rank) : json(nullptr);
    j["kv_lora_rank"] = kv_lora_rank;
    j["qk_nope_head_dim"] = qk_nope_head_dim;
    j["qk_rope_head_dim"] = qk_rope_head_dim;
    j["v_head_dim"] = v_head_dim;
    j["n_routed_experts"] = num_experts > 0 ? json(num_experts) : json(nullptr);
    j["num_experts_per_tok"] = num_experts > 0 ? json(num_experts_per_tok) : json(nullptr);
    j["moe_intermediate_size"] = moe_intermediate_size;
    j["n_shared_experts"] = num_experts > 0 ? json(deepseek_shared_experts()) : json(nullptr);
    j["first_k_dense_replace"] = first_k_dense_replace;
    j["moe_layer_freq"] = moe_layer_freq;
    j["scoring_func"] = router_scoring == kernels::RouterScoring::kSigmoidThenTopK ? "sigmoid" : "softmax";
    j["topk_method"] = router_selection_bias ? "noaux_tc" : n_group > 1 ? "group_limited_greedy" : "greedy";
    j["n_group"] = n_group;
    j["topk_group"] = topk_group;
    j["norm_topk_prob"] = norm_topk_prob;
    j["routed_scaling_factor"] = routed_scale;
    j["aux_loss_alpha"] = 0.0;
    j["num_nextn_predict_layers"] = num_nextn_predict_layers;
    if (router_bias_update_rate > 0) j["router_bias_update_rate"] = router_bias_update_rate;
    // DeepSeek's YaRN object names its type "type" and keeps the mscales.
    if (rope.scaling == kernels::RopeScaling::kYarn) {
      j["rope_scaling"]["type"] = "yarn";
      j["rope_scaling"].erase("truncate");
    }
  }
  if (architecture == kMixtral || architecture == kQwen2Moe || architecture == kQwen3Moe) {
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["router_aux_loss_coef"] = router_aux_loss_coef;
    j["output_router_logits"] = output_router_logits;
    if (router_bias_update_rate > 0) j["router_bias_update_rate"] = router_bias_update_rate;
  }
  return j;
}

std::optional<int64_t> ModelConfig::count_parameters() const {
  const int64_t C = hidden_size;
  // Every term is a product of bounded keys and is summed with overflow checks, so that an
  // unvalidated config yields nullopt instead of a wrapped count.
  auto sum = [](std::initializer_list<std::optional<int64_t>> terms) -> std::optional<int64_t> {
    std::optional<int64_t> total = 0;
    for (const std::optional<int64_t>& t : terms) total = total && t ? checked_add(*total, *t) : std::nullopt;
    return total;
  };
  const std::optional<int64_t> q = checked_mul(num_attention_heads, head_dim);
  const std::optional<int64_t> kv = checked_mul(num_key_value_heads, head_dim);
  if (!q || !kv) return std::nullopt;
  std::optional<int64_t> attention =
      sum({C,                                          // input_layernorm
           checked_mul(C, *q),                         // q_proj
           checked_product(int64_t{2}, C, *kv),        // k_proj, v_proj
           checked_mul(*q, C),                         // o_proj
           C,                                          // post_attention_layernorm
           attention_bias ? sum({*q, *kv, *kv}) : 0,
           qk_norm ? checked_mul(int64_t{2}, head_dim) : 0});
  if (is_mla()) {
    const int64_t H = num_attention_heads;
    attention = sum({C, C,                                                           // the two norms
                     q_lora_rank > 0 ? sum({checked_mul(q_lora_rank, C), q_lora_rank,  // q_a_proj, q_a_layernorm
                                            checked_mul(*q, q_lora_rank)})           // q_b_proj
                                     : checked_mul(*q, C),                           // q_proj
                     checked_mul(kv_lora_rank + qk_rope_head_dim, C),                // kv_a_proj_with_mqa
                     kv_lora_rank,                                                   // kv_a_layernorm
                     checked_product(H, qk_nope_head_dim + v_head_dim, kv_lora_rank),  // kv_b_proj
                     checked_product(C, H, v_head_dim)});                            // o_proj
  }
  const std::optional<int64_t> dense = checked_product(int64_t{3}, C, intermediate_size);  // gate, up, down
  const std::optional<int64_t> moe =
      sum({checked_mul(num_experts, C),                                              // router
           checked_product(num_experts, int64_t{3}, C, moe_intermediate_size),       // experts
           shared_expert_intermediate_size > 0                                       // shared expert, its gate
               ? sum({checked_product(int64_t{3}, C, shared_expert_intermediate_size), shared_expert_gated ? C : 0})
               : 0});
  const std::optional<int64_t> vocab = checked_mul(vocab_size, C);
  std::optional<int64_t> total = sum({vocab, C, tie_word_embeddings ? 0 : vocab});  // embeddings, final norm
  if (!attention || !dense || !moe) return std::nullopt;
  // The MTP modules: a block each, and enorm, hnorm, eh_proj and shared_head.norm.
  const int64_t blocks = num_hidden_layers + num_nextn_predict_layers;
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < blocks; ++l) moe_layers += is_moe_layer(l) ? 1 : 0;
  return sum({total, checked_mul(blocks, *attention), checked_mul(blocks - moe_layers, *dense),
              checked_mul(moe_layers, *moe),
              // enorm, hnorm, shared_head.norm; eh_proj
              checked_mul(num_nextn_predict_layers, 3 * C), checked_product(num_nextn_predict_layers, int64_t{2}, C, C)});
}

int64_t ModelConfig::num_parameters() const {
  const std::optional<int64_t> n = count_parameters();
  CHECK_MSG(n.has_value(), "num_parameters of an unvalidated model config overflows int64");
  return *n;
}

int64_t ModelConfig::num_tensors() const {
  // norms, q/k/v/o, biases, q/k norms; with latent attention: norms, q (or q_a, its norm, q_b),
  // kv_a, its norm, kv_b, o.
  const int64_t attention = is_mla() ? 2 + (q_lora_rank > 0 ? 3 : 1) + 4
                                     : 6 + (attention_bias ? 3 : 0) + (qk_norm ? 2 : 0);
  const int64_t moe =
      1 + 3 * num_experts + (shared_expert_intermediate_size > 0 ? (shared_expert_gated ? 4 : 3) : 0);
  const int64_t blocks = num_hidden_layers + num_nextn_predict_layers;
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < blocks; ++l) moe_layers += is_moe_layer(l) ? 1 : 0;
  return 2 + (tie_word_embeddings ? 0 : 1) + blocks * attention + (blocks - moe_layers) * 3 + moe_layers * moe +
         num_nextn_predict_layers * 4;
}

}  // namespace strata::model
