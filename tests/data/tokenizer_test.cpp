// The byte-level BPE tokenizer against ids produced by Hugging Face `tokenizers` for three
// small tokenizers (tests/fixtures/tokenizer/make_fixtures.py builds them) and a Qwen2 one with
// the NFC normalizer (make_nfc_fixture.py), its splitters against the library's regex pieces,
// and its errors.
#include "data/tokenizer.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer_split.h"
#include "data/unicode_nfc.h"
#include "test_util.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kFixtures = std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/tokenizer";

using strata::testing::read_json;
using strata::testing::read_text;

std::vector<int32_t> ids_of(const json& j) { return j.get<std::vector<int32_t>>(); }

class TempDir {
 public:
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "strata_tok_XXXXXX";
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ + "/" + name, std::ios::binary) << text;
  }

 private:
  std::string path_;
};

// A copy of a fixture directory with tokenizer.json edited by `edit`.
void copy_with_edit(const std::string& name, const TempDir& dir, const std::function<void(json*)>& edit) {
  json tok = read_json(kFixtures + "/" + name + "/tokenizer.json");
  edit(&tok);
  dir.write("tokenizer.json", tok.dump());
  dir.write("tokenizer_config.json", read_text(kFixtures + "/" + name + "/tokenizer_config.json"));
}

class FixtureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(FixtureTest, IdsMatchHuggingFaceTokenizers) {
  Result<Tokenizer> tok = Tokenizer::load(kFixtures + "/" + GetParam());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const json expected = read_json(kFixtures + "/" + GetParam() + "/expected.json");
  ASSERT_GE(expected["cases"].size(), 10u);
  for (const json& c : expected["cases"]) {
    const std::string text = c["text"];
    EXPECT_EQ(tok->encode(text), ids_of(c["ids"])) << GetParam() << ": " << text;
    EXPECT_EQ(tok->encode(text, {.add_special_tokens = true}), ids_of(c["ids_with_special"])) << text;
  }
}

TEST_P(FixtureTest, DecodeInvertsEncode) {
  Result<Tokenizer> tok = Tokenizer::load(kFixtures + "/" + GetParam());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const json expected = read_json(kFixtures + "/" + GetParam() + "/expected.json");
  for (const json& c : expected["cases"]) {
    const std::string text = c["text"];
    EXPECT_EQ(tok->decode(tok->encode(text)), text);
    EXPECT_EQ(tok->decode(tok->encode(text, {.parse_special = false})), text);
  }
  // Bytes that are not UTF-8 survive too.
  const std::string bad = "ok \xff\xfe\xc3 and \xe2\x82 end\x80";
  EXPECT_EQ(tok->decode(tok->encode(bad)), bad);
}

