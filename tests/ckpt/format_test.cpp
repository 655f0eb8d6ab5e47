// manifest_from_json refuses every field a hand-edited or damaged manifest could use to steer a
// resume (negative or overflowing steps, a cursor read as 0, names leading out of the step
// directory), naming the manifest and the field.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "ckpt/format.h"

namespace strata::ckpt {
namespace {

using json = nlohmann::json;

const std::string kPath = "/ckpt/step-4/manifest.json";
const std::string kStepDir = "/ckpt/step-4";

json good_manifest() {
  Manifest m;
  m.step = 4;
  m.fields.strata_version = "test";
  m.fields.tokens_seen = 4096;
  m.fields.data_cursor = {1, 32};
  m.fields.optimizer_step = 4;
  m.files["model.safetensors"] = FileRecord{8192, 0x0123456789abcdefull};
  m.files["optimizer.safetensors"] = FileRecord{4096, 42};
  return manifest_to_json(m);
}

// The error for `j`, which must name the manifest and `field`.
void expect_refused(const json& j, const std::string& field, const std::string& what) {
  Result<Manifest> m = manifest_from_json(kPath, kStepDir, j);
  ASSERT_FALSE(m.ok()) << what << " was accepted";
  EXPECT_EQ(m.status().code(), StatusCode::kCorruption) << what;
  EXPECT_NE(m.status().message().find(kPath), std::string::npos) << what << ": " << m.status().message();
  EXPECT_NE(m.status().message().find("'" + field + "'"), std::string::npos) << what << ": " << m.status().message();
}

TEST(ManifestTest, AGoodManifestRoundTrips) {
  Result<Manifest> m = manifest_from_json(kPath, kStepDir, good_manifest());
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->step, 4);
  EXPECT_EQ(m->fields.data_cursor.index, 32);
  EXPECT_EQ(m->files.at("model.safetensors").xxh3, 0x0123456789abcdefull);
  // A directory not named step-N (a copy) has no name to disagree with.
  EXPECT_TRUE(manifest_from_json("/copy/manifest.json", "/copy", good_manifest()).ok());
}

TEST(ManifestTest, StepsOutOfRangeOrDisagreeingWithTheDirectoryAreRefused) {
  json j = good_manifest();
  j["step"] = -4;
  expect_refused(j, "step", "a negative step");
  j["step"] = std::numeric_limits<int64_t>::max();  // step + 1 would overflow
  expect_refused(j, "step", "step 2^63-1");
  j["step"] = std::numeric_limits<uint64_t>::max();
  expect_refused(j, "step", "step 2^64-1");
  j["step"] = 4.5;
  expect_refused(j, "step", "a fractional step");
  j["step"] = 7;
  expect_refused(j, "step", "step 7 inside step-4/");
  j["step"] = 4;
  j["optimizer_step"] = -10;
  expect_refused(j, "optimizer_step", "a negative optimizer step");
  j["optimizer_step"] = 5;
  expect_refused(j, "optimizer_step", "more optimizer steps than steps");
  j["optimizer_step"] = "4";
  expect_refused(j, "optimizer_step", "an optimizer step as a string");
}

// Integers read from JSON text are unsigned when non-negative: their lower bound still holds
// (format_version 0 read from a file used to pass, then fail once written back; found by fuzzing).
TEST(ManifestTest, LowerBoundsHoldForIntegersReadFromText) {
  json j = good_manifest();
  j["format_version"] = 0;
  expect_refused(json::parse(j.dump()), "format_version", "format version 0 from text");
}

TEST(ManifestTest, CountsCursorAndMembersAreTypeChecked) {
  {
    json j = good_manifest();
    j["data_cursor"] = "x";
    expect_refused(j, "data_cursor", "data_cursor \"x\"");
  }
  {
    json j = good_manifest();
    j["data_cursor"]["index"] = "x";
    expect_refused(j, "data_cursor.index", "a string index");
  }
  {
    json j = good_manifest();
    j["data_cursor"]["epoch"] = -1;
    expect_refused(j, "data_cursor.epoch", "a negative epoch");
  }
  {
    json j = good_manifest();
    j["tokens_seen"] = -1;
    expect_refused(j, "tokens_seen", "negative tokens");
  }
  {
    json j = good_manifest();
    j.erase("tokens_seen");
    expect_refused(j, "tokens_seen", "a missing field");
  }
  {
    json j = good_manifest();
    j["model_config"] = json::array();
    expect_refused(j, "model_config", "a model config that is not an object");
  }
  {
    json j = good_manifest();
    j["strata_version"] = 3;
    expect_refused(j, "strata_version", "a version that is not a string");
  }
  {
    json j = good_manifest();
    j["files"]["model.safetensors"]["size"] = -8;
    expect_refused(j, "files.'model.safetensors'.size", "a negative size");
  }
  {
    json j = good_manifest();
    j["files"]["model.safetensors"]["xxh3_64"] = "0x23456789abcdef";
    expect_refused(j, "files.'model.safetensors'.xxh3_64", "a hash that is not 16 hex digits");
  }
}

TEST(ManifestTest, FileNamesStayInsideTheStepDirectory) {
  for (const std::string& name : {std::string("../../../../../etc/hostname"), std::string("/etc/hostname"),
                                  std::string("a/b"), std::string(".."), std::string("."), std::string(""),
                                  std::string("model\0x", 7)}) {
    json j = good_manifest();
    j["files"][name] = {{"size", 1}, {"xxh3_64", "0000000000000000"}};
    Result<Manifest> m = manifest_from_json(kPath, kStepDir, j);
    ASSERT_FALSE(m.ok()) << "'" << name << "' was accepted";
    EXPECT_NE(m.status().message().find("plain file name"), std::string::npos) << m.status().message();
  }
  EXPECT_TRUE(is_plain_file_name("model.safetensors"));
}

TEST(ManifestTest, UntrustedTextIsQuotedShortAndPrintable) {
  EXPECT_EQ(quote_untrusted("step-3"), "'step-3'");
  EXPECT_EQ(quote_untrusted("a\nb\x1b[31m"), "'a?b?[31m'");
  EXPECT_EQ(quote_untrusted(std::string(100, 'x'), 4), "'xxxx'...");
}

}  // namespace
}  // namespace strata::ckpt
