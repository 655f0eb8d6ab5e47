#include "model/param_access.h"

#include <charconv>
#include <string_view>

namespace strata::model {

int param_group_count(const ParamLayout& layout) { return static_cast<int>(layout.num_layers()) + 2; }

int param_group_of(const ParamLayout& layout, const TensorSpec& tensor) {
  constexpr std::string_view kLayerPrefix = "model.layers.";
  const std::string_view name = tensor.name;
  if (tensor.offset == layout.embed_tokens()) return 0;
  if (name.substr(0, kLayerPrefix.size()) == kLayerPrefix) {
    int layer = -1;  // the digits after the prefix (the planner asks for every tensor of every plan)
    std::from_chars(name.data() + kLayerPrefix.size(), name.data() + name.size(), layer);
    CHECK_MSG(layer >= 0 && layer < layout.num_layers(), "tensor " + tensor.name + " names no layer of the model");
    return 1 + layer;
  }
  return static_cast<int>(layout.num_layers()) + 1;  // final norm, untied LM head
}

int param_expert_of(const ParamLayout& layout, const TensorSpec& tensor) {
  // An expert's adapters are paged, sharded and computed with it.
  if (tensor.adapts >= 0) return param_expert_of(layout, layout.at(tensor.adapts));
  const int group = param_group_of(layout, tensor);
  if (group < 1 || group > layout.num_layers()) return -1;
  const MoeOffsets& moe = layout.layer(group - 1).moe;
  for (size_t e = 0; e < moe.expert_gate.size(); ++e) {
    if (tensor.offset == moe.expert_gate[e] || tensor.offset == moe.expert_up[e] || tensor.offset == moe.expert_down[e])
      return static_cast<int>(e);
  }
  return -1;
}

bool param_is_linear_weight(const ParamLayout& layout, const TensorSpec& tensor) {
  const int group = param_group_of(layout, tensor);
  if (group < 1 || group > layout.num_layers()) return false;
  const LayerOffsets& l = layout.layer(group - 1);
  const int64_t o = tensor.offset;
  if (o == l.q_proj || o == l.k_proj || o == l.v_proj || o == l.o_proj || o == l.gate_proj || o == l.up_proj ||
      o == l.down_proj || o == l.q_a_proj || o == l.q_b_proj || o == l.kv_a_proj || o == l.kv_b_proj ||
      o == l.mtp_eh_proj)
    return true;
  const MoeOffsets& moe = l.moe;
  if (o == moe.shared_gate_proj || o == moe.shared_up_proj || o == moe.shared_down_proj) return true;
  return tensor.adapts < 0 && param_expert_of(layout, tensor) >= 0;  // an expert's weights, not its adapters
}

}  // namespace strata::model
