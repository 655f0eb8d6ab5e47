#include "data/conversation.h"

#include <string>

namespace strata {
namespace {

using json = nlohmann::ordered_json;

constexpr const char* kShapes =
    "a chat line is {\"messages\": [{\"role\", \"content\"}]}, {\"conversations\": [{\"from\", \"value\"}]} or "
    "{\"instruction\", \"input\", \"output\"}";

Result<json> openai(const json& messages) {
  if (!messages.is_array() || messages.empty()) return Status::InvalidArgument("\"messages\" must be a non-empty list");
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      return Status::InvalidArgument("message " + std::to_string(i) + " needs a \"role\" string");
    }
    if (m.contains("content") && !m["content"].is_string() && !m["content"].is_null() && !m["content"].is_array()) {
      return Status::InvalidArgument("message " + std::to_string(i) + ": \"content\" must be a string, a list or null");
    }
  }
  return messages;
}

Result<std::string> sharegpt_role(const std::string& from) {
  if (from == "human" || from == "user") return std::string("user");
  if (from == "gpt" || from == "assistant" || from == "model") return std::string("assistant");
  if (from == "system") return std::string("system");
  if (from == "tool" || from == "function" || from == "observation") return std::string("tool");
  return Status::InvalidArgument("ShareGPT turn from \"" + from +
                                 "\": expected human, gpt, system or tool (or user, assistant, model, function, "
                                 "observation)");
}

Result<json> sharegpt(const json& turns) {
  if (!turns.is_array() || turns.empty()) return Status::InvalidArgument("\"conversations\" must be a non-empty list");
  json messages = json::array();
  for (size_t i = 0; i < turns.size(); ++i) {
    const json& t = turns[i];
    if (!t.is_object() || !t.contains("from") || !t["from"].is_string() || !t.contains("value") || !t["value"].is_string()) {
      return Status::InvalidArgument("conversation turn " + std::to_string(i) + " needs \"from\" and \"value\" strings");
    }
    ASSIGN_OR_RETURN(std::string role, sharegpt_role(t["from"].get<std::string>()));
    messages.push_back({{"role", role}, {"content", t["value"]}});
  }
  return messages;
}

Result<json> alpaca(const json& doc) {
  for (const char* key : {"instruction", "output"}) {
    if (!doc[key].is_string()) return Status::InvalidArgument(std::string("Alpaca \"") + key + "\" must be a string");
  }
  std::string user = doc["instruction"].get<std::string>();
  if (doc.contains("input") && !doc["input"].is_null()) {
    if (!doc["input"].is_string()) return Status::InvalidArgument("Alpaca \"input\" must be a string");
    if (!doc["input"].get<std::string>().empty()) user += "\n\n" + doc["input"].get<std::string>();
  }
  json messages = json::array();
  if (doc.contains("system") && doc["system"].is_string() && !doc["system"].get<std::string>().empty()) {
    messages.push_back({{"role", "system"}, {"content", doc["system"]}});
  }
  messages.push_back({{"role", "user"}, {"content", user}});
  messages.push_back({{"role", "assistant"}, {"content", doc["output"]}});
  return messages;
}

}  // namespace

Result<nlohmann::ordered_json> conversation_messages(const nlohmann::ordered_json& doc) {
  if (!doc.is_object()) return Status::InvalidArgument(std::string("not a JSON object; ") + kShapes);
  if (doc.contains("messages")) return openai(doc["messages"]);
  if (doc.contains("conversations")) return sharegpt(doc["conversations"]);
  if (doc.contains("instruction") && doc.contains("output")) return alpaca(doc);
  std::string keys;
  for (auto it = doc.begin(); it != doc.end() && keys.size() < 200; ++it) keys += (keys.empty() ? "" : ", ") + it.key();
  return Status::InvalidArgument("no conversation in an object with keys [" + keys + "]; " + kShapes);
}

}  // namespace strata
