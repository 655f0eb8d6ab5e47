#include "offload/step_program.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <utility>

#include "core/check.h"

namespace strata {

std::vector<ProgramEvent> StepProgram::events(int64_t grad_accum) const {
  std::vector<ProgramEvent> out = zero;
  for (int64_t m = 0; m + 1 < grad_accum; ++m) out.insert(out.end(), micro_batch.begin(), micro_batch.end());
  out.insert(out.end(), last_micro_batch.begin(), last_micro_batch.end());
  out.insert(out.end(), optimizer.begin(), optimizer.end());
  return out;
}

std::vector<GroupAccess> StepProgram::schedule(int64_t grad_accum) const {
  std::vector<GroupAccess> out;
  for (const ProgramEvent& e : events(grad_accum)) out.push_back(e.access);
  return out;
}

namespace {

// Each group's gradients, whole, one group at a time: zeroing writes them, the norm reads them
// (and writes them where the ranks sum them in place first).
void append_grad_pass(int num_groups, AccessMode mode, StepPhase phase, std::vector<ProgramEvent>* out) {
  for (int g = 0; g < num_groups; ++g) {
    out->push_back({GroupAccess{g, StateKind::kGrad}, mode, phase, true});
    // Zeroing overwrites the gradients: there is nothing to bring ahead of it (and a group
    // whose chunks are its own is zeroed by discarding them, StateStore::zero_by_discard).
    if (phase == StepPhase::kZero) out->back().access.prefetch = false;
  }
}

// Whether `a` acquires a group's gradients (its dense part or all of it, not one expert's).
bool acquires_gradients(const GroupAccess& a) {
  return a.activation < 0 && a.kind == StateKind::kGrad && (a.part == kDensePart || a.part == kAllParts);
}

// The ranks' sum of group g's gradients, in place, as the handover's reduction makes it.
void append_reduction(int g, std::vector<ProgramEvent>* out) {
  ProgramEvent e{GroupAccess{g, StateKind::kGrad}, AccessMode::kReadWrite, StepPhase::kNorm, true};
  e.access.cursor = ScheduleCursor::kBeside;
  out->push_back(e);
}

// AdamW on group g: every kind, where the program says, one batch (in host memory, marked to be
// made slice by slice when the program asks).
void append_update(const OptimizerProgram& o, int g, std::vector<ProgramEvent>* out) {
  const Tier where = o.where(g);
  for (StateKind k : o.kinds) {
    ProgramEvent e{GroupAccess{g, k}, AccessMode::kReadWrite, StepPhase::kOptimizer, false};
    e.access.prefetch_to = where;
    e.discard = k == StateKind::kGrad;
    e.overlapped = o.overlapped;
    if (o.slices_host_updates && !o.overlapped && where != Tier::kDevice) e.access.slice = kEachSlice;
    out->push_back(e);
  }
  if (!o.kinds.empty()) out->back().last = true;
}

// `micro_batch` with `handover(g)` appended after the batch that last acquires group g's
// gradients, as the overlapped optimizer or reduction is handed the group (after the micro-batch
// for a group whose gradients it never acquires).
std::vector<ProgramEvent> with_handovers(const std::vector<ProgramEvent>& micro_batch, int num_groups,
                                         const std::function<void(int, std::vector<ProgramEvent>*)>& handover) {
  // Each batch as [first event, closing event]; the closing event of each group's last batch
  // with its gradients (SIZE_MAX: none).
  std::vector<std::pair<size_t, size_t>> batches;
  std::vector<size_t> closes(static_cast<size_t>(num_groups), SIZE_MAX);
  for (size_t i = 0, first = 0; i < micro_batch.size(); ++i) {
    if (!micro_batch[i].last) continue;
    batches.push_back({first, i});
    for (size_t j = first; j <= i; ++j) {
      const GroupAccess& a = micro_batch[j].access;
      if (acquires_gradients(a)) closes.at(static_cast<size_t>(a.group)) = i;
    }
    first = i + 1;
  }
  std::vector<ProgramEvent> out;
  std::vector<bool> placed(static_cast<size_t>(num_groups), false);
  size_t next = 0;  // the first event not yet copied
  for (const auto& [first, close] : batches) {
    for (; next <= close; ++next) out.push_back(micro_batch[next]);
    // The groups this batch is the last to hand over, in the order it acquired them.
    for (size_t j = first; j <= close; ++j) {
      const GroupAccess& a = micro_batch[j].access;
      if (!acquires_gradients(a)) continue;
      const size_t g = static_cast<size_t>(a.group);
      if (closes[g] != close || placed[g]) continue;
      handover(a.group, &out);
      placed[g] = true;
    }
  }
  for (; next < micro_batch.size(); ++next) out.push_back(micro_batch[next]);
  for (int g = 0; g < num_groups; ++g)
    if (!placed[static_cast<size_t>(g)]) handover(g, &out);
  return out;
}

}  // namespace

std::vector<int> gather_order(const std::vector<ProgramEvent>& micro_batch) {
  std::vector<int> order;
  for (const ProgramEvent& e : micro_batch)
    if (e.access.activation < 0 && e.access.kind == StateKind::kParam && e.access.part == kDensePart)
      order.push_back(e.access.group);
  return order;
}

std::vector<bool> kept_gathers(const std::vector<int>& order, int ahead) {
  const size_t most = static_cast<size_t>(std::max(ahead, 1));
  std::vector<bool> kept(order.size(), false);
  std::deque<std::pair<int, bool>> in_place;  // the groups ahead, in order, and whether kept
  for (size_t k = 0; k < order.size(); ++k) {
    const int g = order[k];
    if (!in_place.empty() && in_place.front().first == g) {
      kept[k] = in_place.front().second;
      in_place.pop_front();
    } else {
      in_place.clear();
    }
    auto placed = [&](int group) {
      return group == g || std::any_of(in_place.begin(), in_place.end(), [&](const auto& a) { return a.first == group; });
    };
    for (size_t at = k + 1 + in_place.size(); in_place.size() < most && at < order.size() && !placed(order[at]); ++at)
      in_place.emplace_back(order[at], false);
    const size_t again = k + 1 + in_place.size();
    if (again < order.size() && order[again] == g && in_place.size() <= most) in_place.emplace_back(g, true);
  }
  return kept;
}

std::vector<int> gradient_batches(const std::vector<ProgramEvent>& micro_batch, int num_groups) {
  std::vector<int> batches(static_cast<size_t>(num_groups), 0);
  std::vector<bool> in_batch(static_cast<size_t>(num_groups), false);
  for (const ProgramEvent& e : micro_batch) {
    if (acquires_gradients(e.access)) in_batch.at(static_cast<size_t>(e.access.group)) = true;
    if (!e.last) continue;
    for (size_t g = 0; g < in_batch.size(); ++g) batches[g] += in_batch[g] ? 1 : 0;
    in_batch.assign(in_batch.size(), false);
  }
  return batches;
}

std::vector<ProgramEvent> expand_update_slices(const std::vector<ProgramEvent>& events,
                                               const std::function<int(int group)>& slices) {
  std::vector<ProgramEvent> out;
  for (size_t i = 0; i < events.size();) {
    if (events[i].access.slice != kEachSlice) {
      out.push_back(events[i++]);
      continue;
    }
    // The marked batch: its events up to the one that closes it.
    size_t end = i;
    while (end < events.size() && events[end].access.slice == kEachSlice && !events[end].last) ++end;
    CHECK_MSG(end < events.size() && events[end].access.slice == kEachSlice,
              "an update marked kEachSlice that no marked event closes");
    const int n = slices(events[i].access.group);
    for (int s = 0; s < std::max(n, 1); ++s) {
      for (size_t j = i; j <= end; ++j) {
        ProgramEvent e = events[j];
        e.access.slice = n > 1 ? s : kWholeGroup;
        out.push_back(e);
      }
    }
    i = end + 1;
  }
  return out;
}

StepProgram make_step_program(std::vector<ProgramEvent> micro_batch, const OptimizerProgram& o) {
  StepProgram p;
  append_grad_pass(o.num_groups, AccessMode::kWrite, StepPhase::kZero, &p.zero);
  p.micro_batch = std::move(micro_batch);
  if (o.overlapped) {
    p.last_micro_batch = with_handovers(p.micro_batch, o.num_groups,
                                        [&o](int g, std::vector<ProgramEvent>* out) { append_update(o, g, out); });
    return p;
  }
  const bool at_handover = o.reduces_gradients && o.reduces_at_handover;
  p.last_micro_batch = at_handover ? with_handovers(p.micro_batch, o.num_groups, append_reduction) : p.micro_batch;
  const bool norm_writes = o.reduces_gradients && !at_handover;
  append_grad_pass(o.num_groups, norm_writes ? AccessMode::kReadWrite : AccessMode::kRead, StepPhase::kNorm,
                   &p.optimizer);
  for (int g = 0; g < o.num_groups; ++g) append_update(o, g, &p.optimizer);
  return p;
}

}  // namespace strata
