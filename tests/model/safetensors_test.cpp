// safetensors reader and writer: round trips in F32 and BF16, single and sharded, the dtype
// conversions against the specs, files written by Python's `safetensors` package, and every kind
// of bad input yielding a Status that names the file and the tensor.
#include "model/safetensors.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/io_engine.h"
#include "core/io_faulty.h"
#include "model/hf_io.h"
#include "model/params.h"
#include "../test_util.h"
#include "reference_util.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;


// A fresh directory per test.
std::string test_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir = fs::path(STRATA_BINARY_DIR) / "tests" / "model_safetensors" / info->name();
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

std::vector<uint8_t> bytes_of(const float* p, size_t n) {
  std::vector<uint8_t> b(n * 4);
  std::memcpy(b.data(), p, b.size());
  return b;
}

// A safetensors file written by hand: `header` is the JSON text, `data` the data section.
void write_raw(const std::string& path, std::string header, const std::vector<uint8_t>& data,
               uint64_t length_override = 0) {
  header.append((8 - header.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary);
  const uint64_t len = length_override ? length_override : header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(len >> (8 * i)));
  out << header;
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

// One tensor named `name` of `dtype`/`shape` covering all of `data`.
void write_one(const std::string& path, const std::string& name, const std::string& dtype,
               const std::string& shape, const std::vector<uint8_t>& data) {
  write_raw(path,
            "{\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[0," +
                std::to_string(data.size()) + "]}}",
            data);
}

void expect_error(const Status& st, StatusCode code, const std::vector<std::string>& mentions) {
  ASSERT_FALSE(st.ok()) << "expected an error mentioning " << (mentions.empty() ? "" : mentions[0]);
  EXPECT_EQ(st.code(), code) << st.to_string();
  for (const auto& m : mentions) EXPECT_NE(st.message().find(m), std::string::npos) << st.to_string();
}

bool python_has(const std::string& modules) {
  const std::string cmd = std::string(kReferencePython) + " -c 'import " + modules + "' >/dev/null 2>&1";
  return fs::exists(kReferencePython) && std::system(cmd.c_str()) == 0;
}

// ---- conversions ----------------------------------------------------------------------------

TEST(SafetensorsTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f), 0x3F80);           // tie, even below
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3F82);       // tie, even above
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);  // just above the tie
  EXPECT_EQ(f32_to_bf16(-(1.0f + 0x1p-8f)), 0xBF80);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // overflows to inf
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x00010000u)), 0x0001);  // subnormal
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // A signalling NaN whose payload sits in the low bits must not round to infinity.
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::bit_cast<float>(0x7F800001u)))));
}

TEST(SafetensorsTest, F16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f), 0x3C00);             // tie, even below
  EXPECT_EQ(f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3C02);         // tie, even above
  EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f + 0x1p-20f), 0x3C01);  // just above the tie
  EXPECT_EQ(f32_to_f16(-2.0f), 0xC000);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFF);                    // the largest finite
  EXPECT_EQ(f32_to_f16(65519.996f), 0x7BFF);                  // just below the tie with infinity
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00);                    // the tie goes to even: infinity
  EXPECT_EQ(f32_to_f16(-1e10f), 0xFC00);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(f32_to_f16(0x1p-14f), 0x0400);                    // the smallest normal
  EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);                    // the smallest subnormal
  EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);                    // half of it: a tie, even is zero
  EXPECT_EQ(f32_to_f16(0x1p-25f + 0x1p-40f), 0x0001);
  EXPECT_EQ(f32_to_f16(3 * 0x1p-25f), 0x0002);                // tie between 1 and 2 units: 2
  EXPECT_EQ(f32_to_f16(0x1p-14f - 0x1p-25f), 0x0400);         // tie between 1023 units and 2^-14
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(std::bit_cast<float>(0x7F800001u)))));
  // Every finite half round-trips, and the midpoint between neighbours goes to the even one.
  for (uint32_t h = 0; h < 0x7C00; ++h) {
    for (uint16_t sign : {uint16_t{0}, uint16_t{0x8000}}) {
      const auto code = static_cast<uint16_t>(h | sign);
      const float v = f16_to_f32(code);
      ASSERT_EQ(f32_to_f16(v), code) << std::hex << code;
      if (h + 1 == 0x7C00) continue;  // the tie above 65504 is checked above
      const float next = f16_to_f32(static_cast<uint16_t>((h + 1) | sign));
      const float mid = v + (next - v) / 2;  // exact in fp32
      const auto even = static_cast<uint16_t>(((h & 1) ? h + 1 : h) | sign);
      ASSERT_EQ(f32_to_f16(mid), even) << "midpoint after " << std::hex << code;
    }
  }
}

