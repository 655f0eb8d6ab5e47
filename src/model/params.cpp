#include "model/params.h"

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "core/checked_math.h"

namespace strata::model {
namespace {

constexpr double kInitStd = 0.02;

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;

uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += kGamma);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// FNV-1a, so that a tensor's init depends on its name, not on its position in the layout.
uint64_t hash_name(std::string_view name) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001B3ull;
  }
  return h;
}

// Uniform in (0, 1]: never 0, so that log() in Box-Muller stays finite.
double uniform_open(uint64_t* state) {
  return (static_cast<double>(splitmix64(state) >> 11) + 1.0) * 0x1.0p-53;
}

// splitmix64 is a counter: its k-th draw depends on seed + k * kGamma alone, so each pair of
// values (Box-Muller's draws 2j and 2j + 1) can start on its own and the threads fill a large
// tensor with the bits one thread would (a 3.6B model's 13 GiB took 100 s on one core).
void fill_normal(float* out, int64_t n, double stddev, uint64_t seed) {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  const int64_t pairs = (n + 1) / 2;
#pragma omp parallel for schedule(static) if (pairs >= (int64_t{1} << 16))
  for (int64_t j = 0; j < pairs; ++j) {
    uint64_t state = seed + static_cast<uint64_t>(2 * j) * kGamma;
    const double radius = std::sqrt(-2.0 * std::log(uniform_open(&state)));
    const double angle = kTwoPi * uniform_open(&state);
    out[2 * j] = static_cast<float>(stddev * radius * std::cos(angle));
    if (2 * j + 1 < n) out[2 * j + 1] = static_cast<float>(stddev * radius * std::sin(angle));
  }
}

// Uniform in [-bound, bound), one counter draw per element (as fill_normal, thread-independent).
void fill_uniform(float* out, int64_t n, double bound, uint64_t seed) {
#pragma omp parallel for schedule(static) if (n >= (int64_t{1} << 16))
  for (int64_t i = 0; i < n; ++i) {
    uint64_t state = seed + static_cast<uint64_t>(i) * kGamma;
    const double u = static_cast<double>(splitmix64(&state) >> 11) * 0x1.0p-53;  // [0, 1)
    out[i] = static_cast<float>((2.0 * u - 1.0) * bound);
  }
}

}  // namespace

