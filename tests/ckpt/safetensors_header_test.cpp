// parse_safetensors_header: a header whose shape does not account for its bytes is refused,
// even when the element count would wrap around 64 bits.
#include <gtest/gtest.h>

#include "ckpt/format.h"

namespace strata::ckpt {
namespace {

// The 8-byte length prefix, the JSON, and the file size of a header with no data after it.
Result<ParsedHeader> parse(const std::string& json_text) {
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((json_text.size() >> (8 * i)) & 0xff);
  return parse_safetensors_header("x.safetensors", prefix, json_text, 8 + json_text.size());
}

TEST(SafetensorsHeaderTest, EmptyTensorIsAccepted) {
  auto h = parse(R"({"a":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]}})");
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  EXPECT_EQ(h->entries.size(), 1u);
}

TEST(SafetensorsHeaderTest, ShapeWhoseElementCountWrapsIsRefused) {
  // 2^62 * 4 elements is 0 modulo 2^64, and so are its bytes: the tensor must not pass as empty.
  auto h = parse(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})");
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("tensor 'a'"), std::string::npos) << h.status().to_string();
}

TEST(SafetensorsHeaderTest, ByteCountThatWrapsIsRefused) {
  // 2^62 F32 elements are 2^64 bytes, also 0 modulo 2^64.
  auto h = parse(R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})");
  EXPECT_FALSE(h.ok());
}

TEST(SafetensorsHeaderTest, DimensionBeyondInt64IsRefused) {
  auto h = parse(R"({"a":{"dtype":"F32","shape":[9223372036854775808,0],"data_offsets":[0,0]}})");
  EXPECT_FALSE(h.ok());
}

}  // namespace
}  // namespace strata::ckpt
