// parse_safetensors_header: a header whose shape does not account for its bytes is refused,
// even when the element count would wrap around 64 bits; the slices __metadata__ records are
// read back as written, and refused when they do not fit their entry or their tensor.
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

TEST(SafetensorsHeaderTest, SlicesRoundTripThroughTheMetadata) {
  std::vector<HeaderEntry> entries = {
      {"a", DType::kF32, {6}, 0, 24, HeaderSlice{4, 6, {5, 2}}},
      {"adam_m/b", DType::kBF16, {3, 2}, 24, 36, std::nullopt},
  };
  const std::string header = build_safetensors_header(entries, {{"format", "pt"}});
  ASSERT_EQ(header.size() % kFileAlign, 0u);
  auto h = parse_safetensors_header("x.safetensors", header.substr(0, 8), header.substr(8), header.size() + 36);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_EQ(h->entries.size(), 2u);
  ASSERT_TRUE(h->entries[0].slice.has_value());
  EXPECT_EQ(h->entries[0].slice->first, 4u);
  EXPECT_EQ(h->entries[0].slice->count, 6u);
  EXPECT_EQ(h->entries[0].slice->whole_shape, (std::vector<int64_t>{5, 2}));
  EXPECT_FALSE(h->entries[1].slice.has_value());
  EXPECT_EQ(h->metadata.at("format"), "pt");
  // Without slices the metadata has no such key: files of unsliced saves are as before.
  entries[0].slice.reset();
  EXPECT_EQ(build_safetensors_header(entries, {}).find(kSlicesMetadataKey), std::string::npos);
}

TEST(SafetensorsHeaderTest, SlicesThatDoNotFitTheirEntryOrTensorAreRefused) {
  const std::string entry = R"("a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]})";
  auto with = [&](const std::string& slices) {
    std::string prefix(8, '\0');
    const std::string json_text = R"({"__metadata__":{"strata_slices":)" + slices + "}," + entry + "}";
    for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((json_text.size() >> (8 * i)) & 0xff);
    return parse_safetensors_header("x.safetensors", prefix, json_text, 8 + json_text.size() + 12);
  };
  EXPECT_TRUE(with(R"("{\"a\":[7,3,[10]]}")").ok());
  for (const std::string& bad : {
           std::string(R"({"a":[7,3,[10]]})"),           // an object, not a string
           std::string(R"("not json")"),                 // not JSON
           std::string(R"("{\"b\":[0,3,[3]]}")"),        // names no entry of the file
           std::string(R"("{\"a\":[0,3]}")"),            // no shape
           std::string(R"("{\"a\":[8,3,[10]]}")"),       // past the tensor's 10 elements
           std::string(R"("{\"a\":[0,0,[10]]}")"),       // empty
           std::string(R"("{\"a\":[0,2,[10]]}")"),       // 2 elements, but the entry holds 3
           std::string(R"("{\"a\":[0,3,[-1]]}")"),       // a negative dimension
           std::string(R"("{\"a\":[0,3,[4294967296,4294967296]]}")"),  // a count past 2^64
       }) {
    auto h = with(bad);
    ASSERT_FALSE(h.ok()) << bad;
    EXPECT_EQ(h.status().code(), StatusCode::kCorruption) << bad;
    EXPECT_NE(h.status().message().find("x.safetensors"), std::string::npos) << h.status().message();
  }
}

}  // namespace
}  // namespace strata::ckpt
