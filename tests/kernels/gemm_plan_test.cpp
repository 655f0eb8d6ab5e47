// The plain-C++ side of the cached cuBLASLt GEMMs (kernels/gemm_plan.h): a plan is built once
// per key however the keys interleave, and a failed algorithm search names the GEMM.
#include "kernels/gemm_plan.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <tuple>

namespace strata::kernels {
namespace {

struct FakePlan {
  int id = 0;
};

using Key = std::tuple<int64_t, int64_t, int64_t, bool>;

TEST(PlanCache, BuildsEachKeyOnceHoweverTheKeysInterleave) {
  PlanCache<Key, FakePlan> cache;
  int builds = 0;
  auto get = [&](const Key& key) -> FakePlan& {
    return cache.get(key, [&] {
      auto plan = std::make_unique<FakePlan>();
      plan->id = ++builds;
      return plan;
    });
  };
  const Key a{128, 256, 64, false}, b{128, 256, 64, true}, c{256, 128, 64, false};
  FakePlan& first = get(a);
  EXPECT_EQ(first.id, 1);
  EXPECT_EQ(&get(a), &first);  // the same plan, not a copy
  EXPECT_EQ(get(b).id, 2);
  EXPECT_EQ(get(a).id, 1);
  EXPECT_EQ(get(c).id, 3);
  EXPECT_EQ(get(b).id, 2);
  EXPECT_EQ(get(c).id, 3);
  EXPECT_EQ(&get(a), &first);  // still valid after other keys were added
  EXPECT_EQ(builds, 3);
  EXPECT_EQ(cache.built(), 3);
  EXPECT_EQ(cache.size(), 3u);
  cache.clear();
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_EQ(get(a).id, 4);  // built again after clear()
  EXPECT_EQ(cache.built(), 4);
}

// Shapes that never repeat (experts' token counts) cannot grow the cache without bound.
TEST(PlanCache, ANewPlanBeyondTheCapacityEmptiesTheCacheFirst) {
  PlanCache<int, FakePlan> cache(/*capacity=*/3);
  auto build = [] { return std::make_unique<FakePlan>(); };
  for (int key = 0; key < 3; ++key) cache.get(key, build);
  EXPECT_EQ(cache.size(), 3u);
  cache.get(1, build);  // known: nothing built, nothing dropped
  EXPECT_EQ(cache.built(), 3);
  EXPECT_EQ(cache.size(), 3u);
  cache.get(3, build);  // new and full: the cache starts again with it
  EXPECT_EQ(cache.built(), 4);
  EXPECT_EQ(cache.size(), 1u);
  cache.get(0, build);
  EXPECT_EQ(cache.built(), 5);
  EXPECT_EQ(cache.size(), 2u);
}

TEST(GemmHeuristicFailure, TheMessageNamesShapeTransposesTypesEpilogueAndStatus) {
  GemmDescription g;
  g.M = 37;
  g.N = 53;
  g.K = 70;
  g.trans_a = true;
  g.trans_b = false;
  g.a_type = g.b_type = "bf16";
  g.c_type = "fp32";
  g.epilogue = "bias (bf16)";
  g.accumulate = "beta != 0";
  const std::string m =
      gemm_heuristic_failure_message(g, "CUBLAS_STATUS_NOT_SUPPORTED", "the functionality requested is not supported", 0);
  for (const char* part : {"M=37", "N=53", "K=70", "trans_a=yes", "trans_b=no", "C (37 x 53, fp32)",
                           "A^T (37 x 70, bf16)", "B (70 x 53, bf16)", "epilogue bias (bf16)", "beta != 0",
                           "CUBLAS_STATUS_NOT_SUPPORTED", "not supported", "0 algorithms"}) {
    EXPECT_NE(m.find(part), std::string::npos) << "missing '" << part << "' in: " << m;
  }
}

}  // namespace
}  // namespace strata::kernels
