#include "model/lora.h"

#include <cmath>
#include <utility>

#include <fmt/format.h>

namespace strata::model {
namespace {

constexpr std::pair<const char*, uint32_t> kTargetNames[] = {
    {"q_proj", kLoraQ},       {"k_proj", kLoraK}, {"v_proj", kLoraV},     {"o_proj", kLoraO},
    {"gate_proj", kLoraGate}, {"up_proj", kLoraUp}, {"down_proj", kLoraDown}, {"experts", kLoraExperts},
};

}  // namespace

Result<uint32_t> parse_lora_targets(const std::vector<std::string>& names, const std::string& source) {
  uint32_t bits = 0;
  for (const std::string& name : names) {
    if (name == "all-linear") {
      // The attention and dense MLP projections (the routed experts are named apart).
      for (const auto& [n, bit] : kTargetNames) bits |= bit == kLoraExperts ? 0u : bit;
      continue;
    }
    bool known = false;
    for (const auto& [n, bit] : kTargetNames) {
      if (name == n) bits |= bit, known = true;
    }
    if (!known)
      return Status::InvalidArgument(fmt::format(
          "{}: key 'lora.targets': unknown module '{}'; strata adapts q_proj, k_proj, v_proj, o_proj, gate_proj, "
          "up_proj, down_proj and experts (the routed experts' projections), or all-linear",
          source, name));
  }
  if (bits == 0)
    return Status::InvalidArgument(source + ": key 'lora.targets' names no module; name at least one, e.g. "
                                            "[q_proj, v_proj]");
  return bits;
}

std::vector<std::string> lora_target_names(uint32_t targets) {
  std::vector<std::string> out;
  for (const auto& [n, bit] : kTargetNames)
    if (targets & bit) out.emplace_back(n);
  return out;
}

Result<LoraInit> parse_lora_init(const std::string& name, const std::string& source) {
  if (name == "kaiming" || name == "default") return LoraInit::kKaiming;
  if (name == "gaussian") return LoraInit::kGaussian;
  return Status::InvalidArgument(fmt::format("{}: key 'lora.init': expected kaiming (PEFT's default) or gaussian, got '{}'",
                                             source, name));
}

const char* lora_init_name(LoraInit init) { return init == LoraInit::kGaussian ? "gaussian" : "kaiming"; }

Status LoraConfig::validate(const std::string& source) const {
  if (rank < 0 || rank > kMaxRank)
    return Status::InvalidArgument(
        fmt::format("{}: key 'lora.rank' must be in [1, {}], got {}", source, kMaxRank, rank));
  if (!enabled()) return Status::OK();
  if (!(alpha > 0) || !std::isfinite(alpha))
    return Status::InvalidArgument(fmt::format("{}: key 'lora.alpha' must be finite and positive, got {}", source, alpha));
  if (!(dropout >= 0 && dropout < 1))
    return Status::InvalidArgument(fmt::format("{}: key 'lora.dropout' must be in [0, 1), got {}", source, dropout));
  if (targets == 0) return Status::InvalidArgument(source + ": key 'lora.targets' names no module");
  return Status::OK();
}

nlohmann::json LoraConfig::to_json() const {
  return {{"rank", rank},
          {"alpha", alpha},
          {"dropout", dropout},
          {"targets", lora_target_names(targets)},
          {"init", lora_init_name(init)}};
}

Result<LoraConfig> LoraConfig::from_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) return Status::InvalidArgument(source + ": 'lora' is not an object");
  LoraConfig c;
  try {
    c.rank = j.at("rank").get<int64_t>();
    c.alpha = j.at("alpha").get<double>();
    c.dropout = j.at("dropout").get<double>();
    ASSIGN_OR_RETURN(c.targets, parse_lora_targets(j.at("targets").get<std::vector<std::string>>(), source));
    ASSIGN_OR_RETURN(c.init, parse_lora_init(j.at("init").get<std::string>(), source));
  } catch (const nlohmann::json::exception& e) {
    return Status::InvalidArgument(fmt::format("{}: 'lora' is malformed: {}", source, e.what()));
  }
  RETURN_IF_ERROR(c.validate(source));
  return c;
}

}  // namespace strata::model