ParamLayout::ParamLayout(const ModelConfig& config) : config_(config) {
  const int64_t V = config.vocab_size;
  const int64_t C = config.hidden_size;
  const int64_t F = config.intermediate_size;
  const int64_t q_dim = config.q_dim();
  const int64_t kv_dim = config.kv_dim();
  const int64_t D = config.head_dim;
  const int64_t E = config.num_experts;
  const int64_t Fe = config.moe_intermediate_size;
  const int64_t Fs = config.shared_expert_intermediate_size;

  embed_tokens_ = add("model.embed_tokens.weight", {V, C}, TensorRole::kMatrix);
  for (int64_t i = 0; i < config.num_blocks(); ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    LayerOffsets o;
    const bool mtp = config.is_mtp_block(i);
    if (mtp) {
      o.mtp_enorm = add(p + "enorm.weight", {C}, TensorRole::kNormWeight);
      o.mtp_hnorm = add(p + "hnorm.weight", {C}, TensorRole::kNormWeight);
      o.mtp_eh_proj = add(p + "eh_proj.weight", {C, 2 * C}, TensorRole::kMatrix);
    }
    o.input_layernorm = add(p + "input_layernorm.weight", {C}, TensorRole::kNormWeight);
    if (config.is_mla()) {
      // DeepSeek's order: q (or its low-rank pair and their norm), the compressed kv with the
      // shared RoPE key, its norm, the per-head keys and values, o.
      const std::string a = p + "self_attn.";
      const int64_t Rq = config.q_lora_rank, Rkv = config.kv_lora_rank;
      if (Rq > 0) {
        o.q_a_proj = add(a + "q_a_proj.weight", {Rq, C}, TensorRole::kMatrix);
        o.q_a_layernorm = add(a + "q_a_layernorm.weight", {Rq}, TensorRole::kNormWeight);
        o.q_b_proj = add(a + "q_b_proj.weight", {q_dim, Rq}, TensorRole::kMatrix);
      } else {
        o.q_proj = add(a + "q_proj.weight", {q_dim, C}, TensorRole::kMatrix);
      }
      o.kv_a_proj = add(a + "kv_a_proj_with_mqa.weight", {Rkv + config.qk_rope_head_dim, C}, TensorRole::kMatrix);
      o.kv_a_layernorm = add(a + "kv_a_layernorm.weight", {Rkv}, TensorRole::kNormWeight);
      o.kv_b_proj = add(a + "kv_b_proj.weight",
                        {config.num_attention_heads * (config.qk_nope_head_dim + config.v_head_dim), Rkv},
                        TensorRole::kMatrix);
      o.o_proj = add(a + "o_proj.weight", {C, config.att_dim()}, TensorRole::kMatrix);
    } else {
    o.q_proj = add(p + "self_attn.q_proj.weight", {q_dim, C}, TensorRole::kMatrix);
    if (config.attention_bias) o.q_bias = add(p + "self_attn.q_proj.bias", {q_dim}, TensorRole::kBias);
    o.k_proj = add(p + "self_attn.k_proj.weight", {kv_dim, C}, TensorRole::kMatrix);
    if (config.attention_bias) o.k_bias = add(p + "self_attn.k_proj.bias", {kv_dim}, TensorRole::kBias);
    o.v_proj = add(p + "self_attn.v_proj.weight", {kv_dim, C}, TensorRole::kMatrix);
    if (config.attention_bias) o.v_bias = add(p + "self_attn.v_proj.bias", {kv_dim}, TensorRole::kBias);
    o.o_proj = add(p + "self_attn.o_proj.weight", {C, q_dim}, TensorRole::kMatrix);
    if (config.qk_norm) {
      o.q_norm = add(p + "self_attn.q_norm.weight", {D}, TensorRole::kNormWeight);
      o.k_norm = add(p + "self_attn.k_norm.weight", {D}, TensorRole::kNormWeight);
    }
    }
    o.post_attention_layernorm = add(p + "post_attention_layernorm.weight", {C}, TensorRole::kNormWeight);
    if (!config.is_moe_layer(i)) {
      o.gate_proj = add(p + "mlp.gate_proj.weight", {F, C}, TensorRole::kMatrix);
      o.up_proj = add(p + "mlp.up_proj.weight", {F, C}, TensorRole::kMatrix);
      o.down_proj = add(p + "mlp.down_proj.weight", {C, F}, TensorRole::kMatrix);
    } else if (config.uses_mixtral_tensor_names()) {
      // Mixtral: w1 = gate, w3 = up, w2 = down.
      const std::string m = p + "block_sparse_moe.";
      o.moe.router = add(m + "gate.weight", {E, C}, TensorRole::kMatrix);
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = fmt::format("{}experts.{}.", m, e);
        o.moe.expert_gate.push_back(add(x + "w1.weight", {Fe, C}, TensorRole::kMatrix));
        o.moe.expert_down.push_back(add(x + "w2.weight", {C, Fe}, TensorRole::kMatrix));
        o.moe.expert_up.push_back(add(x + "w3.weight", {Fe, C}, TensorRole::kMatrix));
      }
    } else {
      const std::string m = p + "mlp.";
      o.moe.router = add(m + "gate.weight", {E, C}, TensorRole::kMatrix);
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = fmt::format("{}experts.{}.", m, e);
        o.moe.expert_gate.push_back(add(x + "gate_proj.weight", {Fe, C}, TensorRole::kMatrix));
        o.moe.expert_up.push_back(add(x + "up_proj.weight", {Fe, C}, TensorRole::kMatrix));
        o.moe.expert_down.push_back(add(x + "down_proj.weight", {C, Fe}, TensorRole::kMatrix));
      }
      if (Fs > 0) {
        // Qwen2-MoE's gated shared_expert; DeepSeek's ungated shared_experts.
        const std::string x = m + (config.shared_expert_gated ? "shared_expert." : "shared_experts.");
        o.moe.shared_gate_proj = add(x + "gate_proj.weight", {Fs, C}, TensorRole::kMatrix);
        o.moe.shared_up_proj = add(x + "up_proj.weight", {Fs, C}, TensorRole::kMatrix);
        o.moe.shared_down_proj = add(x + "down_proj.weight", {C, Fs}, TensorRole::kMatrix);
        if (config.shared_expert_gated)
          o.moe.shared_expert_gate = add(m + "shared_expert_gate.weight", {1, C}, TensorRole::kMatrix);
      }
    }
    if (mtp) o.mtp_head_norm = add(p + "shared_head.norm.weight", {C}, TensorRole::kNormWeight);
    // The layer's adapters follow its tensors, in its group.
    const LoraConfig& lora = config.lora;
    for (const auto& [bit, weight] : {std::pair{kLoraQ, o.q_proj}, {kLoraK, o.k_proj}, {kLoraV, o.v_proj},
                                      {kLoraO, o.o_proj}, {kLoraGate, o.gate_proj}, {kLoraUp, o.up_proj},
                                      {kLoraDown, o.down_proj}}) {
      if (weight >= 0 && lora.targets_any(bit)) add_lora(weight);
    }
    // In an MoE layer the MLP's targets are the shared expert's projections, and `experts` those
    // of every routed expert.
    for (const auto& [bit, weight] : {std::pair{kLoraGate, o.moe.shared_gate_proj}, {kLoraUp, o.moe.shared_up_proj},
                                      {kLoraDown, o.moe.shared_down_proj}}) {
      if (weight >= 0 && lora.targets_any(bit)) add_lora(weight);
    }
    if (lora.targets_any(kLoraExperts)) {
      for (size_t e = 0; e < o.moe.expert_gate.size(); ++e) {
        for (int64_t weight : {o.moe.expert_gate[e], o.moe.expert_up[e], o.moe.expert_down[e]}) add_lora(weight);
      }
    }
    layers_.push_back(o);
  }
  // An MTP module training does not compute keeps its tensors as loaded.
  if (!config.trains_mtp()) {
    for (TensorSpec& t : tensors_) {
      int layer = -1;
      if (std::sscanf(t.name.c_str(), "model.layers.%d.", &layer) == 1 && config.is_mtp_block(layer)) t.frozen = true;
    }
  }
  final_norm_ = add("model.norm.weight", {C}, TensorRole::kNormWeight);
  lm_head_ = config.tie_word_embeddings ? embed_tokens_
                                        : add("lm_head.weight", {V, C}, TensorRole::kMatrix);
  // With LoRA only the adapters train.
  if (config.lora.enabled()) {
    for (TensorSpec& t : tensors_) t.frozen = t.frozen || t.adapts < 0;
  }
  // Vocabulary tensors larger than every other tensor go in row blocks about the size of the
  // largest other one (whole multiples of kParamAlignment rows).
  int64_t largest_other = 0;
  for (const TensorSpec& t : tensors_)
    if (t.offset != embed_tokens_ && t.offset != lm_head_) largest_other = std::max(largest_other, t.numel);
  const int64_t rows = largest_other / C / kParamAlignment * kParamAlignment;
  if (rows > 0 && rows < V) {
    for (TensorSpec& t : tensors_)
      if (t.offset == embed_tokens_ || t.offset == lm_head_) t.block_rows = rows;
  }
}

