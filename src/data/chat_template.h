// Chat templates: tokenizer_config.json's chat_template (Jinja) rendered by strata's Jinja
// interpreter (jinja.h) as transformers' apply_chat_template renders it, with the bytes of each
// assistant turn found in the rendered text.
//
// Assistant spans come from renders, not from token patterns. For assistant message i:
//   start  where the whole conversation's text first differs from the conversation up to
//          message i rendered with add_generation_prompt (the prompt a model is given to write
//          the reply; its generation prompt, e.g. "<|im_start|>assistant\n", is not counted);
//   end    the end of the text the template's loop over the messages wrote for message i (the
//          reply and its end marker, e.g. "<|im_end|>"), or for the last message the end of the
//          whole text (what a template writes after its loop, e.g. Zephyr-Gemma's eos_token,
//          closes the last reply), without trailing whitespace (the "\n" between turns is
//          layout, not reply).
// Messages, tools and variables are ordered JSON: Python keeps a dict's key order, and tojson
// and printing write the keys in it.
// Where a template renders the text before a reply differently depending on whether the reply
// follows (Mistral-Nemo moves the system message into the last user turn), the span starts no
// earlier than the text its loop wrote for the message.
#pragma once

#include <ctime>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "data/jinja.h"
#include "data/tokenizer_split.h"

namespace strata::model {

struct ChatRenderOptions {
  bool add_generation_prompt = false;
  nlohmann::ordered_json tools;      // null, or a list of tool schemas the template is given as `tools`
  nlohmann::ordered_json variables;  // null, or an object of further variables (enable_thinking, ...)
  std::optional<std::time_t> now;  // what strftime_now formats; the current time when unset
};

// A rendered conversation and the bytes of it that count towards the loss.
struct RenderedChat {
  std::string text;
  std::vector<ByteSpan> assistant;
};

// Immutable after parse; copyable, safe for concurrent use.
class ChatTemplate {
 public:
  // `source` names the template in messages ("DIR/tokenizer_config.json chat_template").
  // bos_token/eos_token: empty when the tokenizer has none (the variable is then undefined).
  static Result<ChatTemplate> parse(std::string_view text, std::string source, std::string bos_token,
                                    std::string eos_token);

  // messages: a JSON list of objects with "role" and usually "content" (tool_calls, ... as the
  // template reads them). InvalidArgument naming the source and template line for what the
  // template refuses (raise_exception) or cannot render.
  Result<std::string> render(const nlohmann::ordered_json& messages, const ChatRenderOptions& options) const;
  // The whole conversation (no generation prompt) with its assistant spans (see above).
  Result<RenderedChat> render_with_spans(const nlohmann::ordered_json& messages, const ChatRenderOptions& options) const;

  const std::string& source() const { return source_; }

 private:
  // The output bytes of message i: its loop iteration, or the render up to it.
  Result<ByteSpan> turn_of(const jinja::Value& all, size_t i, const JinjaOutput& whole,
                           const ChatRenderOptions& options) const;
  Result<JinjaOutput> run(const jinja::Value& messages, const ChatRenderOptions& options, bool generation_prompt,
                          bool track) const;

  JinjaTemplate template_;
  std::string source_;
  std::string bos_token_;
  std::string eos_token_;
};

// The template text of a tokenizer directory: chat_template.jinja beside tokenizer_config.json
// when present (transformers prefers it), else the config's chat_template, a string or a list
// of {"name", "template"} from which `name` is taken ("default" when empty). nullopt when
// there is none; InvalidArgument naming the file when the list has no such name (listing
// those it has) or the value is neither a string nor such a list.
Result<std::optional<std::string>> read_chat_template(const nlohmann::json& config, const std::string& config_path,
                                                      const std::string& name);

}  // namespace strata::model
