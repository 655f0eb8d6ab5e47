// Exports keep the source's precision: hf_source_dtype reads it off the tensors (config.json's
// torch_dtype breaks ties), export_hf writes f32, bf16 or f16 with a torch_dtype that says so.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/hf_io.h"
#include "model/params.h"
#include "model/safetensors.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir = fs::path(STRATA_BINARY_DIR) / "tests" / "model_hf_dtype" / info->name() / name;
  fs::remove_all(dir);
  fs::create_directories(dir.parent_path());
  return dir;
}

ModelConfig tiny_config() {
  ModelConfig c;
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.max_position_embeddings = 16;
  c.fill_defaults();
  return c;
}

// A sharded checkpoint of `layout` with one file per tensor in the dtype `dtype_of` names (zeros:
// only the dtypes matter here).
void write_checkpoint(const fs::path& dir, const ParamLayout& layout,
                      const std::function<std::string(const TensorSpec&)>& dtype_of) {
  fs::create_directories(dir);
  nlohmann::json weight_map = nlohmann::json::object();
  int k = 0;
  for (const TensorSpec& t : layout.tensors()) {
    const std::string dtype = dtype_of(t);
    const uint64_t bytes = static_cast<uint64_t>(t.numel * safetensors_dtype_size(dtype));
    nlohmann::json shape = t.shape;
    const std::string header = nlohmann::json{{t.name, {{"dtype", dtype}, {"shape", shape},
                                                        {"data_offsets", {0, bytes}}}}}.dump();
    const std::string file = "part-" + std::to_string(k++) + ".safetensors";
    std::ofstream out(dir / file, std::ios::binary);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i)));
    out << header << std::string(bytes, '\0');
    weight_map[t.name] = file;
  }
  std::ofstream(dir / kSafetensorsIndexName) << nlohmann::json{{"weight_map", weight_map}}.dump();
}

SafetensorsWriteDtype source_dtype_of(const fs::path& dir, const ParamLayout& layout,
                                      const nlohmann::json& config_json = nlohmann::json::object()) {
  Result<SafetensorsReader> r = open_hf_weights(dir.string(), layout);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  if (!r.ok()) return SafetensorsWriteDtype::kF32;
  return hf_source_dtype(*r, layout, config_json);
}

TEST(HfDtypeTest, NamesParseAndPrintBothWays) {
  for (SafetensorsWriteDtype d : {SafetensorsWriteDtype::kF32, SafetensorsWriteDtype::kBF16, SafetensorsWriteDtype::kF16}) {
    EXPECT_EQ(parse_export_dtype(export_dtype_name(d)), d);
    EXPECT_EQ(parse_torch_dtype(torch_dtype_name(d)), d);
  }
  EXPECT_STREQ(torch_dtype_name(SafetensorsWriteDtype::kBF16), "bfloat16");
  EXPECT_STREQ(safetensors_dtype_name(SafetensorsWriteDtype::kF16), "F16");
  EXPECT_FALSE(parse_export_dtype("fp8").has_value());
  EXPECT_FALSE(parse_torch_dtype("float8_e4m3fn").has_value());
}

TEST(HfDtypeTest, SourceDtypeIsTheNarrowestThatHoldsEveryTensor) {
  const ModelConfig config = tiny_config();
  const ParamLayout layout(config);
  const auto all = [](const char* d) { return [d](const TensorSpec&) { return std::string(d); }; };
  struct Expect {
    const char* name;
    std::function<std::string(const TensorSpec&)> dtype_of;
    SafetensorsWriteDtype want;
  };
  const std::vector<Expect> expects = {
      {"bf16", all("BF16"), SafetensorsWriteDtype::kBF16},
      {"f16", all("F16"), SafetensorsWriteDtype::kF16},
      {"f32", all("F32"), SafetensorsWriteDtype::kF32},
      // fp32 norms beside bf16 matrices: only f32 keeps both.
      {"bf16_f32_norms", [](const TensorSpec& t) { return std::string(t.shape.size() == 1 ? "F32" : "BF16"); },
       SafetensorsWriteDtype::kF32},
      {"bf16_and_f16", [](const TensorSpec& t) { return std::string(t.shape.size() == 1 ? "F16" : "BF16"); },
       SafetensorsWriteDtype::kF32},
      // FP8 matrices with bf16 norms: bf16 holds both exactly.
      {"fp8_bf16_norms", [](const TensorSpec& t) { return std::string(t.shape.size() == 1 ? "BF16" : "F8_E4M3"); },
       SafetensorsWriteDtype::kBF16},
  };
  for (const Expect& e : expects) {
    const fs::path dir = fresh_dir(e.name);
    write_checkpoint(dir, layout, e.dtype_of);
    // config.json's torch_dtype does not override what the tensors say.
    EXPECT_EQ(source_dtype_of(dir, layout, {{"torch_dtype", "float32"}}), e.want) << e.name;
  }
}

TEST(HfDtypeTest, ConfigTorchDtypeChoosesWhereTheTensorsFitSeveral) {
  const ModelConfig config = tiny_config();
  const ParamLayout layout(config);
  const fs::path dir = fresh_dir("fp8");
  write_checkpoint(dir, layout, [](const TensorSpec&) { return std::string("F8_E5M2"); });
  EXPECT_EQ(source_dtype_of(dir, layout), SafetensorsWriteDtype::kBF16);
  EXPECT_EQ(source_dtype_of(dir, layout, {{"torch_dtype", "float16"}}), SafetensorsWriteDtype::kF16);
  EXPECT_EQ(source_dtype_of(dir, layout, {{"dtype", "float32"}}), SafetensorsWriteDtype::kF32);  // the newer key
  EXPECT_EQ(source_dtype_of(dir, layout, {{"torch_dtype", "int8"}}), SafetensorsWriteDtype::kBF16);
}

TEST(HfDtypeTest, F16ExportWritesHalvesAndSaysFloat16) {
  const ModelConfig config = tiny_config();
  const ParamLayout layout(config);
  std::vector<float> params(static_cast<size_t>(layout.total_size()));
  init_weights(layout, params.data(), 3);
  params[0] = 70000.0f;  // beyond half's range: infinity, as torch's .half() makes it
  params[1] = 1e-9f;     // below its smallest subnormal: zero
  const fs::path out = fresh_dir("export");
  ExportOptions eo;
  eo.dtype = SafetensorsWriteDtype::kF16;
  ASSERT_TRUE(export_hf(out.string(), config, layout, params.data(), eo).ok());
  std::ifstream in(out / "config.json");
  EXPECT_EQ(nlohmann::json::parse(in, nullptr, false)["torch_dtype"], "float16");
  Result<SafetensorsReader> r = SafetensorsReader::open(out.string());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  for (const SafetensorsTensorInfo& t : r->tensors()) {
    EXPECT_EQ(t.dtype, "F16") << t.name;
    EXPECT_EQ(t.nbytes, 2 * t.numel) << t.name;
  }
  EXPECT_EQ(hf_source_dtype(*r, layout), SafetensorsWriteDtype::kF16);  // so a re-export keeps it
  std::vector<float> back(params.size());
  ASSERT_TRUE(load_hf_weights(out.string(), layout, back.data()).ok());
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_EQ(back[i], f16_to_f32(f32_to_f16(params[i]))) << i;
  }
  EXPECT_EQ(back[0], INFINITY);
  EXPECT_EQ(back[1], 0.0f);
}

}  // namespace
}  // namespace strata::model
