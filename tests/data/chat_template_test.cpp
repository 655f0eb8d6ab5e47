// Chat templates of public model repositories against transformers' own renderer: for each
// template of tests/fixtures/chat_templates and each test conversation, strata's text equals
// the expected one byte for byte (or both refuse the conversation), its assistant spans equal
// the ones the renders give, and with a fixture tokenizer the ids equal apply_chat_template's.
// make_expected.py there writes expected.json.
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
#include "test_util.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;
using ordered_json = nlohmann::ordered_json;

const std::string kDir = std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/chat_templates";
const std::string kTokenizers = std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/tokenizer";

using strata::testing::read_text;

const ordered_json& expected() {
  static const ordered_json j = ordered_json::parse(read_text(kDir + "/expected.json"));
  return j;
}

// make_expected.py's clock: 2024-09-15 12:00 in local time, with TZ=UTC.
std::time_t fixed_now() {
  ::setenv("TZ", "UTC", 1);
  ::tzset();
  std::tm tm{};
  tm.tm_year = 2024 - 1900;
  tm.tm_mon = 8;
  tm.tm_mday = 15;
  tm.tm_hour = 12;
  return ::timegm(&tm);
}

ChatRenderOptions options_of(const ordered_json& conv) {
  ChatRenderOptions o;
  o.add_generation_prompt = conv.value("add_generation_prompt", false);
  if (conv.contains("tools")) o.tools = conv["tools"];
  if (conv.contains("variables")) o.variables = conv["variables"];
  o.now = fixed_now();
  return o;
}

std::string str_or_empty(const ordered_json& j) { return j.is_string() ? j.get<std::string>() : std::string(); }

ChatTemplate load(const ordered_json& entry) {
  Result<ChatTemplate> t = ChatTemplate::parse(read_text(kDir + "/" + entry["file"].get<std::string>()), entry["name"],
                                               str_or_empty(entry["bos_token"]), str_or_empty(entry["eos_token"]));
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return t.ok() ? std::move(t).value() : ChatTemplate();
}

const ordered_json& conversation(const std::string& name) {
  for (const ordered_json& c : expected()["conversations"]) {
    if (c["name"] == name) return c;
  }
  ADD_FAILURE() << "no conversation " << name;
  static const ordered_json none;
  return none;
}

TEST(ChatTemplateTest, AtLeastThirtyPublicTemplatesOverEightConversations) {
  EXPECT_GE(expected()["templates"].size(), 30u);
  EXPECT_GE(expected()["conversations"].size(), 8u);
}

TEST(ChatTemplateTest, RenderingEqualsTransformersByteForByte) {
  int compared = 0, refused = 0;
  for (const ordered_json& entry : expected()["templates"]) {
    const ChatTemplate t = load(entry);
    for (const auto& [name, want] : entry["renders"].items()) {
      const ordered_json& conv = conversation(name);
      Result<std::string> text = t.render(conv["messages"], options_of(conv));
      if (want.contains("error")) {
        EXPECT_FALSE(text.ok()) << entry["name"] << " / " << name << ": transformers refused it (" << want["error"]
                                << "), strata rendered it";
        if (!text.ok()) EXPECT_EQ(text.status().code(), StatusCode::kInvalidArgument);
        ++refused;
        continue;
      }
      ASSERT_TRUE(text.ok()) << entry["name"] << " / " << name << ": " << text.status().to_string();
      EXPECT_EQ(*text, want["text"].get<std::string>()) << entry["name"] << " / " << name;
      ++compared;
    }
  }
  EXPECT_GE(compared, 300);
  EXPECT_GT(refused, 0);
}

