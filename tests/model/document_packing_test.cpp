// Packing with document masks (data.packing: document): a packed batch, whose rows hold several
// documents with positions restarting at each, gives every document the loss and the gradients
// it gets alone, one document per sequence.
//
// The bound is zero, bit for bit, and here is why. With document masks every per-token value of
// the packed batch is computed by the same arithmetic as for the document alone at the start of a
// sequence: the row-wise ops (norms, projections, SwiGLU, RoPE at the same positions, the LM head)
// do not look at other rows, and the attention ops visit a query's keys, and a key's queries, in
// the same ascending order (kernels/attention.h). The sums over tokens (weight gradients, the
// loss) then add the same nonzero terms in the same order: the one-per-sequence batch only
// interleaves padding, whose targets are -1, so its gradients are exact zeros and add nothing.
// That needs sums whose grouping does not depend on the number of rows: strata's fixed-order
// GEMM (OpenBLAS blocks by shape, which only reorders fp32 sums), one LM-head chunk, and RMSNorm
// weight gradients at one row per partial sum (N <= 64, kernels/cpu/rmsnorm.cpp; Qwen3's per-head
// q/k norms sum over N x heads rows, which would regroup, so the models here have none).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/linear.h"
#include "model/fixed_order_gemm.h"
#include "model/decoder.h"
#include "model/flat_model.h"

