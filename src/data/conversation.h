// The conversation of one line of chat JSONL, in any of the shapes fine-tuning data comes in,
// as the list of messages a chat template renders:
//   OpenAI    {"messages": [{"role", "content", ...}, ...]}: as it is (tool_calls, name, ...
//             pass through to the template);
//   ShareGPT  {"conversations": [{"from", "value"}, ...]}: from human/user -> user, gpt/
//             assistant/model -> assistant, system -> system, tool/function/observation -> tool;
//   Alpaca    {"instruction", "input", "output"} (and an optional "system"): the instruction,
//             then a blank line and the input when it is not empty, as the user turn; the
//             output as the assistant turn.
#pragma once

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace strata {

// InvalidArgument saying which shapes are read when `doc` is none of them or is malformed; the
// caller adds the file and line.
Result<nlohmann::ordered_json> conversation_messages(const nlohmann::ordered_json& doc);

}  // namespace strata
