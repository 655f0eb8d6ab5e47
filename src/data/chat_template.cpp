#include "data/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace strata::model {
namespace {

using jinja::Value;

bool is_layout_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

size_t common_prefix(std::string_view a, std::string_view b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

// A prefix of `messages` holding the same message dicts.
Value first_messages(const Value& messages, size_t count) {
  return Value::make_list(jinja::List(messages.list->begin(), messages.list->begin() + static_cast<std::ptrdiff_t>(count)));
}

std::string role_of(const nlohmann::ordered_json& m) {
  auto it = m.find("role");
  return it != m.end() && it->is_string() ? it->get<std::string>() : std::string();
}

}  // namespace

Result<ChatTemplate> ChatTemplate::parse(std::string_view text, std::string source, std::string bos_token,
                                         std::string eos_token) {
  Result<JinjaTemplate> t = JinjaTemplate::parse(text);
  if (!t.ok()) return Status::InvalidArgument(source + " " + t.status().message());
  ChatTemplate c;
  c.template_ = std::move(t).value();
  c.source_ = std::move(source);
  c.bos_token_ = std::move(bos_token);
  c.eos_token_ = std::move(eos_token);
  return c;
}

Result<JinjaOutput> ChatTemplate::run(const Value& messages, const ChatRenderOptions& options, bool generation_prompt,
                                      bool track) const {
  std::vector<std::pair<std::string, Value>> vars;
  if (options.variables.is_object()) {
    for (auto it = options.variables.begin(); it != options.variables.end(); ++it) {
      vars.emplace_back(it.key(), jinja::from_json(it.value()));
    }
  }
  if (!bos_token_.empty()) vars.emplace_back("bos_token", Value::string(bos_token_));
  if (!eos_token_.empty()) vars.emplace_back("eos_token", Value::string(eos_token_));
  // apply_chat_template passes tools=None and documents=None when there are none; templates
  // test `tools is not none`.
  vars.emplace_back("tools", options.tools.is_null() ? Value::none() : jinja::from_json(options.tools));
  vars.emplace_back("documents", Value::none());
  vars.emplace_back("add_generation_prompt", Value::boolean(generation_prompt));
  vars.emplace_back("messages", messages);
  JinjaOptions jo;
  jo.now = options.now;
  Result<JinjaOutput> out = template_.render_values(vars, track ? messages : Value(), jo);
  if (!out.ok()) return Status::InvalidArgument(source_ + " " + out.status().message());
  return out;
}

Result<std::string> ChatTemplate::render(const nlohmann::ordered_json& messages, const ChatRenderOptions& options) const {
  if (!messages.is_array()) return Status::InvalidArgument("messages must be a JSON list");
  ASSIGN_OR_RETURN(JinjaOutput out, run(jinja::from_json(messages), options, options.add_generation_prompt, false));
  return std::move(out.text);
}

Result<ByteSpan> ChatTemplate::turn_of(const Value& all, size_t i, const JinjaOutput& whole,
                                       const ChatRenderOptions& options) const {
  if (whole.item_spans[i].end > 0) return whole.item_spans[i];
  // A template that loops over indices (range(messages|length)) binds no message as its item:
  // then the conversation up to message i, when the whole text starts with it, ends the turn.
  ASSIGN_OR_RETURN(JinjaOutput upto, run(first_messages(all, i + 1), options, false, false));
  if (upto.text.empty() || whole.text.compare(0, upto.text.size(), upto.text) != 0) {
    return Status::InvalidArgument(source_ + ": cannot find the text of assistant message " + std::to_string(i) +
                                   " (no loop over the messages wrote it, and the conversation up to it renders "
                                   "differently from the start of the whole)");
  }
  return ByteSpan{0, static_cast<uint32_t>(upto.text.size())};
}

Result<RenderedChat> ChatTemplate::render_with_spans(const nlohmann::ordered_json& messages,
                                                     const ChatRenderOptions& options) const {
  if (!messages.is_array() || messages.empty()) return Status::InvalidArgument("a conversation without messages");
  const Value all = jinja::from_json(messages);
  ASSIGN_OR_RETURN(JinjaOutput whole, run(all, options, false, true));
  RenderedChat out;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (role_of(messages[i]) != "assistant") continue;
    const std::string which = "assistant message " + std::to_string(i);
    ASSIGN_OR_RETURN(const ByteSpan turn, turn_of(all, i, whole, options));
    Result<JinjaOutput> prompt = run(first_messages(all, i), options, true, false);
    if (!prompt.ok()) {
      return prompt.status().with_context("rendering the conversation before " + which + " as a prompt");
    }
    // Never before the message's own text: a template may render earlier turns differently
    // when a reply follows (Mistral-Nemo moves the system message into the last user turn).
    const size_t start = std::max<size_t>(common_prefix(prompt->text, whole.text), turn.begin);
    size_t end = i + 1 == messages.size() ? whole.text.size() : turn.end;
    while (end > turn.begin && is_layout_space(whole.text[end - 1])) --end;
    // An empty reply after a generation prompt that ends in whitespace: an empty span there.
    end = std::max(end, start);
    out.assistant.push_back({static_cast<uint32_t>(start), static_cast<uint32_t>(end)});
  }
  out.text = std::move(whole.text);
  return out;
}

Result<std::optional<std::string>> read_chat_template(const nlohmann::json& config, const std::string& config_path,
                                                      const std::string& name) {
  const std::filesystem::path jinja_file = std::filesystem::path(config_path).parent_path() / "chat_template.jinja";
  std::error_code ec;
  if (std::filesystem::is_regular_file(jinja_file, ec)) {
    std::ifstream in(jinja_file, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    if (!in) return Status::IOError(jinja_file.string() + ": read failed");
    return std::optional<std::string>(text.str());
  }
  auto tmpl = config.find("chat_template");
  if (tmpl == config.end() || tmpl->is_null()) return std::optional<std::string>();
  if (tmpl->is_string()) return std::optional<std::string>(tmpl->get<std::string>());
  const std::string wanted = name.empty() ? "default" : name;
  if (tmpl->is_array()) {
    std::string names;
    for (const nlohmann::json& t : *tmpl) {
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string() || !t.contains("template") ||
          !t["template"].is_string()) {
        return Status::InvalidArgument(config_path + ": chat_template list entries must be {\"name\", \"template\"} strings");
      }
      if (t["name"] == wanted) return std::optional<std::string>(t["template"].get<std::string>());
      names += (names.empty() ? "" : ", ") + t["name"].get<std::string>();
    }
    return Status::InvalidArgument(config_path + ": chat_template has no template named \"" + wanted + "\" (it has " +
                                   names + ")");
  }
  return Status::InvalidArgument(config_path + ": chat_template must be a string or a list of {\"name\", \"template\"}");
}

}  // namespace strata::model
