// The data tool's tokenization: shards read back through open_dataset, EOS between documents,
// shard cuts, chat loss masks and the errors bad input gets.
#include "data/tokenize.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "data/data.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using model::Tokenizer;

const std::string kFixtures = std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/tokenizer";

class TokenizeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "strata_tokenize_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path(name), std::ios::binary) << text;
    return path(name);
  }
  static std::vector<int32_t> read_all(const std::string& dir) {
    Result<std::unique_ptr<TokenDataset>> ds = open_dataset(DataConfig{{dir}, "auto"});
    EXPECT_TRUE(ds.ok()) << ds.status().to_string();
    if (!ds.ok()) return {};
    std::vector<int32_t> out(static_cast<size_t>((*ds)->num_tokens()));
    EXPECT_TRUE((*ds)->read(0, (*ds)->num_tokens(), out.data()).ok());
    return out;
  }
  static Tokenizer load(const std::string& name) {
    Result<Tokenizer> t = Tokenizer::load(kFixtures + "/" + name);
    EXPECT_TRUE(t.ok()) << t.status().to_string();
    return std::move(t).value();
  }

  std::string dir_;
};

std::vector<int32_t> concat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

TEST_F(TokenizeTest, TextFilesBecomeDocumentsFollowedByEos) {
  const std::string a = "Hello, world! It's a test.\nSecond line 123.";
  const std::string b = "日本語のテキスト 😀\n";
  TokenizeOptions o;
  o.tokenizer = kFixtures + "/gpt2";
  o.inputs = {write("a.txt", a), write("b.txt", b)};
  o.out_dir = path("out");
  Result<TokenizeSummary> s = tokenize_to_shards(o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  Tokenizer tok = load("gpt2");
  const std::vector<int32_t> eos = {tok.eos_id()};
  const std::vector<int32_t> expected = concat({tok.encode(a), eos, tok.encode(b), eos});
  EXPECT_EQ(read_all(o.out_dir), expected);
  EXPECT_EQ(s->documents, 2);
  EXPECT_EQ(s->tokens, static_cast<int64_t>(expected.size()));
  EXPECT_EQ(s->loss_tokens, s->tokens);
  ASSERT_EQ(s->shards.size(), 1u);
  EXPECT_EQ(s->shards[0], o.out_dir + "/train_000000.bin");
  EXPECT_TRUE(s->masks.empty());
  // A 700-token vocabulary fits uint16.
  std::ifstream f(s->shards[0], std::ios::binary);
  int32_t header[3];
  f.read(reinterpret_cast<char*>(header), sizeof(header));
  EXPECT_EQ(header[0], kLlmcMagicU16);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], static_cast<int32_t>(expected.size()));
  EXPECT_EQ(fs::file_size(s->shards[0]), static_cast<uintmax_t>(kLlmcHeaderBytes + 2 * expected.size()));
  EXPECT_FALSE(fs::exists(s->shards[0] + ".tmp"));
}