TEST_P(FixtureTest, ChatMatchesRenderedTemplate) {
  Result<Tokenizer> tok = Tokenizer::load(kFixtures + "/" + GetParam());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const json expected = read_json(kFixtures + "/" + GetParam() + "/expected.json");
  if (!expected.contains("chat")) {
    EXPECT_FALSE(tok->chat_template().has_value());
    Result<EncodedChat> chat = tok->encode_chat(nlohmann::ordered_json::array());
    ASSERT_FALSE(chat.ok());
    EXPECT_EQ(chat.status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(chat.status().message().find("tokenizer_config.json"), std::string::npos);
    return;
  }
  const json& c = expected["chat"];
  Result<EncodedChat> chat = tok->encode_chat(nlohmann::ordered_json(c["messages"]));
  ASSERT_TRUE(chat.ok()) << chat.status().to_string();
  EXPECT_EQ(chat->text, c["text"].get<std::string>());
  EXPECT_EQ(chat->ids, ids_of(c["ids"]));
  EXPECT_EQ(chat->loss_mask, c["mask"].get<std::vector<uint8_t>>());
  // The counted tokens decode to the assistant replies and their end-of-turn tokens.
  std::vector<int32_t> counted;
  for (size_t i = 0; i < chat->ids.size(); ++i) {
    if (chat->loss_mask[i]) counted.push_back(chat->ids[i]);
  }
  const std::string end = GetParam() == std::string("qwen2") ? "<|im_end|>" : "<|eot_id|>";
  EXPECT_EQ(tok->decode(counted), "4. Easy!" + end + "100 — also easy." + end);
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, FixtureTest, ::testing::Values("gpt2", "llama3", "qwen2"));

TEST(TokenizerTest, SpecialIdsAndVocabulary) {
  Result<Tokenizer> gpt2 = Tokenizer::load(kFixtures + "/gpt2");
  Result<Tokenizer> llama3 = Tokenizer::load(kFixtures + "/llama3/tokenizer.json");  // the file itself
  Result<Tokenizer> qwen2 = Tokenizer::load(kFixtures + "/qwen2");
  ASSERT_TRUE(gpt2.ok() && llama3.ok() && qwen2.ok());
  EXPECT_EQ(gpt2->vocab_size(), 700);
  EXPECT_EQ(llama3->vocab_size(), 900);
  EXPECT_EQ(qwen2->vocab_size(), 600);
  // GPT-2 names no eos_token; <|endoftext|> serves.
  EXPECT_EQ(gpt2->bos_id(), -1);
  EXPECT_EQ(gpt2->eos_id(), gpt2->token_to_id("<|endoftext|>"));
  EXPECT_GE(gpt2->eos_id(), 0);
  EXPECT_EQ(llama3->bos_id(), llama3->token_to_id("<|begin_of_text|>"));
  EXPECT_EQ(llama3->eos_id(), llama3->token_to_id("<|eot_id|>"));
  EXPECT_GE(llama3->eos_id(), 0);
  EXPECT_EQ(qwen2->bos_id(), -1);
  EXPECT_EQ(qwen2->eos_id(), qwen2->token_to_id("<|im_end|>"));
  EXPECT_TRUE(llama3->chat_template().has_value());
  EXPECT_TRUE(qwen2->chat_template().has_value());
  EXPECT_FALSE(gpt2->chat_template().has_value());
  // Byte-level spellings.
  const int32_t space = gpt2->token_to_id("\xc4\xa0");  // "Ġ" stands for " "
  ASSERT_GE(space, 0);
  EXPECT_EQ(gpt2->decode(std::vector<int32_t>{space}), " ");
  EXPECT_EQ(gpt2->id_to_token(space), "\xc4\xa0");
  EXPECT_EQ(gpt2->token_to_id("no such token"), -1);
  EXPECT_EQ(gpt2->decode(std::vector<int32_t>{-5, 100000}), "");
}

TEST(TokenizerTest, ParseSpecialOffEncodesTheTextAsBytes) {
  Result<Tokenizer> tok = Tokenizer::load(kFixtures + "/qwen2");
  ASSERT_TRUE(tok.ok());
  const int32_t eot = tok->token_to_id("<|endoftext|>");
  EXPECT_EQ(tok->encode("<|endoftext|>"), std::vector<int32_t>{eot});
  std::vector<int32_t> plain = tok->encode("<|endoftext|>", {.parse_special = false});
  EXPECT_GT(plain.size(), 1u);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), eot), 0);
}

TEST(TokenizerTest, AddPrefixSpaceMatchesHuggingFace) {
  TempDir dir;
  copy_with_edit("gpt2", dir, [](json* t) { (*t)["pre_tokenizer"]["add_prefix_space"] = true; });
  Result<Tokenizer> tok = Tokenizer::load(dir.path());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const json expected = read_json(kFixtures + "/gpt2/expected.json");
  int differ = 0;
  for (const json& c : expected["cases"]) {
    const std::string text = c["text"];
    EXPECT_EQ(tok->encode(text), ids_of(c["ids_prefix_space"])) << text;
    differ += c["ids_prefix_space"] != c["ids"];
  }
  EXPECT_GT(differ, 5);  // the option changes the ids, so this test can tell
}