namespace strata::model {
namespace {

constexpr int32_t kEos = 52;
constexpr int32_t kPad = 0;

ModelConfig small_config(bool moe = false) {
  ModelConfig c;
  c.vocab_size = 53;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.attention_bias = true;
  if (moe) {  // routed per token; no auxiliary loss, which counts the padding's routes too
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 24;
    c.shared_expert_intermediate_size = 32;
  }
  c.fill_defaults();
  return c;
}

// One document of a packed row: [begin, end) of the row's T + 1 token window.
struct Doc {
  int64_t row, begin, end;
};

// Packed rows of T + 1 tokens each, documents ending in kEos but the last of a row, which runs
// past the window (its last target is the window's last token).
struct Packed {
  int64_t B = 0, T = 0;
  std::vector<int32_t> window;  // (B, T + 1)
  std::vector<Doc> docs;
};

Packed make_packed() {
  Packed p;
  p.B = 2;
  p.T = 12;
  const std::vector<std::vector<int64_t>> lengths = {{4, 5, 4}, {7, 6}};  // tokens per document, EOS included
  uint32_t state = 12345;
  auto next_token = [&] {  // ids in [1, kEos): neither padding nor EOS
    state = state * 1664525u + 1013904223u;
    return static_cast<int32_t>(1 + (state >> 8) % (kEos - 1));
  };
  for (int64_t b = 0; b < p.B; ++b) {
    int64_t begin = 0;
    for (size_t d = 0; d < lengths[b].size(); ++d) {
      const int64_t end = begin + lengths[b][d];
      const bool last = d + 1 == lengths[b].size();
      for (int64_t t = begin; t < end; ++t) p.window.push_back(!last && t == end - 1 ? kEos : next_token());
      p.docs.push_back({b, begin, end});
      begin = end;
    }
    EXPECT_EQ(begin, p.T + 1);
  }
  return p;
}

// The packed batch as the data loader serves it: inputs, targets (the EOS's is -1) and positions
// restarting after each EOS. Only document `only`'s targets are kept when only >= 0.
void packed_batch(const Packed& p, int64_t only, std::vector<int32_t>* inputs, std::vector<int32_t>* targets,
                  std::vector<int32_t>* positions) {
  inputs->clear(), targets->clear(), positions->clear();
  for (int64_t b = 0; b < p.B; ++b) {
    const int32_t* w = p.window.data() + b * (p.T + 1);
    for (int64_t t = 0; t < p.T; ++t) {
      inputs->push_back(w[t]);
      targets->push_back(w[t] == kEos ? -1 : w[t + 1]);
      positions->push_back(t == 0 || w[t - 1] == kEos ? 0 : positions->back() + 1);
    }
  }
  if (only < 0) return;
  const Doc& d = p.docs[static_cast<size_t>(only)];
  for (int64_t i = 0; i < p.B * p.T; ++i) {
    const int64_t b = i / p.T, t = i % p.T;
    if (b != d.row || t < d.begin || t >= d.end) (*targets)[static_cast<size_t>(i)] = -1;
  }
}

// The same documents one per sequence of T tokens, from position 0, padded at the end; the
// targets are those of the packed batch. Only document `only`'s row keeps targets when only >= 0
// (the others stay in the batch, predicting nothing).
void separate_batch(const Packed& p, int64_t only, std::vector<int32_t>* inputs, std::vector<int32_t>* targets) {
  inputs->assign(p.docs.size() * p.T, kPad);
  targets->assign(inputs->size(), -1);
  for (size_t d = 0; d < p.docs.size(); ++d) {
    const Doc& doc = p.docs[d];
    const int32_t* w = p.window.data() + doc.row * (p.T + 1);
    for (int64_t t = doc.begin; t < std::min(doc.end, p.T); ++t) {
      const size_t i = d * p.T + (t - doc.begin);
      (*inputs)[i] = w[t];
      if (only < 0 || static_cast<size_t>(only) == d) (*targets)[i] = w[t] == kEos ? -1 : w[t + 1];
    }
  }
}

template <class Net>
void expect_packed_equals_separate(bool moe = false) {
  FixedOrderGemm fixed;
  const Packed p = make_packed();
  const int64_t docs = static_cast<int64_t>(p.docs.size());
  FlatModel<Net> packed(small_config(moe)), separate(small_config(moe));
  packed.init_weights(7);
  separate.init_weights(7);
  std::vector<int32_t> in, tg, pos, sin, stg;

  // Each document's loss: the packed batch with only its targets, against its own sequence.
  for (int64_t d = 0; d < docs; ++d) {
    packed_batch(p, d, &in, &tg, &pos);
    separate_batch(p, d, &sin, &stg);
    Result<double> got = packed.compute(in.data(), tg.data(), p.B, p.T, 1.0f, /*backward=*/false, pos.data());
    Result<double> want = separate.compute(sin.data(), stg.data(), docs, p.T, 1.0f, /*backward=*/false);
    ASSERT_TRUE(got.ok() && want.ok());
    EXPECT_GT(*want, 0.0) << "document " << d;
    EXPECT_EQ(*got, *want) << "document " << d;
  }

  // All the documents' gradients together.
  packed_batch(p, -1, &in, &tg, &pos);
  separate_batch(p, -1, &sin, &stg);
  packed.zero_grads();
  separate.zero_grads();
  Result<double> got = packed.compute(in.data(), tg.data(), p.B, p.T, 1.0f, /*backward=*/true, pos.data());
  Result<double> want = separate.compute(sin.data(), stg.data(), docs, p.T, 1.0f, /*backward=*/true);
  ASSERT_TRUE(got.ok() && want.ok());
  EXPECT_EQ(*got, *want);
  const int64_t n = packed.layout().total_size();
  // The tensor holding flat element i, for messages.
  auto tensor_of = [&](int64_t i) -> std::string {
    for (const TensorSpec& t : packed.layout().tensors())
      if (i >= t.offset && i < t.offset + t.numel) return t.name;
    return "padding";
  };
  int64_t nonzero = 0, differ = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float a = packed.grads()[i], b = separate.grads()[i];
    nonzero += a != 0.0f ? 1 : 0;
    if (!(a == b)) {  // NaN differs too
      if (differ++ < 5)
        ADD_FAILURE() << "gradient element " << i  << " (" << tensor_of(i) << "): packed " << a
                      << ", one per sequence " << b;
    }
  }
  EXPECT_EQ(differ, 0);
  EXPECT_GT(nonzero, n / 2);

  // Without the masks the documents see each other: the same packed batch loses differently.
  Result<double> concat = packed.compute(in.data(), tg.data(), p.B, p.T, 1.0f, /*backward=*/false);
  ASSERT_TRUE(concat.ok());
  EXPECT_NE(*concat, *got);
}

TEST(DocumentPacking, Fp32PackedBatchMatchesOneDocumentPerSequenceBitwise) {
  expect_packed_equals_separate<LlamaModel>();
}

TEST(DocumentPacking, Bf16RecipePackedBatchMatchesOneDocumentPerSequenceBitwise) {
  expect_packed_equals_separate<LlamaModelBf16>();
}

TEST(DocumentPacking, MoePackedBatchMatchesOneDocumentPerSequenceBitwise) {
  expect_packed_equals_separate<LlamaModel>(/*moe=*/true);
}

}  // namespace
}  // namespace strata::model
