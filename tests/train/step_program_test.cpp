// The step program (offload/step_program.h): the model's part recorded from the decoder
// (model/recording_access.h) and the optimizer's passes, against the order the chunk store
// followed when it was written by hand (train/step_schedule.cpp), for every kind of model and
// step the paging tests train: dense, tied, MoE with dense layers between, offloaded
// activations, several micro-batches, AdamW on the device for some groups and on the host for
// others, and a data-parallel rank that updates only the groups it owns.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "model/param_access.h"
#include "model/params.h"
#include "model/recording_access.h"
#include "offload/step_program.h"
#include "train/paged_state.h"
#include "train/step_schedule.h"
#include "train/train_test_util.h"

namespace strata {
namespace {

std::string describe(const GroupAccess& a) {
  return fmt::format("{{group {} kind {} act {} part {} to {} prefetch {}}}", a.group, static_cast<int>(a.kind),
                     a.activation, a.part, static_cast<int>(a.prefetch_to), a.prefetch);
}

// Equal in every field, those operator== leaves out (where prefetch moves, whether it does) too.
void expect_same_schedule(const std::vector<GroupAccess>& got, const std::vector<GroupAccess>& want,
                          const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool same = got[i] == want[i] && got[i].prefetch_to == want[i].prefetch_to &&
                      got[i].prefetch == want[i].prefetch;
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
  bool owns_odd_groups_only = false;  // a data-parallel rank
};

TEST(StepProgram, TheRecordedProgramIsTheHandWrittenSchedule) {
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
    std::vector<int> experts(static_cast<size_t>(groups), 0);
    for (const auto& t : layout.tensors()) {
      int& count = experts[static_cast<size_t>(model::param_group_of(layout, t))];
      count = std::max(count, model::param_expert_of(layout, t) + 1);
    }
    // AdamW on the device for every third group, on the host for the others.
    auto where = [](int g) { return g % 3 == 0 ? Tier::kDevice : Tier::kHost; };
    auto owns = [&](int g) { return !c.owns_odd_groups_only || g % 2 == 1; };
    for (Precision precision : {Precision::kFp32, Precision::kBf16}) {
      const std::vector<StateKind> kinds = StateLayout::of(precision).kinds();
      const int offloaded = c.offload ? model::offloaded_checkpoint_count(L) : 0;
      const std::vector<GroupAccess> want =
          step_schedule(L, c.model.tie_word_embeddings, c.grad_accum, offloaded, experts, where, kinds,
                        [&](int g, StateKind k) { return owns(g) || k == StateKind::kParam; });
      const StepProgram program =
          make_step_program(model::record_micro_batch(c.model, c.offload), {groups, kinds, owns, where});
      expect_same_schedule(program.schedule(c.grad_accum), want,
                           fmt::format("{} ({})", c.name, precision == Precision::kFp32 ? "fp32" : "bf16"));
    }
  }
}

}  // namespace
}  // namespace strata