TEST(TokenizerTest, SpansCoverTheText) {
  Result<Tokenizer> tok = Tokenizer::load(kFixtures + "/llama3");
  ASSERT_TRUE(tok.ok());
  const std::string text = "Grüße <|eot_id|> 日本語\n\n  ok";
  std::vector<int32_t> ids;
  std::vector<ByteSpan> spans;
  tok->encode_with_spans(text, {.add_special_tokens = true}, &ids, &spans);
  ASSERT_EQ(ids.size(), spans.size());
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids[0], tok->bos_id());
  EXPECT_EQ(spans[0].begin, spans[0].end);  // BOS stands for no text
  uint32_t pos = 0;
  for (size_t i = 1; i < spans.size(); ++i) {
    EXPECT_EQ(spans[i].begin, pos) << i;
    pos = spans[i].end;
    std::vector<int32_t> one{ids[i]};
    EXPECT_EQ(tok->decode(one), text.substr(spans[i].begin, spans[i].end - spans[i].begin)) << i;
  }
  EXPECT_EQ(pos, text.size());
}

TEST(TokenizerTest, UnknownSplitPatternIsUnimplementedNamingTheFile) {
  TempDir dir;
  copy_with_edit("llama3", dir, [](json* t) {
    (*t)["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\p{L}+|\\s+";
  });
  Result<Tokenizer> tok = Tokenizer::load(dir.path());
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(tok.status().message().find(dir.path() + "/tokenizer.json"), std::string::npos) << tok.status().message();
  EXPECT_NE(tok.status().message().find("\\\\p{L}+|\\\\s+"), std::string::npos) << tok.status().message();
}

TEST(TokenizerTest, UnsupportedModelsAndBrokenFilesFail) {
  struct Case {
    std::function<void(json*)> edit;
    StatusCode code;
  };
  const std::vector<Case> cases = {
      {[](json* t) { (*t)["model"]["type"] = "WordPiece"; }, StatusCode::kUnimplemented},
      {[](json* t) { (*t)["normalizer"] = json{{"type", "Lowercase"}}; }, StatusCode::kUnimplemented},
      {[](json* t) { (*t)["pre_tokenizer"] = json{{"type", "Whitespace"}}; }, StatusCode::kUnimplemented},
      {[](json* t) { (*t)["post_processor"] = json{{"type", "BertProcessing"}}; }, StatusCode::kUnimplemented},
      {[](json* t) { (*t)["model"]["merges"][0] = "nosuchtoken x"; }, StatusCode::kCorruption},
      {[](json* t) { (*t)["model"]["merges"][0] = 7; }, StatusCode::kCorruption},
      {[](json* t) { (*t)["model"]["vocab"]["a"] = "one"; }, StatusCode::kCorruption},
      {[](json* t) { t->erase("model"); }, StatusCode::kCorruption},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    TempDir dir;
    copy_with_edit("gpt2", dir, cases[i].edit);
    Result<Tokenizer> tok = Tokenizer::load(dir.path());
    ASSERT_FALSE(tok.ok()) << "case " << i;
    EXPECT_EQ(tok.status().code(), cases[i].code) << "case " << i << ": " << tok.status().to_string();
    EXPECT_NE(tok.status().message().find("tokenizer.json"), std::string::npos) << tok.status().message();
  }
  TempDir dir;
  dir.write("tokenizer.json", "{ not json");
  EXPECT_EQ(Tokenizer::load(dir.path()).status().code(), StatusCode::kCorruption);
  EXPECT_EQ(Tokenizer::load(dir.path() + "/missing").status().code(), StatusCode::kNotFound);
}

// Files that contradict themselves are refused naming the key: two vocabulary tokens with one id,
// an added token taking a vocabulary token's id or moving a token to another id, and special
// tokens in tokenizer_config.json that are not tokens (they were read as "not set").
TEST(TokenizerTest, FilesThatContradictThemselvesAreRefusedNamingTheKey) {
  struct Case {
    std::function<void(json*)> edit;
    std::string words;
  };
  const std::vector<Case> cases = {
      {[](json* t) { (*t)["model"]["vocab"]["zzz-duplicate"] = (*t)["model"]["vocab"]["a"]; }, "model.vocab gives id"},
      {[](json* t) {
         (*t)["added_tokens"].push_back({{"id", (*t)["model"]["vocab"]["a"]}, {"content", "<|clash|>"}, {"special", true}});
       },
       "added_tokens gives id"},
      {[](json* t) {
         (*t)["added_tokens"].push_back({{"id", 70000}, {"content", "a"}, {"special", true}});
       },
       "already has id"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    TempDir dir;
    copy_with_edit("gpt2", dir, cases[i].edit);
    Result<Tokenizer> tok = Tokenizer::load(dir.path());
    ASSERT_FALSE(tok.ok()) << "case " << i;
    EXPECT_EQ(tok.status().code(), StatusCode::kCorruption) << tok.status().to_string();
    EXPECT_NE(tok.status().message().find(cases[i].words), std::string::npos) << tok.status().message();
  }
  for (const char* config : {R"({"eos_token": 50256})", R"({"bos_token": {"id": 3}})", R"({"eos_token": [1]})"}) {
    TempDir dir;
    copy_with_edit("gpt2", dir, [](json*) {});
    dir.write("tokenizer_config.json", config);
    Result<Tokenizer> tok = Tokenizer::load(dir.path());
    ASSERT_FALSE(tok.ok()) << config;
    EXPECT_NE(tok.status().message().find("tokenizer_config.json: "), std::string::npos) << tok.status().message();
    EXPECT_NE(tok.status().message().find("_token is "), std::string::npos) << tok.status().message();
  }
  // null means "not set", as transformers reads it.
  TempDir dir;
  copy_with_edit("gpt2", dir, [](json*) {});
  dir.write("tokenizer_config.json", R"({"bos_token": null})");
  EXPECT_TRUE(Tokenizer::load(dir.path()).ok());
}

TEST(TokenizerTest, SparseIdsAreRefusedBeforeSizingTheTables) {
  // 60 bytes naming id 2^28 - 1 used to allocate 8 GiB of empty token strings.
  TempDir dir;
  dir.write("tokenizer.json", R"({"model":{"type":"BPE","vocab":{"a":268435455},"merges":[]}})");
  Result<Tokenizer> tok = Tokenizer::load(dir.path());
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), StatusCode::kCorruption);
  EXPECT_NE(tok.status().message().find("268435455"), std::string::npos) << tok.status().message();
  // A vocabulary with added tokens a little past its end still loads.
  TempDir ok_dir;
  copy_with_edit("gpt2", ok_dir, [](json* t) {
    (*t)["added_tokens"].push_back({{"id", (*t)["model"]["vocab"].size() + 100}, {"content", "<|pad|>"}});
  });
  Result<Tokenizer> ok = Tokenizer::load(ok_dir.path());
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
}