TEST(ChatTemplateTest, AssistantSpansEqualTheRenderedTurns) {
  int spans = 0, loop_only = 0;
  for (const ordered_json& entry : expected()["templates"]) {
    const ChatTemplate t = load(entry);
    for (const auto& [name, want] : entry["renders"].items()) {
      if (!want.contains("spans")) continue;
      const ordered_json& conv = conversation(name);
      Result<RenderedChat> r = t.render_with_spans(conv["messages"], options_of(conv));
      ASSERT_TRUE(r.ok()) << entry["name"] << " / " << name << ": " << r.status().to_string();
      EXPECT_EQ(r->text, want["text"].get<std::string>()) << entry["name"] << " / " << name;
      ASSERT_EQ(r->assistant.size(), want["spans"].size()) << entry["name"] << " / " << name;
      for (size_t k = 0; k < r->assistant.size(); ++k) {
        const ordered_json& s = want["spans"][k];
        const ByteSpan got = r->assistant[k];
        const std::string where = entry["name"].get<std::string>() + " / " + name + " message " + s["message"].dump() +
                                  ": got [" + r->text.substr(got.begin, got.end - got.begin) + "]";
        if (!s["start"].is_null()) EXPECT_EQ(got.begin, s["start"].get<uint32_t>()) << where;
        if (s["end"].is_null()) {
          ++loop_only;  // the template renders a reply differently when more follows
          EXPECT_LE(got.begin, got.end) << where;
        } else {
          EXPECT_EQ(got.end, s["end"].get<uint32_t>()) << where;
        }
        ++spans;
      }
    }
  }
  EXPECT_GE(spans, 400);
  EXPECT_LT(loop_only, spans / 2);
}

