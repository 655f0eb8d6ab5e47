#include "data/chat_template.h"

#include "core/check.h"
#include "data/tokenizer_unicode.h"

namespace strata::model {

namespace {

struct KnownTemplate {
  uint64_t hash;  // chat_template_hash of the template as its model repository ships it
  ChatFormat format;
  const char* name;
  const char* default_system;
  bool basic_roles_only;
  bool space_after_eos;
};

// The texts are in tests/fixtures/tokenizer/make_chat_fixture.py, which prints these hashes.
constexpr KnownTemplate kKnown[] = {
    {0xabcc246a94341a38, ChatFormat::kChatML, "ChatML", "", false, false},
    {0xb467173160c28633, ChatFormat::kChatML, "Qwen2-Instruct", "You are a helpful assistant.", false, false},
    {0x03b81a33de11082f, ChatFormat::kChatML, "Qwen2.5-Instruct",
     "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", true, false},
    {0xae8ac1f53b8942b4, ChatFormat::kLlama3, "Llama-3-Instruct", "", false, false},
    {0xaa5a919425524ea9, ChatFormat::kLlama31, "Llama-3.1-Instruct", "", true, false},
    {0xdd39f833422aa4a9, ChatFormat::kMistral, "Mistral-Instruct", "", false, false},
    {0xbb4524ed7672ee76, ChatFormat::kMistral, "Mistral-Instruct (a space after </s>)", "", false, true},
};

// Llama-3.1's system header when no date_string is passed (the template's default).
constexpr std::string_view kLlama31Dates = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";

bool is_ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// Jinja's trim filter: Python's str.strip(), Unicode whitespace at both ends.
std::string_view trim(std::string_view s) {
  std::vector<DecodedChar> chars;
  decode_utf8(s, &chars);
  size_t b = 0, e = chars.size();
  while (b < e && is_space(chars[b].cp)) ++b;
  while (e > b && is_space(chars[e - 1].cp)) --e;
  if (b == e) return {};
  const size_t begin = chars[b].byte_offset;
  const size_t end = e < chars.size() ? chars[e].byte_offset : s.size();
  return s.substr(begin, end - begin);
}

bool basic_role(const std::string& role) { return role == "system" || role == "user" || role == "assistant"; }

}  // namespace

std::string normalize_chat_template(std::string_view t) {
  std::string out;
  out.reserve(t.size());
  const size_t n = t.size();
  size_t i = 0;
  while (i < n) {
    if (t.substr(i, 2) == "{#") {  // comment
      const size_t j = t.find("#}", i + 2);
      i = j == std::string_view::npos ? n : j + 2;
      continue;
    }
    if (t.substr(i, 2) == "{{" || t.substr(i, 2) == "{%") {
      const std::string_view close = t[i + 1] == '{' ? "}}" : "%}";
      out.append(t.substr(i, 2));
      i += 2;
      if (i < n && (t[i] == '-' || t[i] == '+')) ++i;
      while (i < n) {
        const char c = t[i];
        if (c == '\'' || c == '"') {  // a string: kept verbatim, quoted with '
          size_t j = i + 1;
          while (j < n && t[j] != c) j += t[j] == '\\' ? 2 : 1;
          out += '\'';
          out.append(t.substr(i + 1, std::min(j, n) - (i + 1)));
          out += '\'';
          i = j + 1;
        } else if ((c == '-' || c == '+') && t.substr(i + 1, 2) == close) {
          ++i;
        } else if (t.substr(i, 2) == close) {
          out.append(close);
          i += 2;
          break;
        } else {
          if (!is_ascii_space(c)) out += c;
          ++i;
        }
      }
      continue;
    }
    if (!is_ascii_space(t[i])) out += t[i];
    ++i;
  }
  return out;
}

uint64_t chat_template_hash(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : normalize_chat_template(text)) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

ChatTemplate recognise_chat_template(std::string_view text) {
  ChatTemplate t;
  t.hash = chat_template_hash(text);
  t.format = ChatFormat::kUnknown;
  for (const KnownTemplate& k : kKnown) {
    if (k.hash != t.hash) continue;
    t.format = k.format;
    t.name = k.name;
    t.default_system = k.default_system;
    t.basic_roles_only = k.basic_roles_only;
    t.space_after_eos = k.space_after_eos;
  }
  return t;
}

Result<RenderedChat> render_chat(const ChatTemplate& tmpl, std::span<const ChatMessage> messages,
                                 std::string_view bos_token, std::string_view eos_token) {
  CHECK(tmpl.format != ChatFormat::kNone && tmpl.format != ChatFormat::kUnknown);
  if (messages.empty()) return Status::InvalidArgument("a conversation without messages");
  for (const ChatMessage& m : messages) {
    if (tmpl.basic_roles_only && !basic_role(m.role)) {
      return Status::InvalidArgument("role \"" + m.role + "\": the " + tmpl.name +
                                     " template renders tool turns in a form strata does not; use system, user and "
                                     "assistant");
    }
  }
  RenderedChat out;
  std::string& text = out.text;
  // Appends a turn's content and end marker; an assistant's count towards the loss.
  auto reply = [&](const ChatMessage& m, std::string_view content, std::string_view end) {
    const auto begin = static_cast<uint32_t>(text.size());
    text.append(content);
    text.append(end);
    if (m.role == "assistant") out.assistant.push_back({begin, static_cast<uint32_t>(text.size())});
  };
  switch (tmpl.format) {
    case ChatFormat::kChatML:
      if (!tmpl.default_system.empty() && messages[0].role != "system") {
        text += "<|im_start|>system\n" + tmpl.default_system + "<|im_end|>\n";
      }
      for (const ChatMessage& m : messages) {
        text += "<|im_start|>" + m.role + "\n";
        reply(m, m.content, "<|im_end|>");
        text += "\n";
      }
      break;
    case ChatFormat::kLlama3:
    case ChatFormat::kLlama31: {
      text.append(bos_token);
      size_t first = 0;
      if (tmpl.format == ChatFormat::kLlama31) {  // the system message always comes first, in its header
        text += "<|start_header_id|>system<|end_header_id|>\n\n";
        text.append(kLlama31Dates);
        if (messages[0].role == "system") {
          text.append(trim(messages[0].content));
          first = 1;
        }
        text += "<|eot_id|>";
      }
      for (const ChatMessage& m : messages.subspan(first)) {
        text += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n";
        reply(m, trim(m.content), "<|eot_id|>");
      }
      break;
    }
    case ChatFormat::kMistral:
      text.append(bos_token);
      for (size_t i = 0; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if ((m.role == "user") != (i % 2 == 0) || (m.role != "user" && m.role != "assistant")) {
          return Status::InvalidArgument("message " + std::to_string(i) + " has role \"" + m.role + "\": the " +
                                         tmpl.name + " template takes user and assistant turns alternating, "
                                         "user first (no system message)");
        }
        if (m.role == "user") {
          text += "[INST] " + m.content + " [/INST]";
        } else {
          reply(m, m.content, eos_token);
          if (tmpl.space_after_eos) text += " ";
        }
      }
      break;
    case ChatFormat::kNone:
    case ChatFormat::kUnknown:
      break;
  }
  return out;
}

}  // namespace strata::model
