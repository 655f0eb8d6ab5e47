// Low-rank adapters (LoRA, Hu et al. 2021), as PEFT defines them: a targeted linear layer
// y = x W^T computes y = x W^T + (alpha / r) * (dropout(x) A^T) B^T, with A (r, in) and B (out, r)
// trained and W frozen. The adapters are tensors of the model's ParamLayout, named
// `<the weight's module>.lora_A.weight` / `.lora_B.weight` beside the weight they adapt
// (PEFT's names without its `base_model.model.` prefix), in the weight's paged group.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace strata::model {

// Which linear layers carry adapters: PEFT's module names (target_modules).
enum LoraTarget : uint32_t {
  kLoraQ = 1u << 0,        // self_attn.q_proj
  kLoraK = 1u << 1,        // self_attn.k_proj
  kLoraV = 1u << 2,        // self_attn.v_proj
  kLoraO = 1u << 3,        // self_attn.o_proj
  kLoraGate = 1u << 4,     // the dense MLP's gate_proj
  kLoraUp = 1u << 5,       // ... up_proj
  kLoraDown = 1u << 6,     // ... down_proj
  kLoraExperts = 1u << 7,  // the routed experts' three projections (gate_proj/up_proj/down_proj, Mixtral's w1/w3/w2)
};

// How A starts (B always starts at zero, so the adapted model starts as the base).
enum class LoraInit : uint8_t {
  kKaiming,   // PEFT's default: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform_ with a = sqrt(5))
  kGaussian,  // PEFT's "gaussian": A ~ N(0, 1/r)
};

struct LoraConfig {
  int64_t rank = 0;  // r; 0: no adapters (full fine-tuning)
  double alpha = 16;
  double dropout = 0;  // on the adapter's input only, in training steps
  uint32_t targets = kLoraQ | kLoraK | kLoraV | kLoraO | kLoraGate | kLoraUp | kLoraDown;
  LoraInit init = LoraInit::kKaiming;

  bool enabled() const { return rank > 0; }
  // PEFT's scaling: alpha / r.
  float scale() const { return static_cast<float>(alpha / static_cast<double>(rank)); }
  bool targets_any(uint32_t mask) const { return enabled() && (targets & mask) != 0; }

  // The largest rank strata accepts (a rank is far below any layer's width in practice).
  static constexpr int64_t kMaxRank = 4096;
  // Checks the ranges; messages name `source` and the lora.* key.
  Status validate(const std::string& source) const;
  // {"rank", "alpha", "dropout", "targets": [...], "init"}: what a checkpoint records.
  nlohmann::json to_json() const;
  static Result<LoraConfig> from_json(const nlohmann::json& j, const std::string& source);
};

// The target bits of PEFT module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
// down_proj, experts; "all-linear" for all of them), or InvalidArgument naming `source` and the
// unknown name.
Result<uint32_t> parse_lora_targets(const std::vector<std::string>& names, const std::string& source);
// The names of the bits set, in the order above.
std::vector<std::string> lora_target_names(uint32_t targets);
Result<LoraInit> parse_lora_init(const std::string& name, const std::string& source);
const char* lora_init_name(LoraInit init);

}  // namespace strata::model