TEST(TokenizerTest, AnyChatTemplateIsRendered) {
  TempDir dir;
  copy_with_edit("qwen2", dir, [](json*) {});
  dir.write("tokenizer_config.json", R"({"eos_token": "<|im_end|>", "chat_template": "{% for m in messages %}[{{m.role}}]{{ m.content }}{% endfor %}"})");
  Result<Tokenizer> tok = Tokenizer::load(dir.path());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  ASSERT_TRUE(tok->chat_template().has_value());
  Result<EncodedChat> chat = tok->encode_chat(nlohmann::ordered_json::parse(R"([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])"));
  ASSERT_TRUE(chat.ok()) << chat.status().to_string();
  EXPECT_EQ(chat->text, "[user]hi[assistant]yo");
  std::vector<int32_t> counted;
  for (size_t i = 0; i < chat->ids.size(); ++i) {
    if (chat->loss_mask[i]) counted.push_back(chat->ids[i]);
  }
  EXPECT_EQ(tok->decode(counted), "[assistant]yo");  // this template has no generation prompt to leave out
  // An eos_token that is not in the vocabulary fails the load.
  dir.write("tokenizer_config.json", R"({"eos_token": "<|nope|>"})");
  EXPECT_EQ(Tokenizer::load(dir.path()).status().code(), StatusCode::kCorruption);
}

