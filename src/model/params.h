// Parameter layout: every parameter of a model lives in ONE flat fp32 buffer per kind (params,
// grads, and later master/adam_m/adam_v and chunks), all sharing one ParamLayout. Tensors are
// packed in block order (embeddings, layer 0 ... layer L-1, the MTP modules, final norm, lm_head) at offsets
// aligned to kParamAlignment elements, under their Hugging Face names. Within an MoE layer:
// router, then expert 0 (gate, up, down), expert 1, ..., then the shared expert and its gate.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kernels/moe.h"
#include "model/config.h"

namespace strata::model {

// Offsets are multiples of this many elements (64 bytes of fp32), so every tensor starts on a
// cache line and vector loads stay aligned.
inline constexpr int64_t kParamAlignment = 16;

// What a parameter tensor is for: how it is initialised and whether weight decay applies. (Not a
// kind of training state: those are StateKind, offload/state_layout.h.)
enum class TensorRole : uint8_t {
  kMatrix,      // projections and embeddings: normal(0, 0.02) init, weight decay
  kNormWeight,  // RMSNorm gains: init 1, no weight decay
  kBias,        // projection biases: init 0, no weight decay
  // LoRA factors (model/lora.h), with weight decay: A (r, in) as LoraConfig::init says, B (out, r)
  // zero, so that the adapted model starts as its base.
  kLoraA,
  kLoraAGaussian,
  kLoraB,
};

struct TensorSpec {
  std::string name;            // Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // PyTorch layout, e.g. (out_features, in_features)
  int64_t offset = 0;          // in elements from the start of the flat buffer
  int64_t numel = 0;
  bool weight_decay = false;   // true for 2-D matrices (embeddings included)
  TensorRole kind = TensorRole::kMatrix;
  // Not trained: an MTP module's tensors when training does not compute them
  // (ModelConfig::mtp_loss_weight 0), kept as loaded, and with LoRA every tensor but the
  // adapters. The model computes no gradient for them.
  bool frozen = false;
  // A LoRA factor (TensorRole kLoraA*/kLoraB): the offset of the weight it adapts; else -1.
  int64_t adapts = -1;
  // > 0: the tensor is paged and computed in blocks of this many rows (the last may be
  // shorter): the vocabulary tensors of a model whose embedding dwarfs every other tensor,
  // which would otherwise set a chunk size that pads every other group. 0: one block.
  int64_t block_rows = 0;
  int64_t row_elements() const { return shape.size() == 2 ? shape[1] : numel; }
  int64_t num_blocks() const {
    return block_rows > 0 ? (numel / row_elements() + block_rows - 1) / block_rows : 1;
  }
  // Element range of block b: [block_offset(b), block_offset(b) + block_numel(b)).
  int64_t block_offset(int64_t b) const { return offset + b * block_rows * row_elements(); }
  int64_t block_numel(int64_t b) const {
    return block_rows > 0 ? std::min(block_rows * row_elements(), numel - b * block_rows * row_elements()) : numel;
  }
};

// Element offsets of one MoE block's tensors; empty / -1 in dense layers.
struct MoeOffsets {
  int64_t router = -1;                // (E, C)   mlp.gate / block_sparse_moe.gate
  std::vector<int64_t> expert_gate;   // E x (Fe, C)  gate_proj / w1
  std::vector<int64_t> expert_up;     // E x (Fe, C)  up_proj / w3
  std::vector<int64_t> expert_down;   // E x (C, Fe)  down_proj / w2
  int64_t shared_gate_proj = -1;      // (Fs, C) or -1
  int64_t shared_up_proj = -1;        // (Fs, C)
  int64_t shared_down_proj = -1;      // (C, Fs)
  int64_t shared_expert_gate = -1;    // (1, C), or -1 when the shared expert is ungated (DeepSeek)
};

// Element offsets of one decoder layer's tensors in the flat buffer; -1 for absent tensors
// (biases, q/k norms, and the dense MLP of an MoE layer).
struct LayerOffsets {
  int64_t input_layernorm = -1;
  int64_t q_proj = -1;
  int64_t q_bias = -1;
  int64_t k_proj = -1;
  int64_t k_bias = -1;
  int64_t v_proj = -1;
  int64_t v_bias = -1;
  int64_t o_proj = -1;
  int64_t q_norm = -1;  // (D) Qwen3
  int64_t k_norm = -1;  // (D) Qwen3
  // Multi-head latent attention (ModelConfig::is_mla); q_proj when q_lora_rank is 0.
  int64_t q_a_proj = -1;            // (q_lora_rank, C)
  int64_t q_a_layernorm = -1;       // (q_lora_rank)
  int64_t q_b_proj = -1;            // (Hq*D, q_lora_rank)
  int64_t kv_a_proj = -1;           // (kv_lora_rank + rope dims, C) kv_a_proj_with_mqa
  int64_t kv_a_layernorm = -1;      // (kv_lora_rank)
  int64_t kv_b_proj = -1;           // (Hq*(nope dims + v_head_dim), kv_lora_rank)
  int64_t post_attention_layernorm = -1;
  int64_t gate_proj = -1;
  int64_t up_proj = -1;
  int64_t down_proj = -1;
  MoeOffsets moe;  // MoE layers only
  // A multi-token prediction module's own tensors (ModelConfig::num_nextn_predict_layers), in
  // its block's LayerOffsets: the norms of the embedding and of the previous hidden state, the
  // projection of their concatenation (embedding first), and the norm before the shared LM head.
  int64_t mtp_enorm = -1;      // (C)
  int64_t mtp_hnorm = -1;      // (C)
  int64_t mtp_eh_proj = -1;    // (C, 2C)
  int64_t mtp_head_norm = -1;  // (C) shared_head.norm
};

// Named pointers to one layer's tensors inside a flat buffer. T = const float for parameters,
// float for gradients. Absent biases are null.
template <typename T>
struct LayerTensors {
  T* input_layernorm;           // (C)
  T* q_proj;                    // (Hq*D, C)
  T* q_bias;                    // (Hq*D) or null
  T* k_proj;                    // (Hkv*D, C)
  T* k_bias;                    // (Hkv*D) or null
  T* v_proj;                    // (Hkv*D, C)
  T* v_bias;                    // (Hkv*D) or null
  T* o_proj;                    // (C, Hq*D)
  T* q_norm;                    // (D) or null
  T* k_norm;                    // (D) or null
  T* q_a_proj;                  // latent attention's (LayerOffsets), else null
  T* q_a_layernorm;
  T* q_b_proj;
  T* kv_a_proj;
  T* kv_a_layernorm;
  T* kv_b_proj;
  T* post_attention_layernorm;  // (C)
  T* gate_proj;                 // (F, C) or null in MoE layers
  T* up_proj;                   // (F, C) or null
  T* down_proj;                 // (C, F) or null
  T* mtp_enorm;                 // an MTP module's (LayerOffsets), else null
  T* mtp_hnorm;
  T* mtp_eh_proj;
  T* mtp_head_norm;