// A tokenizer directory: a fixture tokenizer.json and a tokenizer_config.json with the template.
class ChatDir {
 public:
  ChatDir(const std::string& tokenizer, const ordered_json& config) {
    std::string tmpl = ::testing::TempDir() + "strata_chat_XXXXXX";
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path_ = tmpl;
    fs::copy_file(kTokenizers + "/" + tokenizer + "/tokenizer.json", path_ + "/tokenizer.json");
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

TEST(ChatTemplateTest, IdsEqualApplyChatTemplateAndMasksCoverTheSpans) {
  int compared = 0;
  for (const ordered_json& entry : expected()["templates"]) {
    if (!entry["ids_tokenizer"].is_string()) continue;
    ordered_json config = {{"chat_template", read_text(kDir + "/" + entry["file"].get<std::string>())}};
    Result<Tokenizer> plain = Tokenizer::load(kTokenizers + "/" + entry["ids_tokenizer"].get<std::string>() + "/tokenizer.json");
    ASSERT_TRUE(plain.ok());
    for (const char* k : {"bos_token", "eos_token"}) {  // those the fixture vocabulary has
      if (entry[k].is_string() && plain->token_to_id(entry[k].get<std::string>()) >= 0) config[k] = entry[k];
    }
    ChatDir dir(entry["ids_tokenizer"], config);
    Result<Tokenizer> tok = Tokenizer::load(dir.path());
    ASSERT_TRUE(tok.ok()) << entry["name"] << ": " << tok.status().to_string();
    for (const auto& [name, want] : entry["renders"].items()) {
      if (!want.contains("spans")) continue;
      const ordered_json& conv = conversation(name);
      Result<EncodedChat> chat = tok->encode_chat(conv["messages"], options_of(conv));
      ASSERT_TRUE(chat.ok()) << entry["name"] << " / " << name << ": " << chat.status().to_string();
      EXPECT_EQ(chat->ids, want["ids"].get<std::vector<int32_t>>()) << entry["name"] << " / " << name;
      // The counted tokens are exactly those overlapping the expected spans.
      std::vector<ByteSpan> token_spans;
      std::vector<int32_t> ids;
      tok->encode_with_spans(chat->text, {.add_special_tokens = false, .parse_special = true}, &ids, &token_spans);
      for (size_t i = 0; i < ids.size(); ++i) {
        bool in_span = false;
        for (const ordered_json& s : want["spans"]) {
          if (s["start"].is_null()) continue;
          const uint32_t b = s["start"], e = s["end"].is_null() ? b : s["end"].get<uint32_t>();
          in_span = in_span || (token_spans[i].begin < e && b < token_spans[i].end);
        }
        const bool all_known = std::none_of(want["spans"].begin(), want["spans"].end(), [](const ordered_json& s) {
          return s["start"].is_null() || s["end"].is_null();
        });
        if (all_known) {
          EXPECT_EQ(chat->loss_mask[i], in_span ? 1 : 0) << entry["name"] << " / " << name << " token " << i;
        }
      }
      ++compared;
    }
  }
  EXPECT_GE(compared, 40);
}

TEST(ChatTemplateTest, QwenMaskCountsTheReplyAndItsEndMarkerOnly) {
  const std::string qwen = read_text(kDir + "/Qwen-Qwen2.5-7B-Instruct.jinja");
  ChatDir dir("qwen2", {{"chat_template", qwen}, {"eos_token", "<|im_end|>"}});
  Result<Tokenizer> tok = Tokenizer::load(dir.path());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  Result<EncodedChat> chat = tok->encode_chat(ordered_json::parse(R"([{"role":"user","content":"Hi there"},{"role":"assistant","content":"Hello!"}])"));
  ASSERT_TRUE(chat.ok()) << chat.status().to_string();
  std::vector<int32_t> counted;
  for (size_t i = 0; i < chat->ids.size(); ++i) {
    if (chat->loss_mask[i]) counted.push_back(chat->ids[i]);
  }
  EXPECT_EQ(tok->decode(counted), "Hello!<|im_end|>");
  EXPECT_EQ(chat->text.rfind("<|im_start|>system\nYou are Qwen", 0), 0u) << chat->text;  // its default system message
}

TEST(ChatTemplateTest, TemplateIsReadFromAStringANamedListOrChatTemplateJinja) {
  const ordered_json list = {{"chat_template", ordered_json::array({{{"name", "tool_use"}, {"template", "T"}}, {{"name", "default"}, {"template", "D"}}})}};
  Result<std::optional<std::string>> r = read_chat_template(list, "/x/tokenizer_config.json", "");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->value(), "D");
  EXPECT_EQ(read_chat_template(list, "/x/tokenizer_config.json", "tool_use")->value(), "T");
  Result<std::optional<std::string>> missing = read_chat_template(list, "/x/tokenizer_config.json", "rag");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("tool_use, default"), std::string::npos) << missing.status().message();
  EXPECT_NE(missing.status().message().find("/x/tokenizer_config.json"), std::string::npos);
  EXPECT_FALSE(read_chat_template(ordered_json::object(), "/x/tokenizer_config.json", "")->has_value());
  EXPECT_FALSE(read_chat_template({{"chat_template", 3}}, "/x/tokenizer_config.json", "").ok());
  // chat_template.jinja beside the config wins, as in transformers.
  ChatDir dir("qwen2", {{"chat_template", "from config"}, {"eos_token", "<|im_end|>"}});
  std::ofstream(dir.path() + "/chat_template.jinja") << "{% for m in messages %}[{{ m.role }}]{% endfor %}\n";
  Result<Tokenizer> tok = Tokenizer::load(dir.path());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  ASSERT_TRUE(tok->chat_template().has_value());
  EXPECT_EQ(tok->chat_template()->render(ordered_json::parse(R"([{"role":"user","content":"x"}])"), {}).value(), "[user]");
}

TEST(ChatTemplateTest, RefusalsNameTheConfigAndTheTemplateLine) {
  ChatDir dir("qwen2", {{"chat_template", "{% for m in messages %}\n{{ m.content | frobnicate }}{% endfor %}"}, {"eos_token", "<|im_end|>"}});
  Result<Tokenizer> tok = Tokenizer::load(dir.path());
  ASSERT_FALSE(tok.ok());
  EXPECT_NE(tok.status().message().find(dir.path() + "/tokenizer_config.json chat_template line 2"), std::string::npos)
      << tok.status().message();
  EXPECT_NE(tok.status().message().find("frobnicate"), std::string::npos);
  // raise_exception's message, for a conversation the template refuses.
  Result<ChatTemplate> g2 = ChatTemplate::parse(read_text(kDir + "/google-gemma-2-it.jinja"), "gemma", "<bos>", "<eos>");
  ASSERT_TRUE(g2.ok());
  Result<std::string> r = g2->render(ordered_json::parse(R"([{"role":"system","content":"x"},{"role":"user","content":"y"}])"), {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("System role not supported"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("gemma line 1"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace strata::model
