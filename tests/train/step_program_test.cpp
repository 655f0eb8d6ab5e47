// The step program (offload/step_program.h): the model's part recorded from the decoder
// (model/recording_access.h) and the optimizer's passes, against the order the chunk store
// followed when it was written down by hand, kept here as the test's statement of the order, for
// every kind of model and step the paging tests train: dense, tied, MoE with dense layers
// between, offloaded activations, several micro-batches, AdamW on the device for some groups and
// on the host for others, and a data-parallel rank, whose norm pass sums the gradients in place. A
// change to the order in which the decoder or the optimizer acquires state fails here until the
// expected order below says the same.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/cpu_device.h"
#include "model/param_access.h"
#include "model/params.h"
#include "model/recording_access.h"
#include "offload/step_program.h"
#include "train/paged_state.h"
#include "train/train_test_util.h"

namespace strata {
namespace {

// The expected order: num_layers decoder layers; tied embeddings (the head reads group 0);
// grad_accum micro-batches; `offloaded` saved activations; experts[g]: the experts of group g (0
// for dense groups), not prefetched; adam_tier(g): where AdamW updates group g; kinds: the state
// kinds AdamW acquires.
// overlapped: AdamW overlapped with backward, each group updated (its kinds acquired on the
// cursor by the compute thread) after the last micro-batch's last batch with its gradients, and
// no norm pass.
// slices(g): the update slices of group g, when AdamW in host memory goes slice by slice (null:
// every group whole).
std::vector<GroupAccess> expected_schedule(int num_layers, bool tied, int64_t grad_accum, int offloaded,
                                           const std::vector<int>& experts, const std::function<Tier(int)>& adam_tier,
                                           const std::vector<StateKind>& kinds, bool overlapped = false,
                                           const std::function<int(int)>& slices = nullptr) {
  const int head = num_layers + 1;
  std::vector<GroupAccess> s;
  auto all = [&](int g, StateKind k) { s.push_back({g, k}); };
  auto update = [&](int g) {
    const int n = slices && adam_tier(g) == Tier::kHost ? slices(g) : 1;
    for (int slice = 0; slice < n; ++slice) {
      for (StateKind k : kinds) {
        all(g, k);
        s.back().prefetch_to = adam_tier(g);
        if (n > 1) s.back().slice = slice;
      }
    }
  };
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
  for (int g = 0; g <= head; ++g) {
    all(g, StateKind::kGrad);  // zeroing: nothing to prefetch for it
    s.back().prefetch = false;
  }
  for (int64_t m = 0; m < grad_accum; ++m) {
    const bool updates = overlapped && m == grad_accum - 1;
    add(0, StateKind::kParam);
    act(0);
    for (int l = 0; l < num_layers; ++l) add(1 + l, StateKind::kParam), add_experts(1 + l, StateKind::kParam), act(l + 1);
    if (tied) add(0, StateKind::kParam), add(0, StateKind::kGrad);
    add(head, StateKind::kParam), add(head, StateKind::kGrad);
    if (updates) update(head);
    for (int l = num_layers - 1; l >= 0; --l) {
      act(l), add(1 + l, StateKind::kParam), add(1 + l, StateKind::kGrad);
      add_experts(1 + l, StateKind::kParam), add_experts(1 + l, StateKind::kGrad);
      if (updates) update(1 + l);
    }
    add(0, StateKind::kGrad);
    if (updates) update(0);
  }
  if (overlapped) return s;
  for (int g = 0; g <= head; ++g) all(g, StateKind::kGrad);  // the norm
  for (int g = 0; g <= head; ++g) update(g);
  return s;
}

std::vector<int> experts_per_group(const model::ParamLayout& layout) {
  std::vector<int> experts(static_cast<size_t>(layout.num_layers()) + 2, 0);
  for (const auto& t : layout.tensors()) {
    int& count = experts[static_cast<size_t>(model::param_group_of(layout, t))];
    count = std::max(count, model::param_expert_of(layout, t) + 1);
  }
  return experts;
}

std::string describe(const GroupAccess& a) {
  return fmt::format("{{group {} kind {} act {} part {} slice {} to {} prefetch {} beside {}}}", a.group,
                     static_cast<int>(a.kind), a.activation, a.part, a.slice, static_cast<int>(a.prefetch_to),
                     a.prefetch, a.cursor == ScheduleCursor::kBeside);
}

// Equal in every field, those operator== leaves out (where prefetch moves, whether it does) too.
void expect_same_schedule(const std::vector<GroupAccess>& got, const std::vector<GroupAccess>& want,
                          const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool same = got[i] == want[i] && got[i].prefetch_to == want[i].prefetch_to &&
                      got[i].prefetch == want[i].prefetch && got[i].cursor == want[i].cursor;
    EXPECT_TRUE(same) << what << ": entry " << i << " is " << describe(got[i]) << ", expected "
                      << describe(want[i]);
    if (!same) return;
  }
}

model::ModelConfig moe_config() {
  model::ModelConfig mc = fp8_moe_config();  // 8 experts, a shared expert, layer 1 dense
  mc.hidden_size = 32;
  mc.intermediate_size = 48;
  mc.moe_intermediate_size = 16;
  mc.shared_expert_intermediate_size = 24;
  mc.head_dim = 8;
  mc.num_hidden_layers = 4;
  return mc;
}

struct Config {
  const char* name;
  model::ModelConfig model;
  bool offload = false;
  int64_t grad_accum = 1;
  bool data_parallel = false;  // a data-parallel rank
};

// Overlapped ZeRO-3's weights kept from a batch to the group's next (kept_gathers): the last
// layer around an untied head with one group gathered ahead; around a tied head (the embedding
// between too) with two; with three also the tied embedding from its forward to the head. No
// layer before the last: its window holds a repeat.
TEST(StepProgram, GathersKeptFromABatchToTheNext) {
  const std::vector<int> untied = {0, 1, 2, 3, 4, 3, 2, 1}, tied = {0, 1, 2, 3, 0, 4, 3, 2, 1};
  auto kept_at = [](const std::vector<int>& order, int ahead) {
    std::vector<size_t> at;
    const std::vector<bool> kept = kept_gathers(order, ahead);
    for (size_t k = 0; k < kept.size(); ++k)
      if (kept[k]) at.push_back(k);
    return at;
  };
  EXPECT_EQ(kept_at(untied, 1), std::vector<size_t>{5});
  EXPECT_EQ(kept_at(untied, 3), std::vector<size_t>{5});
  EXPECT_EQ(kept_at(tied, 1), std::vector<size_t>{});
  EXPECT_EQ(kept_at(tied, 2), std::vector<size_t>{6});
  EXPECT_EQ(kept_at(tied, 3), (std::vector<size_t>{4, 6}));
  // The recorded program's order is the one above.
  model::ModelConfig mc = tiny_config(false);
  EXPECT_EQ(gather_order(model::record_micro_batch(mc, false)), untied);
  mc.tie_word_embeddings = true;
  EXPECT_EQ(gather_order(model::record_micro_batch(mc, false)), tied);
}

TEST(StepProgram, TheRecordedProgramIsTheExpectedOrder) {
  model::ModelConfig deep = tiny_config(false);
  deep.num_hidden_layers = 6;
  const Config configs[] = {
      {"dense", tiny_config(false)},
      {"tied", tiny_config(true)},
      {"dense, 3 micro-batches", tiny_config(false), false, 3},
      {"offloaded activations", deep, true, 2},
      {"moe", moe_config(), false, 2},
      {"moe, offloaded activations", moe_config(), true, 1},
      {"data-parallel rank", tiny_config(true), false, 2, true},
      {"moe data-parallel rank", moe_config(), true, 2, true},
  };
  for (const Config& c : configs) {
    const model::ParamLayout layout(c.model);
    const int L = static_cast<int>(layout.num_layers());
    const int groups = L + 2;
    const std::vector<int> experts = experts_per_group(layout);
    // AdamW on the device for every third group, on the host for the others.
    auto where = [](int g) { return g % 3 == 0 ? Tier::kDevice : Tier::kHost; };
    for (Precision precision : {Precision::kFp32, Precision::kBf16}) {
      const std::vector<StateKind> kinds = StateLayout::of(precision).kinds();
      const int offloaded = c.offload ? model::saved_activation_count(L) : 0;
      const std::vector<GroupAccess> want =
          expected_schedule(L, c.model.tie_word_embeddings, c.grad_accum, offloaded, experts, where, kinds);
      const StepProgram program = make_step_program(model::record_micro_batch(c.model, c.offload),
                                                    {groups, kinds, where, c.data_parallel});
      const std::string what = fmt::format("{} ({})", c.name, precision == Precision::kFp32 ? "fp32" : "bf16");
      expect_same_schedule(program.schedule(c.grad_accum), want, what);
      // The norm pass reads the gradients, or with ranks sums them in place first.
      int norm = 0;
      for (const ProgramEvent& e : program.optimizer) {
        if (e.phase != StepPhase::kNorm) continue;
        ++norm;
        EXPECT_EQ(e.mode, c.data_parallel ? AccessMode::kReadWrite : AccessMode::kRead) << what;
      }
      EXPECT_EQ(norm, groups) << what;
      // Overlapped with backward: the updates inside the last micro-batch.
      const OptimizerProgram overlapped{groups, kinds, where, false, /*overlapped=*/true};
      const StepProgram program_overlapped =
          make_step_program(model::record_micro_batch(c.model, c.offload), overlapped);
      expect_same_schedule(program_overlapped.schedule(c.grad_accum),
                           expected_schedule(L, c.model.tie_word_embeddings, c.grad_accum, offloaded, experts, where,
                                             kinds, /*overlapped=*/true),
                           what + ", overlapped");
      EXPECT_TRUE(program_overlapped.optimizer.empty()) << what;
      // The updates' events, and only theirs, are released at the next update or the step's end.
      for (const ProgramEvent& e : program_overlapped.last_micro_batch)
        EXPECT_EQ(e.overlapped, e.phase == StepPhase::kOptimizer) << what << ": " << describe(e.access);
      // Each group's gradients are acquired by one batch of a micro-batch (the embedding's by two
      // when the head is tied to it): the overlapped optimizer takes the group after the last.
      // A data-parallel rank summing the gradients at handover: one reduction per group where the
      // overlapped optimizer's update sits, beside the cursor (the handover thread acquires it)
      // and writing; the norm pass reads.
      if (c.data_parallel) {
        const OptimizerProgram at_handover{groups, kinds, where, true, false, /*reduces_at_handover=*/true};
        const StepProgram program_reducing = make_step_program(model::record_micro_batch(c.model, c.offload), at_handover);
        std::vector<int> reduced, updated;
        std::vector<GroupAccess> rest;
        for (const ProgramEvent& e : program_reducing.last_micro_batch) {
          if (e.phase != StepPhase::kNorm) {
            rest.push_back(e.access);
            continue;
          }
          reduced.push_back(e.access.group);
          EXPECT_TRUE(e.access.kind == StateKind::kGrad && e.mode == AccessMode::kReadWrite && e.last &&
                      e.access.cursor == ScheduleCursor::kBeside)
              << what << ": " << describe(e.access);
        }
        for (const ProgramEvent& e : program_overlapped.last_micro_batch)
          if (e.phase == StepPhase::kOptimizer && (updated.empty() || updated.back() != e.access.group))
            updated.push_back(e.access.group);
        EXPECT_EQ(reduced, updated) << what;
        std::vector<GroupAccess> plain;
        for (const ProgramEvent& e : program_reducing.micro_batch) plain.push_back(e.access);
        expect_same_schedule(rest, plain, what + ", reducing at handover");
        for (const ProgramEvent& e : program_reducing.optimizer) {
          if (e.phase == StepPhase::kNorm) {
            EXPECT_EQ(e.mode, AccessMode::kRead) << what;
          }
        }
      }
      const std::vector<int> batches = gradient_batches(program_overlapped.micro_batch, groups);
      for (int g = 0; g < groups; ++g)
        EXPECT_EQ(batches[static_cast<size_t>(g)], g == 0 && c.model.tie_word_embeddings ? 2 : 1)
            << what << ", group " << g;
    }
  }
}

// The program the paged state pages along (its store's schedule) is that order for the state's
// own homes and sharding: rank 1 of 2 under a sharded optimizer (which updates its ranges of
// every group), the moments of some groups on the device and of the others in host memory,
// offloaded activations, a tied MoE model.
TEST(StepProgram, ThePagedStatesProgramFollowsItsPlacement) {
  model::ModelConfig mc = moe_config();
  mc.tie_word_embeddings = true;
  const model::ParamLayout layout(mc);
  const int L = static_cast<int>(layout.num_layers()), groups = L + 2;
  Placement placement(groups);
  for (int g = 0; g < groups; ++g)
    for (StateKind k : {StateKind::kParam, StateKind::kGrad, StateKind::kAdamM, StateKind::kAdamV})
      placement.place(g, k, g % 3 == 0 ? Tier::kDevice : Tier::kHost, 0);
  placement.shard_over(/*world=*/2, /*zero=*/1);
  auto device = CpuDevice::create(0, 0);
  ASSERT_TRUE(device.ok());
  PagedStateOptions po;
  po.device_bytes = 64ull << 20;
  po.host_bytes = 64ull << 20;
  po.grad_accum = 2;
  po.optimizer = optimizer_config(0.0f);
  po.placement = placement;
  po.rank = 1;
  po.offload_activations = true;
  po.activation_tokens = 16;
  auto ps = PagedState::create(**device, nullptr, layout, po);
  ASSERT_TRUE(ps.ok()) << ps.status().to_string();
  auto where = [&](int g) { return placement.home(g, StateKind::kAdamM); };
  // AdamW in host memory goes slice by slice: the store's update slices.
  StateStore& store = (*ps)->store();
  auto slices = [&store](int g) { return store.update_slices(g); };
  const std::vector<GroupAccess> want =
      expected_schedule(L, true, po.grad_accum, model::saved_activation_count(L), experts_per_group(layout), where,
                        StateLayout::of(po.precision).kinds(), false, slices);
  expect_same_schedule((*ps)->step_program().schedule(po.grad_accum), want, "rank 1 of 2");
  // Some host group has several slices, so that the case is seen.
  int sliced_groups = 0;
  for (int g = 0; g < groups; ++g) sliced_groups += where(g) == Tier::kHost && slices(g) > 1 ? 1 : 0;
  EXPECT_GT(sliced_groups, 0);
  // The moments are this rank's ranges: every group holds them, sliced.
  for (int g = 0; g < groups; ++g) {
    EXPECT_TRUE((*ps)->store().sliced(g, StateKind::kAdamM)) << g;
    EXPECT_FALSE((*ps)->store().sliced(g, StateKind::kParam)) << g;
  }
}

}  // namespace
}  // namespace strata