TEST(SafetensorsTest, Fp8DecodesEveryCodeAsTheOcpSpecSays) {
  for (int code = 0; code < 256; ++code) {
    const uint8_t b = static_cast<uint8_t>(code);
    const double sign = (b & 0x80) ? -1.0 : 1.0;
    // E4M3: bias 7, subnormals at exponent 0, S.1111.111 is NaN, no infinities.
    const int e4 = (b >> 3) & 0xF, m3 = b & 7;
    const float e4m3 = fp8_e4m3_to_f32(b);
    if (e4 == 15 && m3 == 7) {
      EXPECT_TRUE(std::isnan(e4m3)) << code;
    } else {
      const double want = sign * (e4 == 0 ? std::ldexp(m3 / 8.0, -6) : std::ldexp(1.0 + m3 / 8.0, e4 - 7));
      EXPECT_EQ(e4m3, static_cast<float>(want)) << "E4M3 code " << code;
    }
    // E5M2: bias 15, IEEE-like infinities and NaNs.
    const int e5 = (b >> 2) & 0x1F, m2 = b & 3;
    const float e5m2 = fp8_e5m2_to_f32(b);
    if (e5 == 31) {
      if (m2 == 0) {
        EXPECT_EQ(e5m2, static_cast<float>(sign * INFINITY)) << code;
      } else {
        EXPECT_TRUE(std::isnan(e5m2)) << code;
      }
    } else {
      const double want = sign * (e5 == 0 ? std::ldexp(m2 / 4.0, -14) : std::ldexp(1.0 + m2 / 4.0, e5 - 15));
      EXPECT_EQ(e5m2, static_cast<float>(want)) << "E5M2 code " << code;
    }
  }
  // Landmarks from the spec.
  EXPECT_EQ(fp8_e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), 0x1p-9f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0xFF)));
  EXPECT_EQ(fp8_e5m2_to_f32(0x7B), 57344.0f);
  EXPECT_EQ(fp8_e5m2_to_f32(0x3C), 1.0f);
  EXPECT_EQ(fp8_e5m2_to_f32(0x01), 0x1p-16f);
  EXPECT_EQ(fp8_e5m2_to_f32(0xFC), -INFINITY);
}

TEST(SafetensorsTest, ReadsEveryConvertibleDtypeAsFloat32) {
  const std::string dir = test_dir();
  std::vector<uint8_t> all(256);
  for (int i = 0; i < 256; ++i) all[static_cast<size_t>(i)] = static_cast<uint8_t>(i);
  for (const char* dtype : {"F8_E4M3", "F8_E5M2"}) {
    const std::string path = dir + "/" + dtype + ".safetensors";
    write_one(path, "w", dtype, "[16,16]", all);
    Result<SafetensorsReader> r = SafetensorsReader::open(path);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    std::vector<float> out(256);
    ASSERT_TRUE(r->read_f32("w", {16, 16}, out.data()).ok());
    for (int i = 0; i < 256; ++i) {
      const float want = std::string(dtype) == "F8_E4M3" ? fp8_e4m3_to_f32(all[i]) : fp8_e5m2_to_f32(all[i]);
      EXPECT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(want)) << dtype << " code " << i;
    }
  }
  // bf16 1.0 = 0x3F80, -2.5 = 0xC020; f16 1.0 = 0x3C00, -2.5 = 0xC100, 2^-24 = 0x0001, inf = 0x7C00.
  const std::string path = dir + "/half.safetensors";
  write_raw(path,
            R"({"b":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
            R"("h":{"dtype":"F16","shape":[4],"data_offsets":[4,12]}})",
            {0x80, 0x3F, 0x20, 0xC0, 0x00, 0x3C, 0x00, 0xC1, 0x01, 0x00, 0x00, 0x7C});
  Result<SafetensorsReader> r = SafetensorsReader::open(path);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  float b[2], h[4];
  ASSERT_TRUE(r->read_f32("b", {2}, b).ok());
  ASSERT_TRUE(r->read_f32("h", {4}, h).ok());
  EXPECT_EQ(b[0], 1.0f);
  EXPECT_EQ(b[1], -2.5f);
  EXPECT_EQ(h[0], 1.0f);
  EXPECT_EQ(h[1], -2.5f);
  EXPECT_EQ(h[2], std::ldexp(1.0f, -24));
  EXPECT_EQ(h[3], INFINITY);
}

