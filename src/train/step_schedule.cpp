#include "train/step_schedule.h"

namespace strata {

// The model's begin() takes a group's dense part; the experts it fetches after routing (experts[g] of them
// in group g) follow as entries that are not prefetched, since whether an expert gets tokens
// is data dependent, but tell eviction that the experts of a layer whose forward just ran are
// needed again in its backward. `offloaded` checkpoints are offloaded after the layer that
// writes them (the embedding for 0) and fetched before their layer's backward.
// `adam_tier(g)` is where AdamW updates group g, so that the optimizer phase prefetches there.
std::vector<GroupAccess> step_schedule(int num_layers, bool tied, int64_t grad_accum, int offloaded,
                                       const std::vector<int>& experts, const std::function<Tier(int)>& adam_tier,
                                       const std::vector<StateKind>& optimizer_kinds,
                                       const std::function<bool(int, StateKind)>& updates) {
  const int head = num_layers + 1;
  std::vector<GroupAccess> s;
  auto all = [&](int g, StateKind k) { s.push_back({g, k}); };
  auto add = [&](int g, StateKind k) { s.push_back(GroupAccess::of_part(g, k, kDensePart)); };
  auto add_experts = [&](int g, StateKind k) {
    for (int e = 0; e < experts[static_cast<size_t>(g)]; ++e) {
      s.push_back(GroupAccess::of_part(g, k, e));
      s.back().prefetch = false;
    }
  };
  auto act = [&](int i) {
    if (i < offloaded) s.push_back(GroupAccess::of_activation(i));
  };
  for (int g = 0; g <= head; ++g) all(g, StateKind::kGrad);  // zero_grads
  for (int64_t m = 0; m < grad_accum; ++m) {
    add(0, StateKind::kParam);
    act(0);
    for (int l = 0; l < num_layers; ++l) add(1 + l, StateKind::kParam), add_experts(1 + l, StateKind::kParam), act(l + 1);
    if (tied) add(0, StateKind::kParam), add(0, StateKind::kGrad);
    add(head, StateKind::kParam), add(head, StateKind::kGrad);
    for (int l = num_layers - 1; l >= 0; --l) {
      act(l), add(1 + l, StateKind::kParam), add(1 + l, StateKind::kGrad);
      add_experts(1 + l, StateKind::kParam), add_experts(1 + l, StateKind::kGrad);
    }
    add(0, StateKind::kGrad);
  }
  for (int g = 0; g <= head; ++g) all(g, StateKind::kGrad);  // gradient norm
  for (int g = 0; g <= head; ++g) {
    for (StateKind k : optimizer_kinds) {
      if (updates && !updates(g, k)) continue;
      all(g, k);
      s.back().prefetch_to = adam_tier(g);
    }
  }
  return s;
}

}  // namespace strata