TEST(TokenizerNfcTest, IdsOnDecomposedTextMatchHuggingFaceTokenizers) {
  Result<Tokenizer> tok = Tokenizer::load(kFixtures + "/qwen2_nfc");
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const json expected = read_json(kFixtures + "/qwen2_nfc/expected.json");
  ASSERT_GE(expected["cases"].size(), 8u);
  for (const json& c : expected["cases"]) {
    const std::string text = c["text"];
    const std::vector<int32_t> ids = tok->encode(text);
    EXPECT_EQ(ids, ids_of(c["ids"])) << text;
    EXPECT_EQ(tok->decode(ids), c["decoded"].get<std::string>()) << text;
  }
}

TEST(TokenizerNfcTest, CanonicallyEquivalentSpellingsGetTheSameIds) {
  Result<Tokenizer> with_nfc = Tokenizer::load(kFixtures + "/qwen2_nfc");
  Result<Tokenizer> without = Tokenizer::load(kFixtures + "/qwen2");
  ASSERT_TRUE(with_nfc.ok() && without.ok());
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"caf\u00e9", "cafe\u0301"},
      {"\ud55c\uae00", "\u1112\u1161\u11ab\u1100\u1173\u11af"},
      {"Vi\u1ec7t", "Vie\u0302\u0323t"},
      {"\u00c5", "\u212b"},
  };
  for (const auto& [composed, decomposed] : pairs) {
    EXPECT_EQ(with_nfc->encode(decomposed), with_nfc->encode(composed)) << decomposed;
    EXPECT_EQ(with_nfc->encode(decomposed), without->encode(composed)) << decomposed;
    EXPECT_NE(without->encode(decomposed), without->encode(composed)) << decomposed;  // so the test can tell
  }
}

TEST(TokenizerNfcTest, SequenceOfNfcIsAccepted) {
  TempDir dir;
  copy_with_edit("qwen2_nfc", dir, [](json* t) {
    (*t)["normalizer"] = json{{"type", "Sequence"}, {"normalizers", json::array({json{{"type", "NFC"}}})}};
  });
  Result<Tokenizer> tok = Tokenizer::load(dir.path());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const json expected = read_json(kFixtures + "/qwen2_nfc/expected.json");
  for (const json& c : expected["cases"]) EXPECT_EQ(tok->encode(c["text"].get<std::string>()), ids_of(c["ids"]));
}

TEST(TokenizerNfcTest, SpansReferToTheRawText) {
  Result<Tokenizer> tok = Tokenizer::load(kFixtures + "/qwen2_nfc");
  ASSERT_TRUE(tok.ok());
  const std::string text = "Cafe\u0301 <|im_end|>\u1112\u1161\u11ab x";
  std::vector<int32_t> ids;
  std::vector<ByteSpan> spans;
  tok->encode_with_spans(text, {}, &ids, &spans);
  ASSERT_EQ(ids, tok->encode(text));
  ASSERT_EQ(ids.size(), spans.size());
  // Spans run forward over the whole text without gaps (tokens of one changed stretch share
  // it); the decoded tokens spell its NFC.
  uint32_t begin = 0, end = 0;
  std::string decoded;
  for (size_t i = 0; i < spans.size(); ++i) {
    EXPECT_GE(spans[i].begin, begin) << i;
    EXPECT_LE(spans[i].begin, end) << i;
    EXPECT_GE(spans[i].end, end) << i;
    EXPECT_LT(spans[i].begin, spans[i].end) << i;
    begin = spans[i].begin;
    end = spans[i].end;
    decoded += tok->decode(std::vector<int32_t>{ids[i]});
    // A token inside "e\u0301" (bytes 3..6) stands for all of it.
    if (spans[i].begin < 6 && spans[i].end > 3) {
      EXPECT_LE(spans[i].begin, 3u) << i;
      EXPECT_EQ(spans[i].end, 6u) << i;
    }
  }
  EXPECT_EQ(spans.front().begin, 0u);
  EXPECT_EQ(end, text.size());
  EXPECT_EQ(decoded, nfc(text));
  const int32_t im_end = tok->token_to_id("<|im_end|>");
  auto it = std::find(ids.begin(), ids.end(), im_end);
  ASSERT_NE(it, ids.end());
  const ByteSpan s = spans[static_cast<size_t>(it - ids.begin())];
  EXPECT_EQ(text.substr(s.begin, s.end - s.begin), "<|im_end|>");
}

