#include "model/peft_io.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

#include <fmt/format.h>

#include "ckpt/finite.h"
#include "core/atomic_file.h"
#include "kernels/linear.h"

namespace strata::model {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr std::string_view kPeftPrefix = "base_model.model.";

// Which PEFT keys strata refuses when set, and what each would change.
Status refuse_unsupported(const json& j, const std::string& file) {
  auto set = [&j](const char* key) {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) return false;
    if (it->is_boolean()) return it->get<bool>();
    if (it->is_object() || it->is_array()) return !it->empty();
    if (it->is_string()) return !it->get<std::string>().empty() && it->get<std::string>() != "none";
    return true;
  };
  for (const char* key : {"use_dora", "use_rslora", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
                          "modules_to_save", "layers_to_transform", "layer_replication", "loftq_config"}) {
    if (set(key))
      return Status::Unimplemented(fmt::format(
          "{}: key '{}' is set; strata computes plain LoRA (one rank and alpha for every module, no DoRA or "
          "rsLoRA, every layer, no extra trained modules)",
          file, key));
  }
  if (j.contains("bias") && j["bias"].is_string() && j["bias"].get<std::string>() != "none")
    return Status::Unimplemented(fmt::format("{}: key 'bias' is '{}'; strata trains no biases with LoRA (bias: none)",
                                             file, j["bias"].get<std::string>()));
  return Status::OK();
}

// The regular expression strata writes as target_modules for the modules the layout adapts:
// their full names with the layer and expert numbers as \d+ (a list of module names matches by
// suffix, which in MoE models would also take the experts' or the shared expert's projections of
// the same name).
std::string target_regex(const ParamLayout& layout) {
  static const std::regex kNumber("\\.\\d+\\.");
  std::vector<std::string> modules;
  for (const TensorSpec& t : layout.tensors()) {
    if (t.adapts < 0 || !t.name.ends_with(".lora_A.weight")) continue;
    std::string m = t.name.substr(0, t.name.size() - std::string_view(".lora_A.weight").size());
    m = std::regex_replace(m, kNumber, ".#.");  // twice: a match consumes the dot the next needs
    m = std::regex_replace(m, kNumber, ".#.");
    std::string escaped;
    for (char c : m) escaped += c == '.' ? std::string("\\.") : c == '#' ? std::string("\\d+") : std::string(1, c);
    if (std::find(modules.begin(), modules.end(), escaped) == modules.end()) modules.push_back(escaped);
  }
  return fmt::format("({})", fmt::join(modules, "|"));
}

// PEFT adapts the modules whose whole name matches a string target_modules (re.fullmatch). The
// names below are the adaptable modules of the layouts strata reads (ParamLayout), at a few layer
// and expert numbers: each target whose names the expression matches is adapted. The expressions
// PEFT users write (alternations, groups, \d, .*, character classes) read the same in
// ECMAScript's grammar; open_peft_adapter then checks the tensors the adapter holds.
Result<uint32_t> targets_of_regex(const std::string& expression, const std::string& file) {
  static constexpr std::pair<const char*, uint32_t> kModules[] = {
      {"self_attn.q_proj", kLoraQ}, {"self_attn.k_proj", kLoraK}, {"self_attn.v_proj", kLoraV},
      {"self_attn.o_proj", kLoraO}, {"mlp.gate_proj", kLoraGate}, {"mlp.up_proj", kLoraUp},
      {"mlp.down_proj", kLoraDown},
      // An MoE layer's shared expert (Qwen2-MoE's gated one, DeepSeek's): gate/up/down_proj.
      {"mlp.shared_expert.gate_proj", kLoraGate}, {"mlp.shared_expert.up_proj", kLoraUp},
      {"mlp.shared_expert.down_proj", kLoraDown}, {"mlp.shared_experts.gate_proj", kLoraGate},
      {"mlp.shared_experts.up_proj", kLoraUp}, {"mlp.shared_experts.down_proj", kLoraDown},
      // The routed experts (# is the expert's number), Mixtral's w1/w3/w2 among them.
      {"mlp.experts.#.gate_proj", kLoraExperts}, {"mlp.experts.#.up_proj", kLoraExperts},
      {"mlp.experts.#.down_proj", kLoraExperts}, {"block_sparse_moe.experts.#.w1", kLoraExperts},
      {"block_sparse_moe.experts.#.w2", kLoraExperts}, {"block_sparse_moe.experts.#.w3", kLoraExperts},
  };
  std::regex re;
  try {
    re = std::regex(expression, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return Status::InvalidArgument(fmt::format(
        "{}: key 'target_modules' is the expression '{}', which strata cannot read ({}); write it with "
        "alternations, groups, \\d, .* and character classes, or as a list of module names",
        file, expression, e.what()));
  }
  uint32_t bits = 0;
  for (const auto& [module, bit] : kModules) {
    for (const char* layer : {"0", "1", "10", "31"}) {
      for (const char* expert : {"0", "1", "10"}) {
        std::string name = fmt::format("model.layers.{}.{}", layer, module);
        if (const size_t at = name.find('#'); at != std::string::npos) name.replace(at, 1, expert);
        if (std::regex_match(name, re)) bits |= bit;
      }
    }
  }
  if (bits == 0)
    return Status::InvalidArgument(fmt::format(
        "{}: key 'target_modules' is the expression '{}', which matches none of the modules strata adapts "
        "(model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj, model.layers.N.mlp.gate_proj/up_proj/down_proj, "
        "their shared expert's and routed experts')",
        file, expression));
  return bits;
}

}  // namespace

