// Chat templates against transformers' apply_chat_template: for each template strata
// recognises and each test conversation, the rendered text, and with a fixture tokenizer the ids
// and the loss mask (tests/fixtures/tokenizer/make_chat_fixture.py builds chat/expected.json).
#include "data/chat_template.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::string kFixtures = std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/tokenizer";

json read_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << path;
  return j;
}

std::vector<ChatMessage> messages_of(const json& conv) {
  std::vector<ChatMessage> out;
  for (const json& m : conv) out.push_back({m["role"], m["content"]});
  return out;
}

std::string str_or_empty(const json& j) { return j.is_string() ? j.get<std::string>() : std::string(); }

// A tokenizer directory: a fixture's tokenizer.json with a tokenizer_config.json naming the
// template and its BOS/EOS tokens.
class ChatDir {
 public:
  ChatDir(const std::string& tokenizer, const json& entry) {
    std::string tmpl = ::testing::TempDir() + "strata_chat_XXXXXX";
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path_ = tmpl;
    fs::copy_file(kFixtures + "/" + tokenizer + "/tokenizer.json", path_ + "/tokenizer.json");
    json config = {{"chat_template", entry["template"]}, {"bos_token", entry["bos_token"]},
                   {"eos_token", entry["eos_token"]}};
    std::ofstream(path_ + "/tokenizer_config.json") << config.dump();
  }
  ~ChatDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

const json& fixture() {
  static const json j = read_json(kFixtures + "/chat/expected.json");
  return j;
}

const json& entry_named(const std::string& name) {
  for (const json& e : fixture()["templates"]) {
    if (e["name"] == name) return e;
  }
  ADD_FAILURE() << "no template " << name << " in chat/expected.json";
  static const json empty;
  return empty;
}

TEST(ChatTemplateTest, KnownTemplatesAreRecognisedByTheirHash) {
  ASSERT_EQ(fixture()["templates"].size(), 7u);
  for (const json& e : fixture()["templates"]) {
    const std::string text = e["template"];
    char hash[17];
    std::snprintf(hash, sizeof(hash), "%016llx", static_cast<unsigned long long>(chat_template_hash(text)));
    EXPECT_EQ(std::string(hash), e["hash"].get<std::string>()) << e["name"] << ": normalization differs from the script's";
    const ChatTemplate t = recognise_chat_template(text);
    EXPECT_NE(t.format, ChatFormat::kUnknown) << e["name"];
    EXPECT_NE(t.format, ChatFormat::kNone) << e["name"];
  }
  EXPECT_EQ(recognise_chat_template(entry_named("qwen2.5")["template"].get<std::string>()).default_system,
            "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  EXPECT_EQ(recognise_chat_template(entry_named("llama3.1")["template"].get<std::string>()).format, ChatFormat::kLlama31);
  EXPECT_EQ(recognise_chat_template(entry_named("mistral")["template"].get<std::string>()).format, ChatFormat::kMistral);
}

TEST(ChatTemplateTest, LayoutAndQuoteStyleDoNotMatterButContentDoes) {
  const std::string qwen2 = entry_named("qwen2")["template"];
  // Reindented, with whitespace control and double quotes: the same template to Jinja.
  std::string relaid = qwen2;
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"{% for", "{%- for"}, {"%}{% if", "%}\n  {% if"}, {"{{'<|im_start|>' + message['role']", "{{ \"<|im_start|>\" + message[\"role\"]"}}) {
    const size_t at = relaid.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    relaid.replace(at, from.size(), to);
  }
  EXPECT_EQ(chat_template_hash(relaid), chat_template_hash(qwen2));
  EXPECT_EQ(recognise_chat_template(relaid).default_system, "You are a helpful assistant.");
  // A different default system message is a different template.
  std::string other = qwen2;
  other.replace(other.find("You are a helpful assistant."), 28, "You are a pirate.");
  EXPECT_EQ(recognise_chat_template(other).format, ChatFormat::kUnknown);
  // A space inside a string is content.
  std::string spaced = entry_named("mistral")["template"];
  spaced.replace(spaced.find("'[INST] '"), 9, "'[INST]'");
  EXPECT_EQ(recognise_chat_template(spaced).format, ChatFormat::kUnknown);
  // Comments are not.
  EXPECT_EQ(chat_template_hash("{# a comment #}" + qwen2), chat_template_hash(qwen2));
}

TEST(ChatTemplateTest, RenderedTextMatchesApplyChatTemplate) {
  int compared = 0;
  for (const json& e : fixture()["templates"]) {
    const ChatTemplate t = recognise_chat_template(e["template"].get<std::string>());
    for (const json& c : e["conversations"]) {
      Result<RenderedChat> r = render_chat(t, messages_of(c["messages"]), str_or_empty(e["bos_token"]),
                                           str_or_empty(e["eos_token"]));
      ASSERT_TRUE(r.ok()) << e["name"] << ": " << r.status().to_string();
      EXPECT_EQ(r->text, c["text"].get<std::string>()) << e["name"] << " " << c["messages"].dump();
      ++compared;
    }
  }
  EXPECT_EQ(compared, 36);
}