TEST(TokenizerNfcTest, ChatLossMaskCoversTheNormalizedReply) {
  Result<Tokenizer> tok = Tokenizer::load(kFixtures + "/qwen2_nfc");
  ASSERT_TRUE(tok.ok());
  const nlohmann::ordered_json messages = {{{"role", "user"}, {"content", "Cafe\u0301?"}},
                         {{"role", "assistant"}, {"content", "Oui, cafe\u0301 \u1112\u1161\u11ab."}}};
  Result<EncodedChat> chat = tok->encode_chat(messages);
  ASSERT_TRUE(chat.ok()) << chat.status().to_string();
  std::vector<int32_t> counted;
  for (size_t i = 0; i < chat->ids.size(); ++i) {
    if (chat->loss_mask[i]) counted.push_back(chat->ids[i]);
  }
  EXPECT_EQ(tok->decode(counted), "Oui, caf\u00e9 \ud55c.<|im_end|>");
}

TEST(TokenizerNfcTest, UnsupportedNormalizerIsUnimplementedNamingFileAndType) {
  const std::vector<std::pair<json, std::string>> cases = {
      {json{{"type", "Lowercase"}}, "Lowercase"},
      {json{{"type", "NFKC"}}, "NFKC"},
      {json{{"type", "Sequence"}, {"normalizers", json::array({json{{"type", "NFC"}}, json{{"type", "Strip"}}})}},
       "Strip"},
  };
  for (const auto& [normalizer, type] : cases) {
    TempDir dir;
    copy_with_edit("qwen2_nfc", dir, [&, &normalizer = normalizer](json* t) { (*t)["normalizer"] = normalizer; });
    Result<Tokenizer> tok = Tokenizer::load(dir.path());
    ASSERT_FALSE(tok.ok()) << type;
    EXPECT_EQ(tok.status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(tok.status().message().find(dir.path() + "/tokenizer.json"), std::string::npos) << tok.status().message();
    EXPECT_NE(tok.status().message().find("normalizer " + type), std::string::npos) << tok.status().message();
  }
}

TEST(SplitTest, PiecesMatchTheRegex) {
  const json splits = read_json(kFixtures + "/splits.json");
  const std::vector<std::string> texts = splits["texts"];
  ASSERT_GE(texts.size(), 30u);
  for (const char* name : {"gpt2", "llama3", "qwen2"}) {
    std::optional<SplitPattern> pattern = recognise_split_pattern(splits[name]["pattern"].get<std::string>());
    ASSERT_TRUE(pattern.has_value()) << name;
    EXPECT_EQ(split_pattern_regex(*pattern), splits[name]["pattern"].get<std::string>());
    for (size_t t = 0; t < texts.size(); ++t) {
      std::vector<ByteSpan> spans;
      split_text(*pattern, texts[t], &spans);
      std::vector<std::string> pieces;
      for (const ByteSpan& s : spans) pieces.push_back(texts[t].substr(s.begin, s.end - s.begin));
      EXPECT_EQ(pieces, splits[name]["pieces"][t].get<std::vector<std::string>>()) << name << ": " << texts[t];
    }
  }
  EXPECT_FALSE(recognise_split_pattern("\\s+").has_value());
}

}  // namespace
}  // namespace strata::model