TEST_F(TokenizeTest, LargeVocabularyWritesLlmcLlama3Shards) {
  // The GPT-2 fixture with an added token at id 70000: too many ids for uint16.
  nlohmann::json spec = nlohmann::json::parse(std::ifstream(kFixtures + "/gpt2/tokenizer.json"), nullptr, false);
  ASSERT_FALSE(spec.is_discarded());
  spec["added_tokens"].push_back({{"id", 70000}, {"content", "<|big|>"}, {"single_word", false}, {"lstrip", false},
                                  {"rstrip", false}, {"normalized", false}, {"special", true}});
  fs::create_directories(path("big"));
  write("big/tokenizer.json", spec.dump());
  TokenizeOptions o;
  o.tokenizer = path("big");
  o.inputs = {write("a.txt", "Hello<|big|> world")};
  o.out_dir = path("out");
  Result<TokenizeSummary> s = tokenize_to_shards(o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  std::ifstream f(s->shards[0], std::ios::binary);
  int32_t header[3];
  f.read(reinterpret_cast<char*>(header), sizeof(header));
  EXPECT_EQ(header[0], 20240801);  // what llm.c's data_common.py writes for llama-3
  EXPECT_EQ(header[1], 7);
  EXPECT_EQ(header[2], static_cast<int32_t>(s->tokens));
  EXPECT_EQ(fs::file_size(s->shards[0]), static_cast<uintmax_t>(kLlmcHeaderBytes + 4 * s->tokens));
  const std::vector<int32_t> ids = read_all(o.out_dir);
  ASSERT_GE(ids.size(), 2u);
  EXPECT_NE(std::find(ids.begin(), ids.end(), 70000), ids.end());
}

TEST_F(TokenizeTest, SentencepieceStyleTokenizerWritesShards) {
  // Llama-2 style: Prepend/Replace normalizer, byte fallback, "<s> $A" template, "</s>" EOS.
  const std::string a = "Grüße, 日本 😀 and plain words.\n  Indented line.";
  TokenizeOptions o;
  o.tokenizer = kFixtures + "/llama2";
  o.inputs = {write("a.txt", a)};
  o.out_dir = path("out");
  Result<TokenizeSummary> s = tokenize_to_shards(o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  Tokenizer tok = load("llama2");
  std::vector<int32_t> expected = tok.encode(a, {.add_special_tokens = true});
  ASSERT_EQ(expected[0], tok.token_to_id("<s>"));
  expected.push_back(tok.token_to_id("</s>"));
  EXPECT_EQ(read_all(o.out_dir), expected);
}

// A tokenizer with neither byte fallback nor <unk> cannot encode a character outside its
// vocabulary: the text is refused naming the file and the byte, in text and JSONL inputs alike
// (it was dropped: 1,450 bytes of text became one end-of-text token, exit 0).
TEST_F(TokenizeTest, TextATokenizerCannotEncodeIsRefusedNamingTheByte) {
  nlohmann::json spec = nlohmann::json::parse(std::ifstream(kFixtures + "/llama2/tokenizer.json"), nullptr, false);
  ASSERT_FALSE(spec.is_discarded());
  spec["model"]["byte_fallback"] = false;
  spec["model"]["unk_token"] = nullptr;
  fs::create_directories(path("narrow"));
  write("narrow/tokenizer.json", spec.dump());
  fs::copy_file(kFixtures + "/llama2/tokenizer_config.json", path("narrow/tokenizer_config.json"));
  const std::string text = "plain words \xE2\x98\x83 and more";  // the snowman is no token
  TokenizeOptions o;
  o.tokenizer = path("narrow");
  o.inputs = {write("a.txt", text)};
  o.out_dir = path("out");
  Result<TokenizeSummary> s = tokenize_to_shards(o);
  ASSERT_FALSE(s.ok()) << "the snowman was dropped";
  EXPECT_NE(s.status().message().find("a.txt: byte 12 (0xE2)"), std::string::npos) << s.status().to_string();
  EXPECT_TRUE(!fs::exists(path("out")) || fs::is_empty(path("out"))) << "shards were left behind";
  TokenizeOptions j = o;
  j.format = TokenizeFormat::kJsonl;
  j.inputs = {write("b.jsonl", "{\"text\": \"fine\"}\n{\"text\": \"" + text + "\"}\n")};
  s = tokenize_to_shards(j);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("b.jsonl:2: \"text\": byte 12"), std::string::npos) << s.status().to_string();
  // The same text through the fixture's own (byte-fallback) tokenizer encodes whole.
  o.tokenizer = kFixtures + "/llama2";
  EXPECT_TRUE(tokenize_to_shards(o).ok());
}

TEST_F(TokenizeTest, JsonlShardsCutAtShardTokensWithTemplate) {
  std::string jsonl;
  std::vector<std::string> texts;
  for (int i = 0; i < 20; ++i) {
    texts.push_back("document " + std::to_string(i) + ": Grüße, 北京 and café.");
    jsonl += nlohmann::json{{"text", texts.back()}, {"id", i}}.dump() + "\n";
    if (i == 7) jsonl += "\n";  // blank lines are skipped
  }
  TokenizeOptions o;
  o.tokenizer = kFixtures + "/llama3";
  o.inputs = {write("docs.jsonl", jsonl)};
  o.out_dir = path("out");
  o.format = TokenizeFormat::kJsonl;
  o.shard_tokens = 50;
  o.progress = true;
  Result<TokenizeSummary> s = tokenize_to_shards(o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  Tokenizer tok = load("llama3");
  std::vector<int32_t> expected;
  for (const auto& t : texts) {
    std::vector<int32_t> ids = tok.encode(t, {.add_special_tokens = true});
    ASSERT_EQ(ids[0], tok.bos_id());  // Llama-3's template puts BOS first
    expected = concat({expected, ids, {tok.eos_id()}});
  }
  EXPECT_EQ(read_all(o.out_dir), expected);
  EXPECT_EQ(s->documents, 20);
  const size_t shards = (expected.size() + 49) / 50;
  ASSERT_EQ(s->shards.size(), shards);
  for (size_t i = 0; i < shards; ++i) {
    const size_t n = i + 1 < shards ? 50 : expected.size() - 50 * (shards - 1);
    EXPECT_EQ(fs::file_size(s->shards[i]), static_cast<uintmax_t>(kLlmcHeaderBytes + 2 * n)) << s->shards[i];
  }
  char name[32];
  std::snprintf(name, sizeof(name), "/train_%06zu.bin", shards - 1);
  EXPECT_EQ(s->shards.back(), o.out_dir + name);

  // Without the template: no BOS.
  o.out_dir = path("raw");
  o.add_special_tokens = false;
  ASSERT_TRUE(tokenize_to_shards(o).ok());
  EXPECT_EQ(read_all(o.out_dir).size(), expected.size() - texts.size());
}

TEST_F(TokenizeTest, LongTextEncodedInPartsMatchesWholeEncoding) {
  std::string text;
  for (int i = 0; text.size() < (size_t{9} << 20); ++i) {
    text += "Line " + std::to_string(i) + " of a long file, with words: Köln 東京 it's\n  indented\n\n";
  }
  TokenizeOptions o;
  o.tokenizer = kFixtures + "/qwen2";
  o.inputs = {write("long.txt", text)};
  o.out_dir = path("out");
  Result<TokenizeSummary> s = tokenize_to_shards(o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  Tokenizer tok = load("qwen2");
  std::vector<int32_t> expected = tok.encode(text);
  expected.push_back(tok.eos_id());
  EXPECT_EQ(read_all(o.out_dir), expected);
  EXPECT_EQ(s->bytes, static_cast<int64_t>(text.size()));
}

TEST_F(TokenizeTest, ChatWritesConversationsAsRenderedWithLossMasks) {
  const nlohmann::json expected = nlohmann::json::parse(
      std::ifstream(kFixtures + "/qwen2/expected.json"), nullptr, false);
  ASSERT_FALSE(expected.is_discarded());
  const nlohmann::json& chat = expected["chat"];
  std::string jsonl;
  for (int i = 0; i < 3; ++i) jsonl += nlohmann::json{{"messages", chat["messages"]}}.dump() + "\n";
  TokenizeOptions o;
  o.tokenizer = kFixtures + "/qwen2";
  o.inputs = {write("chat.jsonl", jsonl)};
  o.out_dir = path("out");
  o.format = TokenizeFormat::kChat;
  o.shard_tokens = 64;
  Result<TokenizeSummary> s = tokenize_to_shards(o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  ASSERT_EQ(s->masks.size(), s->shards.size());
  ASSERT_GE(s->shards.size(), 2u);
  EXPECT_EQ(s->masks[0], o.out_dir + "/masks/train_000000.mask");

  Tokenizer tok = load("qwen2");
  const std::vector<int32_t> ids = chat["ids"];
  const std::vector<uint8_t> mask = chat["mask"];
  // Each conversation exactly as the template renders it, back to back: ChatML ends with
  // "<|im_end|>\n" and no EOS is added after it.
  ASSERT_NE(ids.back(), tok.eos_id());
  std::vector<int32_t> want_ids;
  std::vector<uint8_t> want_mask;
  for (int i = 0; i < 3; ++i) {
    want_ids = concat({want_ids, ids});
    want_mask.insert(want_mask.end(), mask.begin(), mask.end());
  }
  EXPECT_EQ(read_all(o.out_dir), want_ids);  // the masks directory is not read as data
  std::vector<uint8_t> got_mask;
  for (size_t i = 0; i < s->masks.size(); ++i) {
    EXPECT_EQ(loss_mask_path(s->shards[i]), s->masks[i]);
    Result<std::vector<uint8_t>> m = read_loss_mask(s->masks[i]);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(static_cast<int64_t>(m->size()), (i + 1 < s->masks.size()) ? 64 : static_cast<int64_t>(want_ids.size()) - 64 * (static_cast<int64_t>(s->masks.size()) - 1));
    got_mask.insert(got_mask.end(), m->begin(), m->end());
  }
  EXPECT_EQ(got_mask, want_mask);
  int64_t ones = 0;
  for (uint8_t b : want_mask) ones += b;
  EXPECT_EQ(s->loss_tokens, ones);
  EXPECT_GT(ones, 0);
  EXPECT_LT(ones, static_cast<int64_t>(want_mask.size()) / 2);
  // A data shard is not a mask.
  EXPECT_EQ(read_loss_mask(s->shards[0]).status().code(), StatusCode::kCorruption);
}

TEST_F(TokenizeTest, ShareGptAndAlpacaLinesTokenizeAsTheSameOpenAiConversation) {
  const std::string openai =
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour.\n\nOne word."}, {"role": "assistant", "content": "Blue."}]})";
  const std::string sharegpt =
      R"({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Name a colour.\n\nOne word."}, {"from": "gpt", "value": "Blue."}]})";
  const std::string alpaca = R"({"system": "Be brief.", "instruction": "Name a colour.", "input": "One word.", "output": "Blue."})";
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<uint8_t>> masks;
  for (const std::string& line : {openai, sharegpt, alpaca}) {
    TokenizeOptions o;
    o.tokenizer = kFixtures + "/qwen2";
    o.inputs = {write("c" + std::to_string(ids.size()) + ".jsonl", line + "\n")};
    o.out_dir = path("out" + std::to_string(ids.size()));
    o.format = TokenizeFormat::kChat;
    Result<TokenizeSummary> s = tokenize_to_shards(o);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    ids.push_back(read_all(o.out_dir));
    Result<std::vector<uint8_t>> m = read_loss_mask(s->masks[0]);
    ASSERT_TRUE(m.ok());
    masks.push_back(*m);
  }
  EXPECT_EQ(ids[1], ids[0]);
  EXPECT_EQ(ids[2], ids[0]);
  EXPECT_EQ(masks[1], masks[0]);
  EXPECT_EQ(masks[2], masks[0]);
  std::vector<int32_t> counted;
  for (size_t i = 0; i < ids[0].size(); ++i) {
    if (masks[0][i]) counted.push_back(ids[0][i]);
  }
  EXPECT_EQ(load("qwen2").decode(counted), "Blue.<|im_end|>");
}