// ---- round trips ----------------------------------------------------------------------------

TEST(SafetensorsTest, F32RoundTripIsBitwiseWithMetadataScalarsAndEmptyTensors) {
  const std::string path = test_dir() + "/a.safetensors";
  const std::vector<float> w = testing::random_vector(35, 1);
  const float scalar = 2.5f;
  std::vector<SafetensorsWriteTensor> tensors = {{"w", {5, 7}, w.data()}, {"s", {}, &scalar}, {"e", {0, 4}, nullptr}};
  WriterOptions wo;
  wo.metadata = {{"format", "pt"}, {"step", "12"}};
  ASSERT_TRUE(write_safetensors_file(path, tensors, wo).ok());
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  std::ifstream in(path, std::ios::binary);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(fs::file_size(path), 8 + header_len + 36 * 4);

  Result<SafetensorsReader> r = SafetensorsReader::open(path);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r->tensors().size(), 3u);
  EXPECT_EQ(r->metadata().at("step"), "12");
  std::vector<float> back(35);
  ASSERT_TRUE(r->read_f32("w", {5, 7}, back.data()).ok());
  EXPECT_EQ(bytes_of(back.data(), 35), bytes_of(w.data(), 35));
  float s = 0;
  ASSERT_TRUE(r->read_f32("s", {}, &s).ok());
  EXPECT_EQ(s, 2.5f);
  const SafetensorsTensorInfo* e = r->find("e");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->numel, 0);
  EXPECT_TRUE(r->read_f32("e", {0, 4}, nullptr).ok());
}

TEST(SafetensorsTest, Bf16WriteStoresRoundedValuesInTwoBytes) {
  const std::string path = test_dir() + "/b.safetensors";
  std::vector<float> w = testing::random_vector(1000, 2, -50, 50);
  w[0] = 1.0f + 0x1p-8f;
  WriterOptions wo;
  wo.dtype = SafetensorsWriteDtype::kBF16;
  wo.piece_bytes = 24;  // many pieces
  ASSERT_TRUE(write_safetensors_file(path, {{"w", {10, 100}, w.data()}}, wo).ok());
  ReaderOptions ro;
  ro.piece_bytes = 40;
  Result<SafetensorsReader> r = SafetensorsReader::open(path, ro);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->find("w")->dtype, "BF16");
  EXPECT_EQ(r->find("w")->nbytes, 2000);
  std::vector<float> back(1000);
  ASSERT_TRUE(r->read_f32("w", {10, 100}, back.data()).ok());
  for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(back[i], bf16_to_f32(f32_to_bf16(w[i]))) << i;
  EXPECT_EQ(back[0], 1.0f);
}