void ParamLayout::add_lora(int64_t weight) {
  const TensorSpec w = at(weight);  // a copy: add() grows tensors_
  constexpr std::string_view kSuffix = ".weight";
  CHECK_MSG(w.shape.size() == 2 && w.name.ends_with(kSuffix), "LoRA on tensor " + w.name + ", not a linear weight");
  const std::string module = w.name.substr(0, w.name.size() - kSuffix.size());
  const int64_t r = config_.lora.rank;
  const TensorRole a_role = config_.lora.init == LoraInit::kGaussian ? TensorRole::kLoraAGaussian : TensorRole::kLoraA;
  LoraOffsets lo;
  lo.a = add(module + ".lora_A.weight", {r, w.shape[1]}, a_role);
  lo.b = add(module + ".lora_B.weight", {w.shape[0], r}, TensorRole::kLoraB);
  for (int64_t o : {lo.a, lo.b}) {
    TensorSpec& t = tensors_[index_.at(at(o).name)];
    t.adapts = weight;
    t.weight_decay = true;
  }
  lora_.emplace(weight, lo);
}

const TensorSpec& ParamLayout::at(int64_t offset) const {
  // Tensors are added at increasing offsets.
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), offset,
                             [](const TensorSpec& t, int64_t o) { return t.offset < o; });
  CHECK_MSG(it != tensors_.end() && it->offset == offset, "no tensor starts at offset " + std::to_string(offset));
  return *it;
}

