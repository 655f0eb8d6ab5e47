// The safetensors reader is as strict as the reference library (Hugging Face's safetensors):
// NUL bytes around the header's JSON and dtypes the format does not define are Corruption
// naming the file (and tensor), while the JSON whitespace the library allows is accepted.
// Where /usr/bin/python3 has `safetensors`, every crafted file gets the same verdict from it.
#include "model/safetensors.h"
#include "reference_util.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace strata::model {
namespace {

namespace fs = std::filesystem;


std::string strict_test_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir = fs::path(STRATA_BINARY_DIR) / "tests" / "model_safetensors_strict" / info->name();
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

// A file whose header is exactly `header` (no padding added) followed by `data_bytes` zeros.
void write_exact(const std::string& path, const std::string& header, size_t data_bytes) {
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i)));
  out << header << std::string(data_bytes, '\0');
}

std::string one_tensor(const std::string& name, const std::string& dtype, const std::string& shape, size_t bytes) {
  return "{\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[0," +
         std::to_string(bytes) + "]}}";
}

struct Case {
  std::string name;
  std::string header;
  size_t data_bytes;
  bool valid;  // what the reference library says
};

std::vector<Case> cases() {
  const std::string f32 = one_tensor("w", "F32", "[1]", 4);
  return {
      {"plain", f32, 4, true},
      {"space_padded", f32 + "     ", 4, true},
      {"newline_and_tab_padded", f32 + "\n\t ", 4, true},
      {"leading_space", " " + f32, 4, true},
      {"nul_padded", f32 + std::string(5, '\0'), 4, false},
      {"nul_then_spaces", f32 + std::string(1, '\0') + "    ", 4, false},
      {"unknown_dtype",
       "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
       "\"unused\":{\"dtype\":\"Q4\",\"shape\":[2],\"data_offsets\":[4,5]}}",
       5, false},
      {"lower_case_dtype", one_tensor("w", "f32", "[1]", 4), 4, false},
      {"f8_e8m0", one_tensor("w", "F8_E8M0", "[3]", 3), 3, true},
      {"f8_e4m3fnuz", one_tensor("w", "F8_E4M3FNUZ", "[3]", 3), 3, true},
      {"c64", one_tensor("w", "C64", "[2]", 16), 16, true},
      {"f4_packed", one_tensor("w", "F4", "[4]", 2), 2, true},
      {"f4_half_byte_left", one_tensor("w", "F4", "[3]", 2), 2, false},
      {"f6_packed", one_tensor("w", "F6_E2M3", "[4]", 3), 3, true},
      {"u16_size_lie", one_tensor("w", "U16", "[2]", 2), 2, false},
  };
}

TEST(SafetensorsStrictTest, RefusesWhatTheReferenceLibraryRefuses) {
  const std::string dir = strict_test_dir();
  for (const Case& c : cases()) {
    const std::string path = dir + "/" + c.name + ".safetensors";
    write_exact(path, c.header, c.data_bytes);
    Result<SafetensorsReader> r = SafetensorsReader::open(path);
    EXPECT_EQ(r.ok(), c.valid) << c.name << ": " << (r.ok() ? "accepted" : r.status().to_string());
    if (r.ok() || c.valid) continue;
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << c.name;
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().to_string();
    EXPECT_EQ(r.status().message().find('\n'), std::string::npos) << "one line: " << r.status().to_string();
  }
}

TEST(SafetensorsStrictTest, MessagesNameTheFileTheTensorAndTheProblem) {
  const std::string dir = strict_test_dir();
  const std::string nul = dir + "/nul.safetensors";
  write_exact(nul, one_tensor("w", "F32", "[1]", 4) + std::string(3, '\0'), 4);
  Result<SafetensorsReader> r = SafetensorsReader::open(nul);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("NUL"), std::string::npos) << r.status().to_string();
  EXPECT_NE(r.status().message().find("spaces"), std::string::npos) << r.status().to_string();

  // A tensor the model would never read is still refused: the file is not safetensors.
  const std::string unknown = dir + "/unknown.safetensors";
  write_exact(unknown,
              "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
              "\"model.extra\":{\"dtype\":\"Q4_K\",\"shape\":[2],\"data_offsets\":[4,5]}}",
              5);
  r = SafetensorsReader::open(unknown);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  for (const char* part : {"'model.extra'", "'Q4_K'", "BF16"}) {
    EXPECT_NE(r.status().message().find(part), std::string::npos) << part << ": " << r.status().to_string();
  }
}

TEST(SafetensorsStrictTest, PythonSafetensorsGivesTheSameVerdicts) {
  const std::string probe = std::string(kReferencePython) + " -c 'import safetensors' >/dev/null 2>&1";
  if (!fs::exists(kReferencePython) || std::system(probe.c_str()) != 0) {
    GTEST_SKIP() << kReferencePython << " cannot import safetensors; the verdicts are checked against it where it can";
  }
  const std::string dir = strict_test_dir();
  const std::string script = dir + "/verdicts.py";
  std::ofstream(script) << "import sys\n"
                           "from safetensors import safe_open\n"
                           "for path in sys.argv[1:]:\n"
                           "    try:\n"
                           "        with safe_open(path, 'np') as f:\n"
                           "            f.keys()\n"
                           "        print('valid')\n"
                           "    except Exception:\n"
                           "        print('invalid')\n";
  std::string cmd = std::string(kReferencePython) + " " + script;
  for (const Case& c : cases()) {
    const std::string path = dir + "/" + c.name + ".safetensors";
    write_exact(path, c.header, c.data_bytes);
    cmd += " " + path;
  }
  const std::string out = dir + "/verdicts.txt";
  ASSERT_EQ(std::system((cmd + " >" + out + " 2>&1").c_str()), 0) << "see " << out;
  std::ifstream in(out);
  for (const Case& c : cases()) {
    std::string verdict;
    ASSERT_TRUE(std::getline(in, verdict)) << "see " << out;
    EXPECT_EQ(verdict, c.valid ? "valid" : "invalid") << c.name << ": the case table disagrees with the library";
    Result<SafetensorsReader> r = SafetensorsReader::open(dir + "/" + c.name + ".safetensors");
    EXPECT_EQ(r.ok(), verdict == "valid") << c.name << ": strata and the library disagree";
  }
}

}  // namespace
}  // namespace strata::model