TEST(SafetensorsTest, ReadsInBoundedPiecesGiveTheSameValues) {
  const std::string path = test_dir() + "/p.safetensors";
  const std::vector<float> w = testing::random_vector(1001, 3);
  ASSERT_TRUE(write_safetensors_file(path, {{"w", {1001}, w.data()}}).ok());
  for (int64_t piece : {8, 12, 4000, 1 << 20}) {
    ReaderOptions ro;
    ro.piece_bytes = piece;
    Result<SafetensorsReader> r = SafetensorsReader::open(path, ro);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    std::vector<float> back(1001);
    ASSERT_TRUE(r->read_f32("w", back.data()).ok());
    EXPECT_EQ(bytes_of(back.data(), back.size()), bytes_of(w.data(), w.size())) << "piece " << piece;
  }
}

TEST(SafetensorsTest, ReadsThroughAnIoEngineAndReportsItsFailures) {
  const std::string path = test_dir() + "/io.safetensors";
  const std::vector<float> w = testing::random_vector(5000, 4);
  WriterOptions wo;
  wo.dtype = SafetensorsWriteDtype::kBF16;
  ASSERT_TRUE(write_safetensors_file(path, {{"a", {5000}, w.data()}, {"b", {5000}, w.data()}}, wo).ok());
  IoEngineOptions io_options;
  io_options.kind = "threads";
  Result<std::unique_ptr<IoEngine>> inner = make_io_engine(io_options);
  ASSERT_TRUE(inner.ok()) << inner.status().to_string();
  FaultOptions faults;
  faults.short_read.every = 2;   // every other read comes back short and must be resumed
  faults.eio_read.every = 7;     // the 7th read fails
  faults.granularity = 8;
  Result<std::unique_ptr<FaultyIoEngine>> engine = FaultyIoEngine::create(std::move(inner).value(), faults);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  ReaderOptions ro;
  ro.io = engine->get();
  ro.piece_bytes = 2048;  // 5 pieces per tensor
  Result<SafetensorsReader> r = SafetensorsReader::open(path, ro);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  std::vector<float> back(5000);
  ASSERT_TRUE(r->read_f32("a", {5000}, back.data()).ok());
  for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(back[i], bf16_to_f32(f32_to_bf16(w[i]))) << i;
  expect_error(r->read_f32("b", {5000}, back.data()), StatusCode::kIOError, {path, "'b'"});
}

TEST(SafetensorsTest, ShardedRoundTripWritesHuggingFaceNamesAndIndex) {
  const std::string dir = test_dir() + "/ckpt";
  std::vector<std::vector<float>> data;
  std::vector<SafetensorsWriteTensor> tensors;
  for (int i = 0; i < 5; ++i) data.push_back(testing::random_vector(100 * (i + 1), 10 + i));
  for (int i = 0; i < 5; ++i) tensors.push_back({"t" + std::to_string(i), {i + 1, 100}, data[i].data()});
  WriterOptions wo;
  wo.max_shard_bytes = 1200;  // t0 (400 B) + t1 (800 B) fit; each later tensor needs its own
  ASSERT_TRUE(write_safetensors_dir(dir, tensors, wo).ok());
  for (int k = 1; k <= 4; ++k) {
    EXPECT_TRUE(fs::exists(fmt::format("{}/model-{:05d}-of-00004.safetensors", dir, k))) << k;
  }
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  std::ifstream in(dir + "/model.safetensors.index.json");
  const nlohmann::json index = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(index.is_discarded());
  EXPECT_EQ(index["metadata"]["total_size"], 1500 * 4);
  EXPECT_EQ(index["weight_map"]["t0"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["t1"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["t4"], "model-00004-of-00004.safetensors");

  for (const std::string& open_path : {dir, dir + "/model.safetensors.index.json"}) {
    Result<SafetensorsReader> r = SafetensorsReader::open(open_path);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->files().size(), 4u);
    ASSERT_EQ(r->tensors().size(), 5u);
    for (int i = 0; i < 5; ++i) {
      std::vector<float> back(data[i].size());
      ASSERT_TRUE(r->read_f32("t" + std::to_string(i), {i + 1, 100}, back.data()).ok());
      EXPECT_EQ(bytes_of(back.data(), back.size()), bytes_of(data[i].data(), data[i].size())) << i;
    }
  }

  // Everything in one shard: a single model.safetensors and no index.
  const std::string single = test_dir() + "/single";
  ASSERT_TRUE(write_safetensors_dir(single, tensors).ok());
  EXPECT_TRUE(fs::exists(single + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(single + "/model.safetensors.index.json"));
  Result<SafetensorsReader> r = SafetensorsReader::open(single);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->tensors().size(), 5u);
}

// ---- bad inputs -----------------------------------------------------------------------------

TEST(SafetensorsTest, MissingShardNamesShardIndexAndTensor) {
  const std::string dir = test_dir() + "/ckpt";
  const std::vector<float> a(100, 1.0f), b(100, 2.0f);
  WriterOptions wo;
  wo.max_shard_bytes = 400;
  ASSERT_TRUE(write_safetensors_dir(dir, {{"a", {100}, a.data()}, {"b", {100}, b.data()}}, wo).ok());
  fs::remove(dir + "/model-00002-of-00002.safetensors");
  expect_error(SafetensorsReader::open(dir).status(), StatusCode::kNotFound,
               {"model-00002-of-00002.safetensors listed in model.safetensors.index.json for tensor 'b' is missing"});
}

TEST(SafetensorsTest, IndexEntryAbsentFromItsShardIsCorruption) {
  const std::string dir = test_dir();
  const std::vector<float> a(4, 1.0f);
  ASSERT_TRUE(write_safetensors_file(dir + "/s1.safetensors", {{"a", {4}, a.data()}}).ok());
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"metadata":{},"weight_map":{"a":"s1.safetensors","ghost":"s1.safetensors"}})";
  expect_error(SafetensorsReader::open(dir).status(), StatusCode::kCorruption, {"s1.safetensors", "'ghost'"});
}