int64_t ParamLayout::add(std::string name, std::vector<int64_t> shape, TensorRole kind) {
  // Overflow is impossible for a validated config (ModelLimits); an unvalidated one stops here
  // instead of wrapping into a small, wrong layout.
  TensorSpec spec;
  spec.numel = 1;
  for (int64_t d : shape) {
    CHECK_MSG(d >= 0, "negative dimension in tensor " + name + "; validate the model config first");
    const std::optional<int64_t> n = checked_mul(spec.numel, d);
    CHECK_MSG(n.has_value(), "size of tensor " + name + " overflows int64; validate the model config first");
    spec.numel = *n;
  }
  const std::optional<int64_t> padded = checked_add(spec.numel, kParamAlignment - 1);
  const std::optional<int64_t> end =
      padded ? checked_add(total_size_, *padded / kParamAlignment * kParamAlignment) : std::nullopt;
  CHECK_MSG(end.has_value(), "parameter layout overflows int64 at tensor " + name + "; validate the model config first");
  spec.offset = total_size_;
  spec.kind = kind;
  spec.weight_decay = kind == TensorRole::kMatrix;
  spec.name = std::move(name);
  spec.shape = std::move(shape);
  total_size_ = *end;
  CHECK_MSG(index_.emplace(spec.name, tensors_.size()).second, "duplicate tensor " + spec.name);
  tensors_.push_back(spec);
  return tensors_.back().offset;
}

const TensorSpec* ParamLayout::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

int64_t ParamLayout::num_parameters() const {
  int64_t n = 0;
  for (const auto& t : tensors_) n += t.numel;  // <= total_size_, which add() checked
  return n;
}

void init_tensor(const TensorSpec& t, float* p, uint64_t seed) {
  switch (t.kind) {
    case TensorRole::kMatrix: {
      uint64_t stream = seed ^ hash_name(t.name);
      fill_normal(p, t.numel, kInitStd, splitmix64(&stream));
      break;
    }
    case TensorRole::kNormWeight:
      std::fill(p, p + t.numel, 1.0f);
      break;
    case TensorRole::kBias:
    case TensorRole::kLoraB:
      std::fill(p, p + t.numel, 0.0f);
      break;
    case TensorRole::kLoraA: {
      // kaiming_uniform_(a = sqrt(5)) over fan_in = in: bound = sqrt(6 / ((1 + 5) * in)).
      uint64_t stream = seed ^ hash_name(t.name);
      fill_uniform(p, t.numel, 1.0 / std::sqrt(static_cast<double>(t.shape[1])), splitmix64(&stream));
      break;
    }
    case TensorRole::kLoraAGaussian: {
      uint64_t stream = seed ^ hash_name(t.name);
      fill_normal(p, t.numel, 1.0 / static_cast<double>(t.shape[0]), splitmix64(&stream));
      break;
    }
  }
}

void init_weights(const ParamLayout& layout, float* params, uint64_t seed) {
  std::fill(params, params + layout.total_size(), 0.0f);
  for (const auto& t : layout.tensors()) init_tensor(t, params + t.offset, seed);
}

}  // namespace strata::model
