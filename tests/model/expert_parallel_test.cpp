// Expert parallelism in the decoder (model/expert_parallel.h): P ranks, each a thread of this
// process with a Gloo Comm of its own, route their own micro-batches and exchange the rows with
// the experts' ranks. Against one process that runs the same P micro-batches one after another:
// every rank's loss, the dense gradients summed over the ranks, and each expert's gradient on
// the rank that holds it agree within rounding (an expert's GEMMs see every rank's rows at once,
// so its sums group differently); an expert a rank does not hold gets no gradient there at all.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "../test_util.h"
#include "model/decoder.h"
#include "model/expert_parallel.h"
#include "model/flat_model.h"
#include "model/tiny_moe.h"
#include "parallel/comm.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kB = kTinyB;
constexpr int64_t kT = kTinyT;
constexpr int64_t kExperts = 4;

// The aux loss on; bias_rate > 0 turns on the loss-free balancing bias, which the tests set by
// hand.
ModelConfig moe_config(double bias_rate) { return tiny_moe_config(/*output_router_logits=*/true, bias_rate); }

struct Run {
  std::vector<double> losses;              // per micro-batch (per rank)
  std::vector<std::vector<float>> grads;   // per rank (one entry for the single process)
};

// Every expert to 0 and 1 in layer 0 (the others get no row there), when `skew`.
template <class Net>
void set_bias(FlatModel<Net>& model, bool skew) {
  if (!skew) return;
  std::vector<float>& bias = model.net().mutable_expert_selection_bias();
  bias[0] = bias[1] = 100.0f;
}

template <class Net>
Run one_process(const ModelConfig& config, const std::vector<TinyBatch>& batches, bool skew) {
  FlatModel<Net> model(config);
  model.init_weights(7);
  model.zero_grads();
  set_bias(model, skew);
  Run run;
  const float scale = 1.0f / static_cast<float>(batches.size() * kB * kT);
  for (const TinyBatch& b : batches)
    run.losses.push_back(model.forward_backward(b.inputs.data(), b.targets.data(), kB, kT, scale));
  run.grads.emplace_back(model.grads(), model.grads() + model.layout().total_size());
  return run;
}

