// FP8 checkpoints with block scales (DeepSeek-V3's: each linear weight in F8_E4M3 with
// NAME_scale_inv, one fp32 per 128 x 128 block) load dequantised, every element its E4M3 value
// times its block's scale in fp32 as DeepSeek's weight_dequant computes it; the other tensors
// load as they are; scales of the wrong shape are refused naming them.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/fp8.h"
#include "model/hf_io.h"
#include "model/param_access.h"
#include "model/params.h"
#include "model/safetensors.h"
#include "../fp8_checkpoint.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

// A matrix of 160 x 288 and 288 x 160: two and three 128-blocks with ragged edges.
ModelConfig fp8_config() {
  ModelConfig c;
  c.vocab_size = 11;
  c.hidden_size = 160;
  c.intermediate_size = 288;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 16;
  c.fill_defaults();
  return c;
}

fs::path test_dir() {
  return fs::path(STRATA_BINARY_DIR) / "tests" / "model_hf_fp8" /
         ::testing::UnitTest::GetInstance()->current_test_info()->name();
}

TEST(HfFp8BlocksTest, WeightsWithBlockScalesLoadAsE4m3TimesTheirBlocksScale) {
  const ModelConfig config = fp8_config();
  const ParamLayout layout(config);
  const fs::path dir = test_dir();
  const std::map<std::string, Written> written = write_checkpoint(dir, layout, block_grid);
  std::vector<float> params(static_cast<size_t>(layout.total_size()), 0.0f);
  Status st = load_hf_weights(dir.string(), layout, params.data());
  ASSERT_TRUE(st.ok()) << st.to_string();
  int scaled = 0;
  for (const TensorSpec& t : layout.tensors()) {
    const Written& w = written.at(t.name);
    if (w.bytes.empty()) {
      EXPECT_EQ(std::memcmp(params.data() + t.offset, w.values.data(), w.values.size() * sizeof(float)), 0) << t.name;
      continue;
    }
    ++scaled;
    const int64_t rows = t.shape[0], cols = t.shape[1], grid_cols = (cols + 127) / 128;
    int64_t mismatches = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float expected = kernels::e4m3_to_f32(w.bytes[static_cast<size_t>(r * cols + c)]) *
                               w.scales[static_cast<size_t>((r / 128) * grid_cols + c / 128)];
        const float got = params[static_cast<size_t>(t.offset + r * cols + c)];
        mismatches += std::memcmp(&expected, &got, sizeof(float)) != 0 ? 1 : 0;
      }
    }
    EXPECT_EQ(mismatches, 0) << t.name;
  }
  EXPECT_EQ(scaled, 7) << "q, k, v, o, gate, up and down";
}

TEST(HfFp8BlocksTest, ScalesOfTheWrongShapeAreRefusedNamingThem) {
  const ModelConfig config = fp8_config();
  const ParamLayout layout(config);
  const fs::path dir = test_dir();
  write_checkpoint(dir, layout, [](const TensorSpec& t) {
    std::vector<int64_t> s = block_grid(t);
    if (t.name.find("up_proj") != std::string::npos) s[1] += 1;  // blocks of another size
    return s;
  });
  std::vector<float> params(static_cast<size_t>(layout.total_size()), 0.0f);
  Status st = load_hf_weights(dir.string(), layout, params.data());
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("model.layers.0.mlp.up_proj.weight_scale_inv"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find("128 x 128"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace strata::model
