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

struct Written {
  std::vector<uint8_t> bytes;  // the E4M3 codes, row-major
  std::vector<float> scales;   // (ceil(rows/128), ceil(cols/128))
  std::vector<float> values;   // an fp32 tensor's values
};

// One file per tensor, with an index: the linear weights in F8_E4M3 with block scales (of
// `scale_shape(t)`), the rest in F32.
std::map<std::string, Written> write_checkpoint(const fs::path& dir, const ParamLayout& layout,
                                                const std::function<std::vector<int64_t>(const TensorSpec&)>& scale_shape) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::mt19937 rng(17);
  nlohmann::json weight_map = nlohmann::json::object();
  std::map<std::string, Written> out;
  int k = 0;
  auto write = [&](const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape,
                   const void* data, uint64_t bytes) {
    const std::string header =
        nlohmann::json{{name, {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {0, bytes}}}}}.dump();
    const std::string file = "part-" + std::to_string(k++) + ".safetensors";
    std::ofstream f(dir / file, std::ios::binary);
    for (int i = 0; i < 8; ++i) f.put(static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i)));
    f << header;
    f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    weight_map[name] = file;
  };
  for (const TensorSpec& t : layout.tensors()) {
    Written w;
    if (param_is_linear_weight(layout, t)) {
      w.bytes.resize(static_cast<size_t>(t.numel));
      for (uint8_t& b : w.bytes) {
        do b = static_cast<uint8_t>(rng() & 0xff); while ((b & 0x7f) == 0x7f);  // no NaN codes
      }
      const std::vector<int64_t> s = scale_shape(t);
      w.scales.resize(static_cast<size_t>(s[0] * s[1]));
      std::uniform_real_distribution<float> scale(1e-4f, 1e-2f);
      for (float& v : w.scales) v = scale(rng);
      write(t.name, "F8_E4M3", t.shape, w.bytes.data(), w.bytes.size());
      write(block_scale_name(t.name), "F32", s, w.scales.data(), w.scales.size() * sizeof(float));
    } else {
      w.values.resize(static_cast<size_t>(t.numel));
      std::normal_distribution<float> normal(0.0f, 0.5f);
      for (float& v : w.values) v = normal(rng);
      write(t.name, "F32", t.shape, w.values.data(), w.values.size() * sizeof(float));
    }
    out[t.name] = std::move(w);
  }
  std::ofstream(dir / kSafetensorsIndexName) << nlohmann::json{{"weight_map", weight_map}}.dump();
  return out;
}

std::vector<int64_t> block_grid(const TensorSpec& t) { return {(t.shape[0] + 127) / 128, (t.shape[1] + 127) / 128}; }

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