  static LayerTensors bind(T* base, const LayerOffsets& o) {
    return bind_with([base](int64_t offset) { return base + offset; }, o);
  }
  // `resolve(offset)` gives the tensor starting at that flat-layout offset (e.g. inside a chunk).
  template <typename Resolve>
  static LayerTensors bind_with(Resolve resolve, const LayerOffsets& o) {
    auto at = [&resolve](int64_t offset) -> T* { return offset < 0 ? nullptr : resolve(offset); };
    return {at(o.input_layernorm), at(o.q_proj),    at(o.q_bias), at(o.k_proj),
            at(o.k_bias),          at(o.v_proj),    at(o.v_bias), at(o.o_proj),
            at(o.q_norm),          at(o.k_norm),    at(o.q_a_proj), at(o.q_a_layernorm),
            at(o.q_b_proj),        at(o.kv_a_proj), at(o.kv_a_layernorm), at(o.kv_b_proj),
            at(o.post_attention_layernorm),
            at(o.gate_proj),       at(o.up_proj),   at(o.down_proj),
            at(o.mtp_enorm),       at(o.mtp_hnorm), at(o.mtp_eh_proj), at(o.mtp_head_norm)};
  }
};
using LayerParams = LayerTensors<const float>;
using LayerGrads = LayerTensors<float>;

// Named pointers to one MoE block's tensors (T as in LayerTensors). Owns its pointer arrays,
// which kernels::ExpertTensors views.
template <typename T>
struct MoeTensors {
  T* router = nullptr;  // (E, C)
  std::vector<T*> expert_gate, expert_up, expert_down;  // E each
  T* shared_gate_proj = nullptr;    // (Fs, C) or null
  T* shared_up_proj = nullptr;      // (Fs, C) or null
  T* shared_down_proj = nullptr;    // (C, Fs) or null
  T* shared_expert_gate = nullptr;  // (1, C) or null