template <class Net>
Run expert_parallel(const ModelConfig& config, const std::vector<TinyBatch>& batches, bool skew) {
  const int P = static_cast<int>(batches.size());
  const fs::path dir = fs::path(::testing::TempDir()) /
                       fmt::format("ep_test_{}_{}", ::getpid(), ::testing::UnitTest::GetInstance()->random_seed());
  fs::remove_all(dir);
  fs::create_directories(dir);
  Run run;
  run.losses.assign(static_cast<size_t>(P), 0.0);
  run.grads.resize(static_cast<size_t>(P));
  std::vector<std::string> errors(static_cast<size_t>(P));
  const float scale = 1.0f / static_cast<float>(batches.size() * kB * kT);
  std::vector<std::thread> ranks;
  for (int r = 0; r < P; ++r) {
    ranks.emplace_back([&, r] {
      parallel::LaunchInfo launch;
      launch.rank = launch.local_rank = r;
      launch.world_size = launch.local_world_size = P;
      launch.launcher = "test";
      parallel::CommOptions options;
      options.backend = "gloo";
      options.rendezvous_dir = dir.string();
      options.name = "experts";
      options.timeout = std::chrono::seconds(60);
      Result<std::unique_ptr<parallel::Comm>> comm = parallel::connect(launch, options);
      if (!comm.ok()) {
        errors[static_cast<size_t>(r)] = comm.status().to_string();
        return;
      }
      FlatModel<Net> model(config);
      model.init_weights(7);
      model.zero_grads();
      set_bias(model, skew);
      model.net().set_expert_comm(comm->get());
      const TinyBatch& b = batches[static_cast<size_t>(r)];
      Result<double> loss = model.net().compute(b.inputs.data(), b.targets.data(), kB, kT, scale, true);
      model.net().set_expert_comm(nullptr);
      if (!loss.ok()) {
        errors[static_cast<size_t>(r)] = loss.status().to_string();
        return;
      }
      run.losses[static_cast<size_t>(r)] = *loss;
      run.grads[static_cast<size_t>(r)].assign(model.grads(), model.grads() + model.layout().total_size());
    });
  }
  for (std::thread& t : ranks) t.join();
  fs::remove_all(dir);
  for (int r = 0; r < P; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  return run;
}

// The tolerance: the experts' sums regroup (see the file comment), a few float roundings per
// element relative to the gradients' scale; the bf16 recipe rounds activations to 8 bits.
template <class Net>
void check_against_one_process(int P, bool skew, double tol, bool lora = false) {
  ModelConfig config = moe_config(skew ? 0.01 : 0.0);
  if (lora) {
    // Adapters on the attention and on every expert (run expert by expert, on their ranks).
    config.lora.rank = 4;
    config.lora.alpha = 8;
    config.lora.targets = kLoraQ | kLoraV | kLoraExperts;
    ASSERT_TRUE(config.validate("test").ok());
  }
  std::vector<TinyBatch> batches;
  for (int r = 0; r < P; ++r) batches.push_back(tiny_batch(100 + static_cast<uint64_t>(r), config.vocab_size));
  const Run one = one_process<Net>(config, batches, skew);
  const Run ep = expert_parallel<Net>(config, batches, skew);
  if (::testing::Test::HasFailure()) return;
  for (int r = 0; r < P; ++r) {
    const double err = std::abs(ep.losses[static_cast<size_t>(r)] - one.losses[static_cast<size_t>(r)]) /
                       std::abs(one.losses[static_cast<size_t>(r)]);
    EXPECT_TRUE(err <= tol) << "rank " << r << " loss " << ep.losses[static_cast<size_t>(r)] << " against "
                            << one.losses[static_cast<size_t>(r)];
  }
  const ParamLayout layout(config);
  const std::vector<float>& ref = one.grads[0];
  int expert_adapters = 0;  // with a gradient
  for (const TensorSpec& t : layout.tensors()) {
    const int expert = param_expert_of(layout, t);
    std::vector<float> got(static_cast<size_t>(t.numel), 0.0f);
    if (expert < 0) {
      // Dense tensors: every rank's micro-batch adds its part; their sum is the step's gradient.
      for (int r = 0; r < P; ++r)
        for (int64_t i = 0; i < t.numel; ++i) got[static_cast<size_t>(i)] += ep.grads[static_cast<size_t>(r)][static_cast<size_t>(t.offset + i)];
    } else {
      // An expert's gradient is whole on the rank that holds it, and nowhere else.
      for (int r = 0; r < P; ++r) {
        const std::vector<float>& g = ep.grads[static_cast<size_t>(r)];
        if (expert_range(kExperts, P, r).holds(expert)) {
          got.assign(g.begin() + t.offset, g.begin() + t.offset + t.numel);
          continue;
        }
        for (int64_t i = 0; i < t.numel; ++i)
          ASSERT_EQ(g[static_cast<size_t>(t.offset + i)], 0.0f) << t.name << " on rank " << r << ", which does not hold it";
      }
    }
    bool all_zero = true;
    for (int64_t i = 0; i < t.numel; ++i) all_zero = all_zero && ref[static_cast<size_t>(t.offset + i)] == 0.0f;
    if (all_zero) {
      // An expert no rank routed a row to (skew): no gradient either way.
      for (float v : got) ASSERT_EQ(v, 0.0f) << t.name;
      continue;
    }
    const double err = testing::relative_error(got.data(), ref.data() + t.offset, t.numel);
    EXPECT_TRUE(err <= tol) << t.name << ": relative error " << err;
    expert_adapters += expert >= 0 && t.adapts >= 0 ? 1 : 0;
  }
  if (lora) EXPECT_GT(expert_adapters, 0) << "no expert adapter got a gradient";
}

TEST(ExpertParallel, TwoRanksMatchOneProcess) { check_against_one_process<LlamaModel>(2, false, 1e-5); }
TEST(ExpertParallel, FourRanksMatchOneProcess) { check_against_one_process<LlamaModel>(4, false, 1e-5); }
TEST(ExpertParallel, Bf16RecipeMatchesOneProcess) { check_against_one_process<LlamaModelBf16>(2, false, 1e-3); }
TEST(ExpertParallel, LoraOnTheExpertsMatchesOneProcess) { check_against_one_process<LlamaModel>(2, false, 1e-5, true); }

// Layer 0 sends every row to experts 0 and 1: at P = 2 rank 1 receives nothing there, at P = 4
// ranks 2 and 3 do; they still take part in every exchange, and the results hold.
TEST(ExpertParallel, RanksThatReceiveNoRowsStillTakePart) {
  check_against_one_process<LlamaModel>(2, true, 1e-5);
  check_against_one_process<LlamaModel>(4, true, 1e-5);
}

TEST(ExpertParallel, ExpertRangesPartitionTheExperts) {
  for (int64_t P : {1, 2, 4, 8}) {
    std::vector<int> owner(8, -1);
    for (int64_t r = 0; r < P; ++r) {
      const ExpertRange range = expert_range(8, P, r);
      EXPECT_EQ(range.count, 8 / P);
      for (int64_t e = range.first; e < range.first + range.count; ++e) {
        EXPECT_EQ(owner[static_cast<size_t>(e)], -1);
        owner[static_cast<size_t>(e)] = static_cast<int>(r);
      }
    }
    for (int o : owner) EXPECT_GE(o, 0);
  }
}

}  // namespace
}  // namespace strata::model