std::string peft_tensor_name(std::string_view layout_name) {
  return std::string(kPeftPrefix) + std::string(layout_name);
}

Result<LoraConfig> read_peft_adapter_config(const std::string& dir) {
  const std::string file = (fs::path(dir) / kPeftConfigFile).string();
  std::ifstream in(file);
  if (!in)
    return Status::NotFound(fmt::format("{}: cannot be opened; model.adapter names a PEFT adapter directory "
                                        "(adapter_config.json and adapter_model.safetensors)",
                                        file));
  const json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::InvalidArgument(file + ": not a JSON object");
  if (j.value("peft_type", std::string()) != "LORA")
    return Status::Unimplemented(fmt::format("{}: peft_type is '{}'; strata reads LoRA adapters (LORA)", file,
                                             j.value("peft_type", std::string("(missing)"))));
  RETURN_IF_ERROR(refuse_unsupported(j, file));
  LoraConfig c;
  try {
    c.rank = j.at("r").get<int64_t>();
    c.alpha = j.at("lora_alpha").get<double>();
    c.dropout = j.value("lora_dropout", 0.0);
    const json& targets = j.at("target_modules");
    if (targets.is_string() && targets.get<std::string>() != "all-linear") {
      ASSIGN_OR_RETURN(c.targets, targets_of_regex(targets.get<std::string>(), file));
    } else {
      // A list of names, each matching the modules whose name ends with it (Mixtral's experts'
      // w1/w2/w3 among them), or "all-linear".
      std::vector<std::string> names =
          targets.is_string() ? std::vector<std::string>{targets.get<std::string>()} : targets.get<std::vector<std::string>>();
      for (std::string& n : names)
        if (n == "w1" || n == "w2" || n == "w3") n = "experts";
      std::sort(names.begin(), names.end());
      names.erase(std::unique(names.begin(), names.end()), names.end());
      ASSIGN_OR_RETURN(c.targets, parse_lora_targets(names, file));
    }
    const json init = j.value("init_lora_weights", json(true));
    // PiSSA, OLoRA and LoftQ adapters belong to a base changed by their init (W - BA, or
    // quantised): on the original base they would give another model.
    if (init.is_string() && init.get<std::string>() != "gaussian")
      return Status::Unimplemented(fmt::format(
          "{}: init_lora_weights is '{}', an adapter over a base its init changed; strata applies adapters to the "
          "base as it is (true or gaussian)",
          file, init.get<std::string>()));
    c.init = init.is_string() ? LoraInit::kGaussian : LoraInit::kKaiming;
  } catch (const json::exception& e) {
    return Status::InvalidArgument(fmt::format("{}: {}", file, e.what()));
  }
  RETURN_IF_ERROR(c.validate(file));
  return c;
}

