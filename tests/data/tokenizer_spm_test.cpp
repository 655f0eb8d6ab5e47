// Sentencepiece-style BPE (Llama-2, Mistral, Mixtral) against ids produced by Hugging Face
// `tokenizers` for two small tokenizers with byte fallback
// (tests/fixtures/tokenizer/make_spm_fixtures.py builds them): llama2/ with the
// Prepend/Replace normalizer, mistral/ with the Metaspace pre-tokenizer.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "test_util.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kSpmFixtures = std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/tokenizer";

using strata::testing::read_json;

// A copy of a fixture's tokenizer.json with an edit, in a directory of its own.
class EditedTokenizer {
 public:
  EditedTokenizer(const std::string& fixture, const std::function<void(json*)>& edit) {
    std::string tmpl = ::testing::TempDir() + "strata_spm_XXXXXX";
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path_ = tmpl;
    json spec = read_json(kSpmFixtures + "/" + fixture + "/tokenizer.json");
    edit(&spec);
    std::ofstream(path_ + "/tokenizer.json") << spec.dump();
  }
  ~EditedTokenizer() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

bool has_added_token_text(const std::string& text) {
  for (const char* t : {"<s>", "</s>", "<unk>"}) {
    if (text.find(t) != std::string::npos) return true;
  }
  return false;
}

class SpmFixtureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SpmFixtureTest, IdsMatchHuggingFaceTokenizers) {
  Result<Tokenizer> tok = Tokenizer::load(kSpmFixtures + "/" + GetParam());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const json expected = read_json(kSpmFixtures + "/" + GetParam() + "/expected.json");
  ASSERT_GE(expected["cases"].size(), 30u);
  for (const json& c : expected["cases"]) {
    const std::string text = c["text"];
    const std::vector<int32_t> ids = tok->encode(text);
    EXPECT_EQ(ids, c["ids"].get<std::vector<int32_t>>()) << json(text).dump();
    EXPECT_EQ(tok->encode(text, {.add_special_tokens = true}), c["ids_with_special"].get<std::vector<int32_t>>())
        << json(text).dump();
    // The library's decoder puts spaces around added tokens; elsewhere the texts agree.
    if (!has_added_token_text(text)) EXPECT_EQ(tok->decode(ids), c["decoded"].get<std::string>()) << json(text).dump();
  }
}

TEST_P(SpmFixtureTest, SpansCoverTheTextInOrder) {
  Result<Tokenizer> tok = Tokenizer::load(kSpmFixtures + "/" + GetParam());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const std::string text = "Grüße 日本 <s>x  y</s> 😀";
  std::vector<int32_t> ids;
  std::vector<ByteSpan> spans;
  tok->encode_with_spans(text, {}, &ids, &spans);
  ASSERT_EQ(ids.size(), spans.size());
  uint32_t pos = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    EXPECT_LE(spans[i].begin, spans[i].end) << i;
    EXPECT_GE(spans[i].begin, pos) << i;  // byte tokens of one character may share its span
    EXPECT_LE(spans[i].end, text.size()) << i;
    if (ids[i] == tok->token_to_id("<s>")) EXPECT_EQ(text.substr(spans[i].begin, 3), "<s>");
    pos = spans[i].begin;
  }
  EXPECT_EQ(spans.back().end, text.size());
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, SpmFixtureTest, ::testing::Values("llama2", "mistral"));

TEST(SpmTokenizerTest, MetaspaceAlwaysWithSplitMatches) {
  EditedTokenizer dir("mistral", [](json* t) {
    (*t)["pre_tokenizer"]["prepend_scheme"] = "always";
    (*t)["pre_tokenizer"]["split"] = true;
  });
  Result<Tokenizer> tok = Tokenizer::load(dir.path());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const json expected = read_json(kSpmFixtures + "/mistral/expected.json");  // outlives the loop
  for (const json& c : expected["cases"]) {
    EXPECT_EQ(tok->encode(c["text"].get<std::string>()), c["ids_split_always"].get<std::vector<int32_t>>())
        << c["text"].dump();
  }
}

TEST(SpmTokenizerTest, CharactersOutsideTheVocabularyUseByteTokens) {
  Result<Tokenizer> tok = Tokenizer::load(kSpmFixtures + "/llama2");
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  // U+2603 is E2 98 83; the fixture's alphabet does not hold it.
  ASSERT_EQ(tok->token_to_id("\u2603"), -1);
  const std::vector<int32_t> ids = tok->encode("\u2603");
  const std::vector<int32_t> want = {tok->token_to_id("\xe2\x96\x81"), tok->token_to_id("<0xE2>"),
                                     tok->token_to_id("<0x98>"), tok->token_to_id("<0x83>")};
  EXPECT_EQ(ids, want);
  EXPECT_EQ(tok->decode(ids), "\u2603");
  // Without byte fallback such a character is <unk>, and a run of them one <unk> (fuse_unk).
  EditedTokenizer dir("llama2", [](json* t) { (*t)["model"]["byte_fallback"] = false; });
  Result<Tokenizer> plain = Tokenizer::load(dir.path());
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  EXPECT_EQ(plain->encode("\u2603\u2603"), (std::vector<int32_t>{tok->token_to_id("\xe2\x96\x81"), 0}));
}

TEST(SpmTokenizerTest, CharactersWithNoTokenAreDroppedAndLaterSpansStayRight) {
  // Neither byte fallback nor <unk>: tokenizers drops such a character.
  EditedTokenizer dir("mistral", [](json* t) {
    (*t)["model"]["byte_fallback"] = false;
    (*t)["model"]["unk_token"] = nullptr;
  });
  Result<Tokenizer> tok = Tokenizer::load(dir.path());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const std::string text = "a\u2603\u2603b";  // a, two 3-byte snowmen, b
  std::vector<int32_t> ids;
  std::vector<ByteSpan> spans;
  tok->encode_with_spans(text, {}, &ids, &spans);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.back(), tok->token_to_id("b"));
  EXPECT_EQ(spans.back().begin, 7u);
  EXPECT_EQ(spans.back().end, 8u);
  EXPECT_EQ(tok->decode(ids), "ab");
}

TEST(SpmTokenizerTest, UnsupportedPiecesAreUnimplementedNamingTheFile) {
  const std::vector<std::pair<std::function<void(json*)>, std::string>> cases = {
      {[](json* t) { (*t)["pre_tokenizer"]["replacement"] = "_"; }, "Metaspace with a replacement"},
      {[](json* t) { (*t)["pre_tokenizer"]["prepend_scheme"] = "sometimes"; }, "prepend_scheme"},
      {[](json* t) { (*t)["pre_tokenizer"] = nullptr; }, "neither a ByteLevel nor a Metaspace"},
      {[](json* t) { (*t)["normalizer"] = json{{"type", "Prepend"}, {"prepend", "x"}}; }, "Prepend"},
      {[](json* t) { (*t)["added_tokens"][1]["normalized"] = true; }, "normalized"},
  };
  for (const auto& [edit, needle] : cases) {
    EditedTokenizer dir(needle == "normalized" ? "llama2" : "mistral", edit);
    Result<Tokenizer> tok = Tokenizer::load(dir.path());
    ASSERT_FALSE(tok.ok()) << needle;
    EXPECT_EQ(tok.status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(tok.status().message().find(dir.path() + "/tokenizer.json"), std::string::npos) << tok.status().message();
    EXPECT_NE(tok.status().message().find(needle), std::string::npos) << tok.status().message();
  }
}

}  // namespace
}  // namespace strata::model
