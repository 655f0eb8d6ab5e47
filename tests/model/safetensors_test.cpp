#include "model/safetensors_min.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/llama.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

std::string test_dir() {
  const fs::path dir = fs::path(STRATA_BINARY_DIR) / "tests" / "model_safetensors";
  fs::create_directories(dir);
  return dir.string();
}

ModelConfig small_config() {
  ModelConfig c;
  c.vocab_size = 19;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.max_position_embeddings = 32;
  c.fill_defaults();
  return c;
}

// Writes every tensor of the model's layout except `skip`, replacing the shape of `reshape`.
Status save_model(const LlamaModel& model, const std::string& path, const std::string& skip = "",
                  const std::string& reshape = "") {
  std::vector<SafetensorsTensor> tensors;
  for (const TensorSpec& t : model.layout().tensors()) {
    if (t.name == skip) continue;
    std::vector<int64_t> shape = t.shape;
    if (t.name == reshape) shape = {t.numel};
    tensors.push_back({t.name, shape, model.params() + t.offset});
  }
  return write_safetensors_f32(path, tensors);
}

// A file with one tensor of the given dtype and raw bytes, written by hand.
void write_raw(const std::string& path, const std::string& name, const std::string& dtype,
               const std::vector<int64_t>& shape, const std::vector<uint8_t>& bytes) {
  std::string shape_text;
  for (size_t i = 0; i < shape.size(); ++i) shape_text += (i ? "," : "") + std::to_string(shape[i]);
  std::string header = "{\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":[" + shape_text +
                       "],\"data_offsets\":[0," + std::to_string(bytes.size()) + "]}}";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary);
  const uint64_t len = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(len >> (8 * i)));
  out << header;
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

void expect_error(const Status& st, StatusCode code, const std::vector<std::string>& mentions) {
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), code) << st.to_string();
  for (const auto& m : mentions) EXPECT_NE(st.message().find(m), std::string::npos) << st.to_string();
}

TEST(SafetensorsTest, SavedWeightsLoadBackBitwise) {
  const std::string path = test_dir() + "/roundtrip.safetensors";
  LlamaModel a(small_config()), b(small_config());
  a.init_weights(17);
  ASSERT_TRUE(save_model(a, path).ok());
  EXPECT_EQ(fs::file_size(path) % 4, 0u);
  Status st = b.load_safetensors(path);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(std::memcmp(a.params(), b.params(), sizeof(float) * a.layout().total_size()), 0);
}

TEST(SafetensorsTest, MissingTensorNamesFileAndTensor) {
  const std::string path = test_dir() + "/missing.safetensors";
  LlamaModel model(small_config());
  model.init_weights(1);
  ASSERT_TRUE(save_model(model, path, "model.layers.1.mlp.up_proj.weight").ok());
  LlamaModel fresh(small_config());
  Status st = fresh.load_safetensors(path);
  expect_error(st, StatusCode::kNotFound, {path, "model.layers.1.mlp.up_proj.weight"});
  // A failed load leaves the parameters untouched.
  const float* p = fresh.params();
  EXPECT_TRUE(std::all_of(p, p + fresh.layout().total_size(), [](float x) { return x == 0.0f; }));
}

TEST(SafetensorsTest, WrongShapeNamesFileAndTensor) {
  const std::string path = test_dir() + "/shape.safetensors";
  LlamaModel model(small_config());
  ASSERT_TRUE(save_model(model, path, "", "model.layers.0.self_attn.v_proj.weight").ok());
  expect_error(model.load_safetensors(path), StatusCode::kInvalidArgument,
               {path, "model.layers.0.self_attn.v_proj.weight", "[128]", "[8, 16]"});
}

TEST(SafetensorsTest, TruncatedFileIsCorruption) {
  const std::string path = test_dir() + "/truncated.safetensors";
  LlamaModel model(small_config());
  ASSERT_TRUE(save_model(model, path).ok());
  fs::resize_file(path, fs::file_size(path) - 10);
  expect_error(model.load_safetensors(path), StatusCode::kCorruption, {path, "lm_head.weight", "truncated"});
  fs::resize_file(path, 5);
  expect_error(model.load_safetensors(path), StatusCode::kCorruption, {path});
}

TEST(SafetensorsTest, UnsupportedDtypeNamesFileAndTensor) {
  const std::string path = test_dir() + "/int64.safetensors";
  write_raw(path, "w", "I64", {2}, std::vector<uint8_t>(16, 0));
  Result<SafetensorsReader> r = SafetensorsReader::open(path);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  float out[2];
  expect_error(r->read_f32("w", {2}, out), StatusCode::kUnimplemented, {path, "'w'", "I64"});
}

TEST(SafetensorsTest, SizeNotMatchingShapeIsCorruption) {
  const std::string path = test_dir() + "/short.safetensors";
  write_raw(path, "w", "F32", {3}, std::vector<uint8_t>(8, 0));
  expect_error(SafetensorsReader::open(path).status(), StatusCode::kCorruption, {path, "'w'"});
}

TEST(SafetensorsTest, ReadsBf16AndF16AsFloat32) {
  const std::string path = test_dir() + "/half.safetensors";
  // bf16 1.0 = 0x3F80, -2.5 = 0xC020; f16 1.0 = 0x3C00, -2.5 = 0xC100, 2^-24 = 0x0001.
  write_raw(path, "b", "BF16", {2}, {0x80, 0x3F, 0x20, 0xC0});
  Result<SafetensorsReader> r = SafetensorsReader::open(path);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  float b[2];
  ASSERT_TRUE(r->read_f32("b", {2}, b).ok());
  EXPECT_EQ(b[0], 1.0f);
  EXPECT_EQ(b[1], -2.5f);

  write_raw(path, "h", "F16", {3}, {0x00, 0x3C, 0x00, 0xC1, 0x01, 0x00});
  Result<SafetensorsReader> h = SafetensorsReader::open(path);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  float f[3];
  ASSERT_TRUE(h->read_f32("h", {3}, f).ok());
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], -2.5f);
  EXPECT_EQ(f[2], std::ldexp(1.0f, -24));
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  const std::string path = test_dir() + "/does-not-exist.safetensors";
  expect_error(SafetensorsReader::open(path).status(), StatusCode::kNotFound, {path});
}

}  // namespace
}  // namespace strata::model