TEST(SafetensorsTest, HeaderThatLiesAboutSizesNamesFileAndTensor) {
  const std::string path = test_dir() + "/lie.safetensors";
  write_one(path, "w", "F32", "[3]", std::vector<uint8_t>(8, 0));
  expect_error(SafetensorsReader::open(path).status(), StatusCode::kCorruption, {path, "'w'", "12"});
}

TEST(SafetensorsTest, HolesOverlapsAndTrailingBytesAreCorruption) {
  const std::string dir = test_dir();
  const std::string hole = dir + "/hole.safetensors";
  write_raw(hole,
            R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
            R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
            std::vector<uint8_t>(12, 0));
  expect_error(SafetensorsReader::open(hole).status(), StatusCode::kCorruption, {hole, "'b'", "hole"});

  const std::string overlap = dir + "/overlap.safetensors";
  write_raw(overlap,
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
            std::vector<uint8_t>(8, 0));
  expect_error(SafetensorsReader::open(overlap).status(), StatusCode::kCorruption, {overlap, "'b'", "overlap", "'a'"});

  const std::string trailing = dir + "/trailing.safetensors";
  write_one(trailing, "w", "F32", "[2]", std::vector<uint8_t>(8, 0));
  {
    std::ofstream out(trailing, std::ios::binary | std::ios::app);
    out << "junk";
  }
  expect_error(SafetensorsReader::open(trailing).status(), StatusCode::kCorruption, {trailing, "'w'", "file size"});
}

