// The chat templates strata renders. tokenizer_config.json's chat_template is Jinja, which
// strata does not interpret; instead it recognises the templates of the supported families by
// a hash of their normalized text and renders what transformers' apply_chat_template renders
// for them (no tools, no generation prompt):
//   kChatML   plain ChatML; Qwen2-Instruct and Qwen2.5-Instruct, which put
//             their default system message first when the conversation has none
//   kLlama3   Meta-Llama-3-Instruct
//   kLlama31  Meta-Llama-3.1-Instruct: a system header with its knowledge and date lines first
//   kMistral  Mistral-7B-Instruct-v0.1/v0.2 and Mixtral-8x7B-Instruct-v0.1 as first published
//             ([INST] ... [/INST], user and assistant alternating; with or without a space
//             after each </s>). Not the later v0.3-style templates with [AVAILABLE_TOOLS].
// Normalizing drops comments, whitespace outside quoted strings and the whitespace-control
// marks at tag edges, and quotes every string with ', so copies that differ only in layout or
// quote style are recognised. Any other template is kUnknown.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "data/tokenizer_split.h"

namespace strata::model {

enum class ChatFormat : uint8_t {
  kNone,     // no chat_template
  kChatML,   // <|im_start|>role\ncontent<|im_end|>\n
  kLlama3,   // <|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
  kLlama31,  // kLlama3 after a system header with "Cutting Knowledge Date: ..." lines
  kMistral,  // <s>[INST] user [/INST]assistant</s>
  kUnknown,  // a template this renderer does not know
};

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ...
  std::string content;
};

struct ChatTemplate {
  ChatFormat format = ChatFormat::kNone;
  std::string name;               // the family, for messages: "Qwen2.5-Instruct"
  std::string default_system;     // kChatML: the system message put first when there is none
  bool basic_roles_only = false;  // other roles than system/user/assistant render differently
  bool space_after_eos = false;   // kMistral: " " after each </s>
  uint64_t hash = 0;              // of the normalized text
};

// The template text as recognition sees it (see above).
std::string normalize_chat_template(std::string_view text);
// FNV-1a 64 of normalize_chat_template(text).
uint64_t chat_template_hash(std::string_view text);
// The template's family; format kUnknown (with the hash) when it is not one strata knows.
ChatTemplate recognise_chat_template(std::string_view text);

// A rendered conversation and the bytes of it that count towards the loss: each assistant
// reply as rendered and the end marker after it (<|im_end|>, <|eot_id|>, </s>).
struct RenderedChat {
  std::string text;
  std::vector<ByteSpan> assistant;
};

// Renders messages as the template does with bos_token and eos_token (empty when the tokenizer
// has none). InvalidArgument, saying why, for what the template refuses or strata does not
// render: no messages, Mistral roles that do not alternate user/assistant, a tool role where
// the template renders tools differently. REQUIRES: format is neither kNone nor kUnknown.
Result<RenderedChat> render_chat(const ChatTemplate& tmpl, std::span<const ChatMessage> messages,
                                 std::string_view bos_token, std::string_view eos_token);

}  // namespace strata::model