Result<SafetensorsReader> open_peft_adapter(const std::string& dir, const ParamLayout& layout) {
  const std::string file = (fs::path(dir) / kPeftWeightsFile).string();
  ASSIGN_OR_RETURN(SafetensorsReader reader, SafetensorsReader::open(file));
  std::set<std::string> expected;
  for (const TensorSpec& t : layout.tensors()) {
    if (t.adapts < 0) continue;
    const std::string name = peft_tensor_name(t.name);
    expected.insert(name);
    const SafetensorsTensorInfo* info = reader.find(name);
    if (info == nullptr)
      return Status::NotFound(fmt::format("{}: tensor '{}' is missing; the adapter does not adapt {} (lora.targets "
                                          "names more modules than the adapter has)",
                                          file, name, layout.at(t.adapts).name));
    if (info->shape != t.shape)
      return Status::InvalidArgument(fmt::format("{}: tensor '{}' has shape [{}], the model and rank expect [{}]", file,
                                                 name, fmt::join(info->shape, ", "), fmt::join(t.shape, ", ")));
    if (!safetensors_dtype_readable(info->dtype))
      return Status::Unimplemented(fmt::format("{}: tensor '{}' has dtype {}", file, name, info->dtype));
  }
  for (const SafetensorsTensorInfo& info : reader.tensors()) {
    if (expected.count(info.name) == 0)
      return Status::InvalidArgument(fmt::format(
          "{}: tensor '{}' is not an adapter of this model (strata adapts {}); is it the adapter of another model?",
          file, info.name, fmt::join(lora_target_names(layout.config().lora.targets), ", ")));
  }
  return reader;
}

Status export_peft_adapter(const std::string& out_dir, const ParamLayout& layout, const TensorReader& read,
                           const PeftExportOptions& options) {
  CHECK_MSG(layout.has_lora(), "export_peft_adapter of a model without adapters");
  const LoraConfig& lora = layout.config().lora;
  const bool moe = layout.config().is_moe();
  json c = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", options.base_model},
      {"r", lora.rank},
      {"lora_alpha", lora.alpha},
      {"lora_dropout", lora.dropout},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", lora.init == LoraInit::kGaussian ? json("gaussian") : json(true)},
      {"use_rslora", false},
      {"use_dora", false},
      {"modules_to_save", nullptr},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"rank_pattern", json::object()},
      {"alpha_pattern", json::object()},
      {"revision", nullptr},
  };
  // A list of module names matches by suffix, which in an MoE model would also take the experts'
  // projections: there the exact names, as a regular expression.
  c["target_modules"] = moe ? json(target_regex(layout)) : json(lora_target_names(lora.targets));
  return write_export_dir(out_dir, kPeftConfigFile, [&](const std::string& tmp) -> Status {
    std::vector<SafetensorsWriteTensor> tensors;
    for (const TensorSpec& t : layout.tensors()) {
      if (t.adapts < 0) continue;
      tensors.push_back({peft_tensor_name(t.name), t.shape, nullptr, [&read, &t](float* out) -> Status {
                           RETURN_IF_ERROR(read(t, out));
                           const uint64_t bad = ckpt::count_non_finite(DType::kF32, out, static_cast<uint64_t>(t.numel));
                           if (bad == 0) return Status::OK();
                           return Status::InvalidArgument(fmt::format(
                               "adapter tensor '{}' holds {} NaN or Inf values of {}: the adapters are of a diverged "
                               "run; export an earlier checkpoint",
                               t.name, bad, t.numel));
                         }});
    }
    WriterOptions wo;
    wo.dtype = options.dtype;
    RETURN_IF_ERROR(write_safetensors_file((fs::path(tmp) / kPeftWeightsFile).string(), tensors, wo));
    return write_file_atomic((fs::path(tmp) / kPeftConfigFile).string(), c.dump(2) + "\n");
  });
}

void merge_lora(float* w, const float* a, const float* b, int64_t out, int64_t in, int64_t r, float scale) {
  // w (out, in) += scale * b (out, r) @ a (r, in)
  kernels::sgemm(false, false, out, in, r, scale, b, r, a, in, 1.0f, w, in);
}

}  // namespace strata::model