TEST_F(TokenizeTest, ChatLinesOfUnknownShapeAreRefusedWithFileAndLine) {
  TokenizeOptions o;
  o.tokenizer = kFixtures + "/qwen2";
  o.out_dir = path("out");
  o.format = TokenizeFormat::kChat;
  const std::string good = R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"prompt": "hi", "completion": "yo"})", "no conversation in an object with keys [prompt, completion]"},
      {R"({"conversations": [{"from": "alien", "value": "hi"}]})", "ShareGPT turn from \"alien\""},
      {R"({"instruction": 3, "output": "x"})", "Alpaca \"instruction\" must be a string"},
      {R"([1, 2])", "not a JSON object"},
  };
  for (const auto& [line, why] : bad) {
    o.inputs = {write("bad.jsonl", good + "\n\n" + line + "\n")};
    Result<TokenizeSummary> s = tokenize_to_shards(o);
    ASSERT_FALSE(s.ok()) << line;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("bad.jsonl:3"), std::string::npos) << s.status().message();
    EXPECT_NE(s.status().message().find(why), std::string::npos) << s.status().message();
  }
}

TEST_F(TokenizeTest, Llama3ChatEndsWithEosNeedsNoSeparator) {
  const nlohmann::json expected = nlohmann::json::parse(
      std::ifstream(kFixtures + "/llama3/expected.json"), nullptr, false);
  const nlohmann::json& chat = expected["chat"];
  TokenizeOptions o;
  o.tokenizer = kFixtures + "/llama3";
  o.inputs = {write("chat.jsonl", nlohmann::json{{"messages", chat["messages"]}}.dump() + "\n")};
  o.out_dir = path("out");
  o.format = TokenizeFormat::kChat;
  Result<TokenizeSummary> s = tokenize_to_shards(o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(read_all(o.out_dir), chat["ids"].get<std::vector<int32_t>>());  // ends with <|eot_id|> = eos
  Result<std::vector<uint8_t>> m = read_loss_mask(s->masks[0]);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(*m, chat["mask"].get<std::vector<uint8_t>>());
}

TEST_F(TokenizeTest, BadInputFailsClearlyAndLeavesNothing) {
  TokenizeOptions o;
  o.tokenizer = kFixtures + "/gpt2";
  o.out_dir = path("out");
  o.format = TokenizeFormat::kJsonl;

  o.inputs = {path("missing.jsonl")};
  Result<TokenizeSummary> s = tokenize_to_shards(o);
  EXPECT_EQ(s.status().code(), StatusCode::kNotFound);
  EXPECT_NE(s.status().message().find("missing.jsonl"), std::string::npos);

  // Enough good lines to fill shards before the bad one: those shards are removed again.
  std::string jsonl;
  for (int i = 0; i < 30; ++i) jsonl += R"({"text": "a fine line of text"})" "\n";
  o.inputs = {write("bad.jsonl", jsonl + "{\"text\": \"broken\"\n")};
  o.shard_tokens = 10;
  s = tokenize_to_shards(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("bad.jsonl:31"), std::string::npos) << s.status().message();
  EXPECT_TRUE(fs::is_empty(o.out_dir));

  o.inputs = {write("notext.jsonl", "{\"text\": \"ok\"}\n{\"body\": \"x\"}\n")};
  s = tokenize_to_shards(o);
  EXPECT_NE(s.status().message().find("notext.jsonl:2"), std::string::npos) << s.status().message();

  o.format = TokenizeFormat::kChat;
  o.inputs = {write("c.jsonl", "{\"messages\": [{\"role\": \"user\"}]}\n")};
  o.tokenizer = kFixtures + "/qwen2";
  s = tokenize_to_shards(o);
  EXPECT_NE(s.status().message().find("c.jsonl:1"), std::string::npos) << s.status().message();

  // GPT-2 has no chat template.
  o.tokenizer = kFixtures + "/gpt2";
  o.inputs = {write("c2.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n")};
  s = tokenize_to_shards(o);
  EXPECT_EQ(s.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(s.status().message().find("tokenizer_config.json"), std::string::npos) << s.status().message();

  // An output directory that already holds shards is refused.
  o.format = TokenizeFormat::kText;
  o.inputs = {write("t.txt", "text")};
  ASSERT_TRUE(tokenize_to_shards(o).ok());
  s = tokenize_to_shards(o);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("already holds shards"), std::string::npos);
}

// Every file the data layer reads whole is checked first: a directory or FIFO where an input or
// a loss mask should be is named as such (a directory's size used to be taken as -1 and
// allocated), and a mask byte other than 0 or 1 is refused with its token.
TEST_F(TokenizeTest, DirectoriesAndFifosAreNamedNotRead) {
  fs::create_directories(path("masks/train_000000.mask"));
  Result<std::vector<uint8_t>> m = read_loss_mask(path("masks/train_000000.mask"));
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("train_000000.mask: is a directory, where the loss mask file should be"), std::string::npos)
      << m.status().message();

  TokenizeOptions o;
  o.tokenizer = kFixtures + "/gpt2";
  o.out_dir = path("out");
  o.format = TokenizeFormat::kText;
  fs::create_directories(path("texts"));
  o.inputs = {path("texts")};
  Result<TokenizeSummary> s = tokenize_to_shards(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("texts: is a directory, where the input file should be"), std::string::npos)
      << s.status().message();
  ASSERT_EQ(::mkfifo(path("pipe").c_str(), 0600), 0);
  o.inputs = {path("pipe")};
  s = tokenize_to_shards(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("pipe: is a FIFO"), std::string::npos) << s.status().message();
}