TEST(ChatTemplateTest, IdsAndLossMasksMatchApplyChatTemplate) {
  int compared = 0;
  for (const json& e : fixture()["templates"]) {
    if (e["tokenizer"].is_null()) continue;
    ChatDir dir(e["tokenizer"], e);
    Result<Tokenizer> tok = Tokenizer::load(dir.path());
    ASSERT_TRUE(tok.ok()) << tok.status().to_string();
    for (const json& c : e["conversations"]) {
      Result<EncodedChat> chat = tok->encode_chat(messages_of(c["messages"]));
      ASSERT_TRUE(chat.ok()) << e["name"] << ": " << chat.status().to_string();
      EXPECT_EQ(chat->text, c["text"].get<std::string>()) << e["name"];
      EXPECT_EQ(chat->ids, c["ids"].get<std::vector<int32_t>>()) << e["name"] << " " << c["messages"].dump();
      EXPECT_EQ(chat->loss_mask, c["mask"].get<std::vector<uint8_t>>()) << e["name"] << " " << c["messages"].dump();
      ++compared;
    }
  }
  EXPECT_EQ(compared, 36);
}

TEST(ChatTemplateTest, DefaultSystemMessageIsNotCountedTowardsTheLoss) {
  const json& e = entry_named("qwen2");
  ChatDir dir("qwen2", e);
  Result<Tokenizer> tok = Tokenizer::load(dir.path());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  std::vector<ChatMessage> messages = {{"user", "Hi there"}, {"assistant", "Hello!"}};
  Result<EncodedChat> chat = tok->encode_chat(messages);
  ASSERT_TRUE(chat.ok()) << chat.status().to_string();
  EXPECT_EQ(chat->text.rfind("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", 0), 0u) << chat->text;
  std::vector<int32_t> counted;
  for (size_t i = 0; i < chat->ids.size(); ++i) {
    if (chat->loss_mask[i]) counted.push_back(chat->ids[i]);
  }
  EXPECT_EQ(tok->decode(counted), "Hello!<|im_end|>");
  EXPECT_EQ(chat->text.substr(chat->text.size() - 11), "<|im_end|>\n");  // no EOS after the template's end
}

TEST(ChatTemplateTest, ConversationsATemplateRefusesAreInvalidArgument) {
  const ChatTemplate mistral = recognise_chat_template(entry_named("mistral")["template"].get<std::string>());
  const std::vector<std::vector<ChatMessage>> bad = {
      {{"system", "Be brief."}, {"user", "Hi"}},
      {{"user", "Hi"}, {"user", "Hello?"}},
      {{"assistant", "I start."}},
  };
  for (const auto& conv : bad) {
    Result<RenderedChat> r = render_chat(mistral, conv, "<s>", "</s>");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("alternating"), std::string::npos) << r.status().message();
  }
  const ChatTemplate qwen25 = recognise_chat_template(entry_named("qwen2.5")["template"].get<std::string>());
  std::vector<ChatMessage> tool = {{"user", "Weather?"}, {"tool", "{\"sunny\": true}"}};
  Result<RenderedChat> r = render_chat(qwen25, tool, "", "<|im_end|>");
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("\"tool\""), std::string::npos) << r.status().message();
  EXPECT_EQ(render_chat(qwen25, {}, "", "<|im_end|>").status().code(), StatusCode::kInvalidArgument);
}

TEST(ChatTemplateTest, UnknownTemplateNamesTheConfigAndTheKnownFamilies) {
  json e = entry_named("llama3");
  e["template"] = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}";
  ChatDir dir("llama3", e);
  Result<Tokenizer> tok = Tokenizer::load(dir.path());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  EXPECT_EQ(tok->chat_format(), ChatFormat::kUnknown);
  std::vector<ChatMessage> messages = {{"user", "hi"}};
  Result<EncodedChat> chat = tok->encode_chat(messages);
  ASSERT_FALSE(chat.ok());
  EXPECT_EQ(chat.status().code(), StatusCode::kUnimplemented);
  for (const std::string needle : {dir.path() + "/tokenizer_config.json", std::string("Qwen2/Qwen2.5"),
                                   std::string("Llama-3/3.1"), std::string("Mistral"), std::string("jsonl")}) {
    EXPECT_NE(chat.status().message().find(needle), std::string::npos) << chat.status().message();
  }
}

}  // namespace
}  // namespace strata::model