  static MoeTensors bind(T* base, const MoeOffsets& o) {
    return bind_with([base](int64_t offset) { return base + offset; }, o);
  }
  template <typename Resolve>
  static MoeTensors bind_with(Resolve resolve, const MoeOffsets& o) {
    auto at = [&resolve](int64_t offset) -> T* { return offset < 0 ? nullptr : resolve(offset); };
    MoeTensors m;
    m.router = at(o.router);
    for (int64_t off : o.expert_gate) m.expert_gate.push_back(at(off));
    for (int64_t off : o.expert_up) m.expert_up.push_back(at(off));
    for (int64_t off : o.expert_down) m.expert_down.push_back(at(off));
    m.shared_gate_proj = at(o.shared_gate_proj);
    m.shared_up_proj = at(o.shared_up_proj);
    m.shared_down_proj = at(o.shared_down_proj);
    m.shared_expert_gate = at(o.shared_expert_gate);
    return m;
  }
  // View for the kernels; valid while this object lives.
  kernels::ExpertTensors<T> experts() const {
    return {expert_gate.data(), expert_up.data(), expert_down.data()};
  }
};
using MoeParams = MoeTensors<const float>;
using MoeGrads = MoeTensors<float>;

// The LoRA factors of one adapted weight (model/lora.h): A (r, in) and B (out, r).
struct LoraOffsets {
  int64_t a = -1;
  int64_t b = -1;
};

class ParamLayout {
 public:
  ParamLayout() = default;
  // REQUIRES: config.validate(...) is OK.
  explicit ParamLayout(const ModelConfig& config);

  // The model this layout is of.
  const ModelConfig& config() const { return config_; }
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  // Null when no tensor has that name.
  const TensorSpec* find(std::string_view name) const;
  // The tensor starting at element `offset`. REQUIRES: one does.
  const TensorSpec& at(int64_t offset) const;
  // Elements a flat buffer needs (including alignment padding).
  int64_t total_size() const { return total_size_; }
  // Sum of numel over tensors (no padding).
  int64_t num_parameters() const;

  int64_t embed_tokens() const { return embed_tokens_; }  // (V, C)
  // Decoder block i: the model's layers 0 .. L-1, then the MTP modules' blocks.
  const LayerOffsets& layer(int64_t i) const { return layers_[static_cast<size_t>(i)]; }
  // The blocks (ModelConfig::num_blocks()): a paged group each.
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t final_norm() const { return final_norm_; }  // (C)
  // (V, C); equals embed_tokens() when the embeddings are tied.
  int64_t lm_head() const { return lm_head_; }
  // The adapter of the weight starting at `weight_offset`, or null (no LoRA, an untargeted
  // weight, or -1).
  const LoraOffsets* lora_of(int64_t weight_offset) const {
    const auto it = lora_.find(weight_offset);
    return it == lora_.end() ? nullptr : &it->second;
  }
  bool has_lora() const { return !lora_.empty(); }

 private:
  int64_t add(std::string name, std::vector<int64_t> shape, TensorRole kind);
  // Adds the LoRA factors of the weight at `weight` (ModelConfig::lora's rank).
  void add_lora(int64_t weight);

  ModelConfig config_;
  std::vector<TensorSpec> tensors_;
  std::unordered_map<std::string, size_t> index_;
  int64_t total_size_ = 0;
  int64_t embed_tokens_ = -1;
  std::vector<LayerOffsets> layers_;
  int64_t final_norm_ = -1;
  int64_t lm_head_ = -1;
  std::unordered_map<int64_t, LoraOffsets> lora_;
};

// Deterministic, platform-independent init: normal(0, 0.02) for matrices (splitmix64 +
// Box-Muller, one stream per tensor derived from `seed` and the tensor's name), 1 for norm
// weights, 0 for biases and alignment padding. params has layout.total_size() elements.
void init_weights(const ParamLayout& layout, float* params, uint64_t seed);
// The same for one tensor (p holds its t.numel elements): init_weights is this for every tensor.
void init_tensor(const TensorSpec& t, float* p, uint64_t seed);

}  // namespace strata::model