TEST_F(TokenizeTest, MaskBytesOtherThanZeroAndOneAreRefused) {
  TokenizeOptions o;
  o.tokenizer = kFixtures + "/qwen2";
  o.out_dir = path("out");
  o.format = TokenizeFormat::kChat;
  o.inputs = {write("c.jsonl", R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})"
                               "\n")};
  Result<TokenizeSummary> s = tokenize_to_shards(o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  ASSERT_FALSE(s->masks.empty());
  const std::string mask = s->masks[0];
  ASSERT_TRUE(read_loss_mask(mask).ok());
  {
    std::fstream f(mask, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(256 * 4 + 2);
    f.put(static_cast<char>(2));
  }
  Result<std::vector<uint8_t>> m = read_loss_mask(mask);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kCorruption);
  EXPECT_NE(m.status().message().find("token 2 has mask value 2"), std::string::npos) << m.status().message();
}

TEST(TokenizeParseTest, TokenCountsAndFormats) {
  EXPECT_EQ(parse_token_count("100M").value(), 100'000'000);
  EXPECT_EQ(parse_token_count("1.5B").value(), 1'500'000'000);
  EXPECT_EQ(parse_token_count("250k").value(), 250'000);
  EXPECT_EQ(parse_token_count("4096").value(), 4096);
  for (const char* bad : {"", "M", "-5", "0", "1.5", "ten", "5X", "1.2.3M"}) {
    EXPECT_FALSE(parse_token_count(bad).ok()) << bad;
  }
  EXPECT_EQ(parse_tokenize_format("chat").value(), TokenizeFormat::kChat);
  EXPECT_FALSE(parse_tokenize_format("csv").ok());
}

}  // namespace
}  // namespace strata