TEST(SafetensorsTest, TruncatedFilesAndBadHeadersAreCorruption) {
  const std::string dir = test_dir();
  const std::string path = dir + "/t.safetensors";
  const std::vector<float> a(10, 1.0f), b(10, 2.0f);
  ASSERT_TRUE(write_safetensors_file(path, {{"a", {10}, a.data()}, {"last", {10}, b.data()}}).ok());
  fs::resize_file(path, fs::file_size(path) - 10);
  expect_error(SafetensorsReader::open(path).status(), StatusCode::kCorruption, {path, "'last'", "truncated"});
  fs::resize_file(path, 5);
  expect_error(SafetensorsReader::open(path).status(), StatusCode::kCorruption, {path, "too short"});

  const std::string huge = dir + "/huge.safetensors";
  write_raw(huge, "{}", {}, /*length_override=*/uint64_t{1} << 40);
  expect_error(SafetensorsReader::open(huge).status(), StatusCode::kCorruption, {huge, "header length"});

  const std::string beyond = dir + "/beyond.safetensors";
  write_raw(beyond, "{}", {}, /*length_override=*/4096);
  expect_error(SafetensorsReader::open(beyond).status(), StatusCode::kCorruption, {beyond, "does not fit"});

  const std::string garbage = dir + "/garbage.safetensors";
  write_raw(garbage, "{\"w\": [1, 2", {});
  expect_error(SafetensorsReader::open(garbage).status(), StatusCode::kCorruption, {garbage, "JSON"});

  const std::string no_offsets = dir + "/no_offsets.safetensors";
  write_raw(no_offsets, R"({"w":{"dtype":"F32","shape":[1]}})", std::vector<uint8_t>(4, 0));
  expect_error(SafetensorsReader::open(no_offsets).status(), StatusCode::kCorruption, {no_offsets, "'w'"});
}

TEST(SafetensorsTest, UnsupportedDtypeMissingTensorAndWrongShapeNameFileAndTensor) {
  const std::string path = test_dir() + "/i64.safetensors";
  write_one(path, "ids", "I64", "[2]", std::vector<uint8_t>(16, 0));
  Result<SafetensorsReader> r = SafetensorsReader::open(path);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  float out[2] = {7, 7};
  expect_error(r->read_f32("ids", {2}, out), StatusCode::kUnimplemented, {path, "'ids'", "I64"});
  expect_error(r->read_f32("nope", {2}, out), StatusCode::kNotFound, {path, "'nope'"});
  expect_error(r->read_f32("ids", {1, 2}, out), StatusCode::kInvalidArgument, {path, "'ids'", "[2]", "[1, 2]"});
  EXPECT_EQ(out[0], 7.0f);
  uint64_t raw[2] = {1, 1};
  EXPECT_TRUE(r->read_raw("ids", raw).ok());
  EXPECT_EQ(raw[0], 0u);
}

TEST(SafetensorsTest, MissingFileOrDirectoryIsNotFound) {
  const std::string dir = test_dir();
  expect_error(SafetensorsReader::open(dir + "/does-not-exist.safetensors").status(), StatusCode::kNotFound,
               {"does-not-exist.safetensors"});
  expect_error(SafetensorsReader::open(dir).status(), StatusCode::kNotFound, {dir, "model.safetensors"});
}

// ---- interoperability -----------------------------------------------------------------------

