// Embedding lookup and its scatter-add backward.
#include "kernels/embedding.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "../test_util.h"

namespace strata::kernels {
namespace {

using strata::testing::finite_difference;
using strata::testing::random_vector;
using strata::testing::relative_error;

// Tokens drawn from a small vocabulary so that most of them repeat.
std::vector<int32_t> random_tokens(int64_t n, int32_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, vocab - 1);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = dist(rng);
  return t;
}

struct Shape {
  int64_t N, C, V;
};
const Shape kEmbeddingShapes[] = {{1, 1, 1}, {3, 17, 5}, {17, 3, 4}, {127, 33, 11}, {2048, 64, 50}};

TEST(Embedding, FastForwardCopiesRows) {
  for (const auto& s : kEmbeddingShapes) {
    auto table = random_vector(s.V * s.C, 1);
    auto tokens = random_tokens(s.N, static_cast<int32_t>(s.V), 2);
    std::vector<float> out_ref(s.N * s.C), out(s.N * s.C, NAN);
    ref::embedding_forward(out_ref.data(), tokens.data(), table.data(), s.N, s.C);
    cpu::embedding_forward(out.data(), tokens.data(), table.data(), s.N, s.C);
    EXPECT_EQ(out, out_ref);
    for (int64_t n = 0; n < s.N; ++n) {
      ASSERT_EQ(out[n * s.C + s.C - 1], table[tokens[n] * s.C + s.C - 1]);
    }
  }
}

TEST(Embedding, BackwardAddsEveryOccurrenceOntoTheTable) {
  // Token 2 appears twice, token 0 once, token 1 never: its row must stay as it was.
  const std::vector<int32_t> tokens = {2, 0, 2};
  const std::vector<float> dout = {1, 2, 10, 20, 100, 200};
  for (auto backward : {&ref::embedding_backward, &cpu::embedding_backward}) {
    std::vector<float> dtable = {0.5f, 0.5f, 7, 7, -1, -1};
    backward(dtable.data(), dout.data(), tokens.data(), 3, 2);
    EXPECT_EQ(dtable, (std::vector<float>{10.5f, 20.5f, 7, 7, 100, 201}));
  }
}

TEST(Embedding, FastBackwardMatchesReference) {
  for (const auto& s : kEmbeddingShapes) {
    auto dout = random_vector(s.N * s.C, 3);
    auto tokens = random_tokens(s.N, static_cast<int32_t>(s.V), 4);
    auto dtable_ref = random_vector(s.V * s.C, 5), dtable = dtable_ref;
    ref::embedding_backward(dtable_ref.data(), dout.data(), tokens.data(), s.N, s.C);
    cpu::embedding_backward(dtable.data(), dout.data(), tokens.data(), s.N, s.C);
    EXPECT_WITHIN(relative_error(dtable, dtable_ref), 1e-6) << "N=" << s.N << " C=" << s.C;
  }
}

TEST(Embedding, ReferenceBackwardMatchesFiniteDifferences) {
  const Shape s{9, 5, 4};
  auto table = random_vector(s.V * s.C, 1), r = random_vector(s.N * s.C, 2);
  auto tokens = random_tokens(s.N, static_cast<int32_t>(s.V), 3);
  std::vector<float> out(s.N * s.C);
  auto loss = [&] {
    ref::embedding_forward(out.data(), tokens.data(), table.data(), s.N, s.C);
    double l = 0;
    for (size_t i = 0; i < out.size(); ++i) l += double(out[i]) * r[i];
    return l;
  };
  std::vector<float> dtable(table.size(), 0.0f), numeric(table.size());
  ref::embedding_backward(dtable.data(), r.data(), tokens.data(), s.N, s.C);
  for (size_t i = 0; i < table.size(); ++i) numeric[i] = finite_difference(loss, &table[i], 1e-2);
  EXPECT_WITHIN(relative_error(dtable, numeric), 1e-4);
}

TEST(Embedding, FastBackwardDoesNotDependOnThreadCount) {
  const Shape s{4096, 96, 37};
  auto dout = random_vector(s.N * s.C, 6);
  auto tokens = random_tokens(s.N, static_cast<int32_t>(s.V), 7);
  std::vector<float> runs[3];
  const int saved = omp_get_max_threads();
  const int threads[3] = {1, 3, saved};
  for (int k = 0; k < 3; ++k) {
    omp_set_num_threads(threads[k]);
    runs[k].assign(s.V * s.C, 0.25f);
    cpu::embedding_backward(runs[k].data(), dout.data(), tokens.data(), s.N, s.C);
  }
  omp_set_num_threads(saved);
  for (int k = 1; k < 3; ++k) {
    EXPECT_EQ(std::memcmp(runs[0].data(), runs[k].data(), runs[0].size() * sizeof(float)), 0);
  }
}

// The table in row blocks of 3 rows, each in an allocation of its own: the same rows out, and
// the same additions into each row, bitwise, as with one contiguous table.
TEST(Embedding, RowBlocksGiveTheContiguousResultsBitwise) {
  for (const auto& s : kEmbeddingShapes) {
    const int64_t rows = 3;
    auto table = random_vector(s.V * s.C, 5);
    auto dtable = random_vector(s.V * s.C, 6);
    auto dout = random_vector(s.N * s.C, 7);
    auto tokens = random_tokens(s.N, static_cast<int32_t>(s.V), 8);
    std::vector<std::vector<float>> t_blocks, d_blocks;
    std::vector<const float*> t_ptrs;
    std::vector<float*> d_ptrs;
    for (int64_t v0 = 0; v0 < s.V; v0 += rows) {
      const int64_t n = std::min(rows, s.V - v0);
      t_blocks.emplace_back(table.begin() + v0 * s.C, table.begin() + (v0 + n) * s.C);
      d_blocks.emplace_back(dtable.begin() + v0 * s.C, dtable.begin() + (v0 + n) * s.C);
    }
    for (size_t b = 0; b < t_blocks.size(); ++b) {
      t_ptrs.push_back(t_blocks[b].data());
      d_ptrs.push_back(d_blocks[b].data());
    }
    std::vector<float> out(s.N * s.C, NAN), out_blocked(s.N * s.C, NAN);
    cpu::embedding_forward(out.data(), tokens.data(), table.data(), s.N, s.C);
    cpu::embedding_forward_blocked(out_blocked.data(), tokens.data(), t_ptrs.data(), rows, s.N, s.C);
    EXPECT_EQ(std::memcmp(out.data(), out_blocked.data(), out.size() * sizeof(float)), 0);
    cpu::embedding_backward(dtable.data(), dout.data(), tokens.data(), s.N, s.C);
    cpu::embedding_backward_blocked(d_ptrs.data(), rows, dout.data(), tokens.data(), s.N, s.C);
    for (size_t b = 0; b < d_blocks.size(); ++b)
      EXPECT_EQ(std::memcmp(d_blocks[b].data(), dtable.data() + b * rows * s.C, d_blocks[b].size() * sizeof(float)), 0)
          << "block " << b;
  }
}

}  // namespace
}  // namespace strata::kernels
