#include "offload/step_program.h"

namespace strata {

std::vector<ProgramEvent> StepProgram::events(int64_t grad_accum) const {
  std::vector<ProgramEvent> out = zero;
  for (int64_t m = 0; m < grad_accum; ++m) out.insert(out.end(), micro_batch.begin(), micro_batch.end());
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
  for (int g = 0; g < num_groups; ++g) out->push_back({GroupAccess{g, StateKind::kGrad}, mode, phase, true});
}

}  // namespace

StepProgram make_step_program(std::vector<ProgramEvent> micro_batch, const OptimizerProgram& o) {
  StepProgram p;
  append_grad_pass(o.num_groups, AccessMode::kWrite, StepPhase::kZero, &p.zero);
  p.micro_batch = std::move(micro_batch);
  append_grad_pass(o.num_groups, o.reduces_gradients ? AccessMode::kReadWrite : AccessMode::kRead, StepPhase::kNorm,
                   &p.optimizer);
  for (int g = 0; g < o.num_groups; ++g) {
    const std::vector<StateKind>& kinds = o.kinds;
    for (StateKind k : kinds) {
      ProgramEvent e{GroupAccess{g, k}, AccessMode::kReadWrite, StepPhase::kOptimizer, false};
      e.access.prefetch_to = o.where(g);
      p.optimizer.push_back(e);
    }
    if (!kinds.empty()) p.optimizer.back().last = true;
  }
  return p;
}

}  // namespace strata