TEST(SafetensorsTest, ReadsFileWrittenByPythonSafetensorsAndMatchesTorchBf16Rounding) {
  if (!python_has("torch, safetensors")) {
    GTEST_SKIP() << kReferencePython << " cannot import torch and safetensors; this test compares with them";
  }
  const std::string dir = test_dir();
  const std::string path = dir + "/python.safetensors";
  const std::string cmd = std::string(kReferencePython) + " " + STRATA_SOURCE_DIR + "/tests/model/hf_reference.py safetensors " +
                          path + " >" + dir + "/python.log 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "see " << dir << "/python.log";
  Result<SafetensorsReader> r = SafetensorsReader::open(path);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->metadata().count("note"), 1u);
  EXPECT_EQ(r->find("f32")->shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(r->find("f16")->dtype, "F16");
  EXPECT_EQ(r->find("scalar")->shape, std::vector<int64_t>{});
  EXPECT_EQ(r->find("empty")->numel, 0);

  float scalar = 0;
  ASSERT_TRUE(r->read_f32("scalar", {}, &scalar).ok());
  EXPECT_EQ(scalar, 2.5f);
  std::vector<float> f16(24), f16_as_f32(24);
  ASSERT_TRUE(r->read_f32("f16", {2, 3, 4}, f16.data()).ok());
  ASSERT_TRUE(r->read_f32("f16_as_f32", {2, 3, 4}, f16_as_f32.data()).ok());
  EXPECT_EQ(bytes_of(f16.data(), 24), bytes_of(f16_as_f32.data(), 24));

  // strata's BF16 writer rounds exactly like torch's .bfloat16().
  const int64_t n = r->find("bf16_source")->numel;
  std::vector<float> source(static_cast<size_t>(n));
  ASSERT_TRUE(r->read_f32("bf16_source", source.data()).ok());
  std::vector<uint16_t> torch_bits(static_cast<size_t>(n));
  ASSERT_TRUE(r->read_raw("bf16", torch_bits.data()).ok());
  const std::string ours = dir + "/ours.safetensors";
  WriterOptions wo;
  wo.dtype = SafetensorsWriteDtype::kBF16;
  ASSERT_TRUE(write_safetensors_file(ours, {{"bf16", {n}, source.data()}}, wo).ok());
  Result<SafetensorsReader> mine = SafetensorsReader::open(ours);
  ASSERT_TRUE(mine.ok()) << mine.status().to_string();
  std::vector<uint16_t> our_bits(static_cast<size_t>(n));
  ASSERT_TRUE(mine->read_raw("bf16", our_bits.data()).ok());
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(source[i])) {  // torch's NaN payload depends on its SIMD path; any NaN will do
      EXPECT_TRUE(std::isnan(bf16_to_f32(our_bits[i])) && std::isnan(bf16_to_f32(torch_bits[i]))) << i;
    } else {
      EXPECT_EQ(our_bits[i], torch_bits[i]) << "element " << i << " = " << source[i];
    }
  }
  // And its F16 writer like torch's .half(), overflow and subnormals included.
  ASSERT_TRUE(r->read_raw("f16_of_source", torch_bits.data()).ok());
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t ours = f32_to_f16(source[i]);
    if (std::isnan(source[i])) {
      EXPECT_TRUE(std::isnan(f16_to_f32(ours)) && std::isnan(f16_to_f32(torch_bits[i]))) << i;
    } else {
      EXPECT_EQ(ours, torch_bits[i]) << "element " << i << " = " << source[i];
    }
  }
}

// ---- A model's weights through load_hf_weights ------------------------------------------------

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

// params (layout.total_size()) saved under their Hugging Face names, but for `skip`.
Status save_params(const ParamLayout& layout, const std::vector<float>& params, const std::string& path,
                   const std::string& skip = "") {
  std::vector<SafetensorsWriteTensor> tensors;
  for (const TensorSpec& t : layout.tensors()) {
    if (t.name != skip) tensors.push_back({t.name, t.shape, params.data() + t.offset});
  }
  return write_safetensors_file(path, tensors);
}

TEST(SafetensorsTest, ModelWeightsLoadBackBitwise) {
  const std::string path = test_dir() + "/model.safetensors";
  const ParamLayout layout(small_config());
  std::vector<float> saved(static_cast<size_t>(layout.total_size())), loaded(saved.size());
  init_weights(layout, saved.data(), 17);
  ASSERT_TRUE(save_params(layout, saved, path).ok());
  Status st = load_hf_weights(path, layout, loaded.data());
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(std::memcmp(saved.data(), loaded.data(), sizeof(float) * saved.size()), 0);
}

TEST(SafetensorsTest, FailedModelLoadLeavesParametersUnchanged) {
  const std::string path = test_dir() + "/missing.safetensors";
  const ParamLayout layout(small_config());
  std::vector<float> saved(static_cast<size_t>(layout.total_size())), fresh(saved.size(), 0.0f);
  init_weights(layout, saved.data(), 1);
  ASSERT_TRUE(save_params(layout, saved, path, "model.layers.1.mlp.up_proj.weight").ok());
  expect_error(load_hf_weights(path, layout, fresh.data()), StatusCode::kNotFound,
               {path, "model.layers.1.mlp.up_proj.weight"});
  EXPECT_TRUE(std::all_of(fresh.begin(), fresh.end(), [](float x) { return x == 0.0f; }));
}

}  // namespace
}  // namespace strata::model
