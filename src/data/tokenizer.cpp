#include "data/tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <queue>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/tokenizer_unicode.h"
#include "data/unicode_nfc.h"

namespace strata::model {

using nlohmann::json;

namespace {

namespace fs = std::filesystem;

// Pieces up to this many bytes go through the cache, which holds at most kCacheEntries.
constexpr size_t kCacheMaxPiece = 128;
constexpr size_t kCacheEntries = size_t{1} << 16;
// Ids at or above this are not a tokenizer a trainer can use (and would overflow the tables).
constexpr int64_t kMaxTokenId = int64_t{1} << 28;

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(path + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status::IOError(path + ": read failed");
  return ss.str();
}

// The GPT-2 byte-level map: printable Latin-1 bytes stand for themselves, the others for
// U+0100 upwards in byte order.
uint32_t byte_to_char(int b) {
  auto printable = [](int v) { return (v >= '!' && v <= '~') || (v >= 0xA1 && v <= 0xAC) || (v >= 0xAE && v <= 0xFF); };
  if (printable(b)) return static_cast<uint32_t>(b);
  uint32_t n = 0;
  for (int v = 0; v < b; ++v) n += printable(v) ? 0 : 1;
  return 256 + n;
}

// A token given in tokenizer_config.json: a string, {"content": ...} or null.
// A special token of tokenizer_config.json: a string, an AddedToken object {content, ...}, or
// null/absent (""). Anything else (a number, an object without content) contradicts the format
// and is refused naming the key, rather than read as "not set".
Result<std::string> config_token(const json& j, const char* key, const std::string& file) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto c = it->find("content");
    if (c != it->end() && c->is_string()) return c->get<std::string>();
  }
  return Status::Corruption(file + ": " + key + " is " + it->dump().substr(0, 64) +
                            ", not a token (a string, or an object with a \"content\" string)");
}

std::string json_type(const json& j) {
  auto it = j.find("type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string("<no type>");
}

bool json_bool(const json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_boolean() ? it->get<bool>() : fallback;
}

// "▁" (U+2581), which sentencepiece-style vocabularies use for a space.
const std::string kMetaspace = "\xe2\x96\x81";

// Text with each " " replaced by "▁" and, when `prepend`, a "▁" put first, and where each of
// its bytes comes from: its bytes [b, e) stand for text bytes [begin_of[b], end_of[e]).
struct MetaspaceText {
  std::string text;
  std::vector<uint32_t> begin_of;  // size text.size() + 1
  std::vector<uint32_t> end_of;    // size text.size() + 1
};

MetaspaceText to_metaspace(std::string_view in, bool prepend) {
  MetaspaceText m;
  m.text.reserve(in.size() + 8);
  auto add = [&](std::string_view bytes, uint32_t src_begin, uint32_t src_end) {
    for (size_t k = 0; k < bytes.size(); ++k) {
      m.begin_of.push_back(src_begin);
      m.end_of.push_back(k + 1 == bytes.size() ? src_end : src_begin);
    }
    m.text.append(bytes);
  };
  m.end_of.push_back(0);  // then end_of[k + 1] is where byte k's source ends
  if (prepend) add(kMetaspace, 0, 0);
  for (size_t i = 0; i < in.size(); ++i) {
    const auto at = static_cast<uint32_t>(i);
    add(in[i] == ' ' ? std::string_view(kMetaspace) : in.substr(i, 1), at, at + 1);
  }
  m.begin_of.push_back(static_cast<uint32_t>(in.size()));
  return m;
}

}  // namespace

std::string Tokenizer::read_metaspace(const json& p, MetaspacePrepend* prepend) {
  if (p.value("replacement", json()) != kMetaspace) return "Metaspace with a replacement other than \"▁\"";
  const json scheme = p.value("prepend_scheme", json());
  if (scheme == "always") {
    *prepend = MetaspacePrepend::kAlways;
  } else if (scheme == "first") {
    *prepend = MetaspacePrepend::kFirst;
  } else if (scheme == "never") {
    *prepend = MetaspacePrepend::kNever;
  } else if (scheme.is_null()) {  // before prepend_scheme: add_prefix_space
    *prepend = json_bool(p, "add_prefix_space", true) ? MetaspacePrepend::kAlways : MetaspacePrepend::kNever;
  } else {
    return "Metaspace prepend_scheme " + scheme.dump();
  }
  return {};
}

struct Tokenizer::Cache {
  std::mutex mu;
  std::unordered_map<std::string, std::vector<std::pair<int32_t, uint32_t>>> pieces;
};

Tokenizer::Tokenizer() : cache_(std::make_unique<Cache>()) {
  for (int b = 0; b < 256; ++b) {
    byte_ids_[b] = -1;
    const uint32_t cp = byte_to_char(b);
    append_utf8(cp, &byte_chars_[b]);
    char_to_byte_[cp] = static_cast<uint8_t>(b);
  }
}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Result<Tokenizer> Tokenizer::load(const std::string& path) {
  std::error_code ec;
  fs::path dir = path;
  fs::path json_file = dir / "tokenizer.json";
  if (fs::is_regular_file(path, ec)) {
    json_file = path;
    dir = fs::path(path).parent_path();
  } else if (!fs::is_directory(path, ec)) {
    return Status::NotFound(path + ": no such tokenizer directory or tokenizer.json");
  }
  Tokenizer t;
  RETURN_IF_ERROR(t.load_tokenizer_json(json_file.string()));
  t.config_path_ = (dir / "tokenizer_config.json").string();
  if (fs::exists(t.config_path_, ec)) RETURN_IF_ERROR(t.load_config(t.config_path_));
  if (t.eos_id_ < 0) t.eos_id_ = t.token_to_id("<|endoftext|>");
  return t;
}

Status Tokenizer::load_tokenizer_json(const std::string& file) {
  ASSIGN_OR_RETURN(std::string text, read_file(file));
  const json doc = json::parse(text, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) return Status::Corruption(file + ": not valid JSON");
  auto unimplemented = [&](const std::string& what) {
    return Status::Unimplemented(file + ": " + what + " is not supported (strata reads byte-level BPE tokenizers "
                                 "like GPT-2, Llama-3 and Qwen2, and sentencepiece-style BPE like Llama-2 and "
                                 "Mistral)");
  };

  // model
  auto model = doc.find("model");
  if (model == doc.end() || !model->is_object()) return Status::Corruption(file + ": no \"model\" object");
  if (json_type(*model) != "BPE") return unimplemented("model type " + json_type(*model));
  byte_fallback_ = json_bool(*model, "byte_fallback", false);
  fuse_unk_ = json_bool(*model, "fuse_unk", false);
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    auto it = model->find(key);
    if (it != model->end() && it->is_string() && !it->get<std::string>().empty()) {
      return unimplemented(std::string("model.") + key);
    }
  }
  ignore_merges_ = json_bool(*model, "ignore_merges", false);
  auto vocab = model->find("vocab");
  if (vocab == model->end() || !vocab->is_object()) return Status::Corruption(file + ": no model.vocab object");
  int64_t size = 0;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() >= kMaxTokenId) {
      return Status::Corruption(file + ": model.vocab[\"" + it.key() + "\"] is not a valid token id");
    }
    const int64_t id = it.value().get<int64_t>();
    vocab_[it.key()] = static_cast<int32_t>(id);
    size = std::max(size, id + 1);
  }

  // added_tokens
  auto added = doc.find("added_tokens");
  if (added != doc.end() && !added->is_null()) {
    if (!added->is_array()) return Status::Corruption(file + ": added_tokens is not an array");
    for (const json& a : *added) {
      auto id = a.find("id");
      auto content = a.find("content");
      if (!a.is_object() || id == a.end() || !id->is_number_integer() || content == a.end() || !content->is_string() ||
          id->get<int64_t>() < 0 || id->get<int64_t>() >= kMaxTokenId || content->get<std::string>().empty()) {
        return Status::Corruption(file + ": added_tokens entry " + a.dump() + " needs an id and a content");
      }
      // tokenizers requires "normalized"; absent, it defaults here as AddedToken::from does: !special.
      const bool normalized = json_bool(a, "normalized", !json_bool(a, "special", false));
      added_.push_back({static_cast<int32_t>(id->get<int64_t>()), content->get<std::string>(), normalized, {}});
      size = std::max(size, id->get<int64_t>() + 1);
    }
  }
  // The id tables are sized by the largest id: a few bytes naming id 2^28 - 1 would allocate
  // gigabytes. Real vocabularies are dense (ids 0..N-1, added tokens just after), so a file
  // whose ids leave most of a large range empty is refused before the tables are made (tables
  // of up to 2^18 ids cost a few MiB, so small sparse files, e.g. tests, still load).
  const int64_t entries = static_cast<int64_t>(vocab->size() + added_.size());
  if (size > std::max<int64_t>(2 * entries + 1024, int64_t{1} << 18)) {
    return Status::Corruption(file + ": token ids reach " + std::to_string(size - 1) + " but model.vocab and "
                              "added_tokens hold only " + std::to_string(entries) +
                              " tokens; ids must be (nearly) consecutive from 0: the file is damaged");
  }
  id_to_token_.assign(static_cast<size_t>(size), std::string());
  is_added_.assign(static_cast<size_t>(size), 0);
  std::vector<uint8_t> taken(static_cast<size_t>(size), 0);
  for (const auto& [token, id] : vocab_) {
    if (taken[static_cast<size_t>(id)]) {
      return Status::Corruption(file + ": model.vocab gives id " + std::to_string(id) + " to both \"" +
                                id_to_token_[static_cast<size_t>(id)].substr(0, 32) + "\" and \"" +
                                token.substr(0, 32) + "\": the file contradicts itself");
    }
    taken[static_cast<size_t>(id)] = 1;
    id_to_token_[static_cast<size_t>(id)] = token;
  }
  // An added token may repeat a vocabulary entry (Llama's <s> is in both), but never give its id
  // to other text, nor its text to another id.
  for (const AddedToken& a : added_) {
    const size_t i = static_cast<size_t>(a.id);
    if (taken[i] && id_to_token_[i] != a.content) {
      return Status::Corruption(file + ": added_tokens gives id " + std::to_string(a.id) + " to \"" +
                                a.content.substr(0, 32) + "\", which " + (is_added_[i] ? "added_tokens" : "model.vocab") +
                                " gives to \"" + id_to_token_[i].substr(0, 32) + "\": the file contradicts itself");
    }
    if (auto same = vocab_.find(a.content); same != vocab_.end() && same->second != a.id) {
      return Status::Corruption(file + ": added_tokens gives \"" + a.content.substr(0, 32) + "\" id " +
                                std::to_string(a.id) + ", but it already has id " + std::to_string(same->second) +
                                ": the file contradicts itself");
    }
    taken[i] = 1;
    id_to_token_[i] = a.content;
    is_added_[i] = 1;
    vocab_.emplace(a.content, a.id);
  }
  auto unk = model->find("unk_token");
  if (unk != model->end() && unk->is_string()) unk_id_ = token_to_id(unk->get<std::string>());

  // merges: "a b" or ["a", "b"]
  auto merges = model->find("merges");
  if (merges == model->end() || !merges->is_array()) return Status::Corruption(file + ": no model.merges array");
  int32_t rank = 0;
  in_merges_.assign(static_cast<size_t>(size), 0);
  for (const json& m : *merges) {
    std::string left, right;
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        return Status::Corruption(file + ": merge " + std::to_string(rank) + " \"" + s + "\" is not \"a b\"");
      }
      left = s.substr(0, sp);
      right = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      return Status::Corruption(file + ": merge " + std::to_string(rank) + " is neither \"a b\" nor [a, b]");
    }
    auto l = vocab_.find(left), r = vocab_.find(right), lr = vocab_.find(left + right);
    if (l == vocab_.end() || r == vocab_.end() || lr == vocab_.end()) {
      return Status::Corruption(file + ": merge " + std::to_string(rank) + " (" + left + " " + right +
                                ") uses a token that is not in model.vocab");
    }
    const uint64_t key = (uint64_t{static_cast<uint32_t>(l->second)} << 32) | static_cast<uint32_t>(r->second);
    merges_.emplace(key, Merge{rank, lr->second});  // the first (lowest rank) wins
    in_merges_[static_cast<size_t>(l->second)] = 1;
    in_merges_[static_cast<size_t>(r->second)] = 1;
    ++rank;
  }

  // normalizer: none, NFC, a Sequence of NFC only, or sentencepiece's Sequence[Prepend("▁"),
  // Replace(" ", "▁")] (Llama-2, Mistral, Mixtral)
  std::vector<std::string> normalizers;
  std::function<Status(const json&)> norm = [&](const json& n) -> Status {
    const std::string type = json_type(n);
    if (type == "NFC") {
      normalizers.push_back(type);
      return Status::OK();
    }
    if (type == "Prepend") {
      if (n.value("prepend", json()) != kMetaspace) return unimplemented("normalizer Prepend other than \"▁\"");
      normalizers.push_back(type);
      return Status::OK();
    }
    if (type == "Replace") {
      const json pattern = n.value("pattern", json());
      if (!pattern.is_object() || pattern.value("String", json()) != " " || n.value("content", json()) != kMetaspace) {
        return unimplemented("normalizer Replace other than of the string \" \" by \"▁\"");
      }
      normalizers.push_back(type);
      return Status::OK();
    }
    if (type == "Sequence") {
      auto list = n.find("normalizers");
      if (list == n.end() || !list->is_array()) {
        return Status::Corruption(file + ": normalizer Sequence without normalizers");
      }
      for (const json& m : *list) RETURN_IF_ERROR(norm(m));
      return Status::OK();
    }
    return unimplemented("normalizer " + type + " (known: NFC; Prepend and Replace of \"▁\")");
  };
  auto normalizer = doc.find("normalizer");
  if (normalizer != doc.end() && !normalizer->is_null()) RETURN_IF_ERROR(norm(*normalizer));
  if (normalizers == std::vector<std::string>{"Prepend", "Replace"}) {
    spm_normalizer_ = true;
  } else {
    for (const std::string& n : normalizers) {
      if (n != "NFC") return unimplemented("this normalizer sequence (known: NFC alone; Prepend then Replace)");
    }
    nfc_ = !normalizers.empty();
  }
  // tokenizers looks for a `normalized` added token in normalized text, as its content normalizes.
  for (AddedToken& a : added_) {
    a.match = a.normalized && nfc_ ? nfc(a.content) : a.content;
    has_normalized_added_ = has_normalized_added_ || a.normalized;
  }
  if (spm_normalizer_ && has_normalized_added_) {
    return unimplemented("an added token with \"normalized\": true beside the Prepend/Replace normalizer");
  }
  std::stable_sort(added_.begin(), added_.end(),
                   [](const AddedToken& x, const AddedToken& y) { return x.match.size() > y.match.size(); });

  // pre_tokenizer
  bool byte_level = false;
  std::function<Status(const json&)> pre = [&](const json& p) -> Status {
    const std::string type = json_type(p);
    if (type == "Sequence") {
      auto list = p.find("pretokenizers");
      if (list == p.end() || !list->is_array()) return Status::Corruption(file + ": pre_tokenizer Sequence without pretokenizers");
      for (const json& q : *list) RETURN_IF_ERROR(pre(q));
      return Status::OK();
    }
    if (type == "ByteLevel") {
      if (byte_level) return unimplemented("a second ByteLevel pre_tokenizer");
      byte_level = true;
      if (json_bool(p, "add_prefix_space", false)) prefix_space_ = has_split_ ? PrefixSpace::kPiece : PrefixSpace::kSegment;
      if (json_bool(p, "use_regex", true)) {
        if (has_split_) return unimplemented("more than one Split in pre_tokenizer");
        has_split_ = true;
        split_ = SplitPattern::kGpt2;
      }
      return Status::OK();
    }
    if (type == "Metaspace") {
      if (metaspace_) return unimplemented("a second Metaspace pre_tokenizer");
      if (std::string error = read_metaspace(p, &metaspace_prepend_); !error.empty()) return unimplemented(error);
      metaspace_ = true;
      metaspace_split_ = json_bool(p, "split", true);
      return Status::OK();
    }
    if (type == "Split") {
      auto pattern = p.find("pattern");
      if (pattern == p.end() || !pattern->is_object() || !pattern->contains("Regex") || !(*pattern)["Regex"].is_string()) {
        return unimplemented("a Split pre_tokenizer without a Regex pattern");
      }
      const std::string regex = (*pattern)["Regex"].get<std::string>();
      std::optional<SplitPattern> known = recognise_split_pattern(regex);
      if (!known) return unimplemented("Split pattern " + json(regex).dump() + " (known: the GPT-2, Llama-3 and Qwen2 patterns)");
      auto behavior = p.find("behavior");
      if (behavior == p.end() || !behavior->is_string() || behavior->get<std::string>() != "Isolated" ||
          json_bool(p, "invert", false)) {
        return unimplemented("a Split pre_tokenizer other than behavior Isolated, invert false");
      }
      if (byte_level) return unimplemented("a Split after the ByteLevel pre_tokenizer");
      if (has_split_) return unimplemented("more than one Split in pre_tokenizer");
      has_split_ = true;
      split_ = *known;
      return Status::OK();
    }
    return unimplemented("pre_tokenizer " + type);
  };
  auto pre_tokenizer = doc.find("pre_tokenizer");
  if (pre_tokenizer != doc.end() && !pre_tokenizer->is_null()) RETURN_IF_ERROR(pre(*pre_tokenizer));
  // The model's alphabet: byte-level characters, or (sentencepiece style) the characters
  // themselves with <0xXX> tokens for bytes of characters outside the vocabulary.
  byte_level_ = byte_level;
  if (byte_level && (metaspace_ || spm_normalizer_)) {
    return unimplemented("ByteLevel together with Metaspace or a Prepend/Replace normalizer");
  }
  if (!byte_level && !metaspace_ && !spm_normalizer_) {
    return unimplemented("a tokenizer with neither a ByteLevel nor a Metaspace pre_tokenizer nor the Prepend/Replace "
                         "normalizer");
  }
  if (metaspace_ && (spm_normalizer_ || has_split_ || nfc_)) {
    return unimplemented("Metaspace together with another pre_tokenizer or a normalizer");
  }
  if (byte_level && byte_fallback_) return unimplemented("model.byte_fallback with a ByteLevel pre_tokenizer");
  for (int b = 0; b < 256; ++b) {
    char hex[8];
    std::snprintf(hex, sizeof(hex), "<0x%02X>", b);
    auto it = vocab_.find(byte_level ? byte_chars_[b] : std::string(hex));
    if (it != vocab_.end() && (byte_level || byte_fallback_)) byte_ids_[b] = it->second;
  }
  if (!byte_level) {  // the tokens of single characters, BPE's initial symbols
    std::vector<DecodedChar> chars;
    for (const auto& [token, id] : vocab_) {
      decode_utf8(token, &chars);
      if (chars.size() == 1 && chars[0].cp != kInvalidCodepoint) char_ids_.emplace(chars[0].cp, id);
    }
  }
  if (!byte_level) {  // the decoder strips the space a prepended "▁" decodes to
    auto decoder = doc.find("decoder");
    std::function<void(const json&)> dec = [&](const json& d) {
      const std::string type = json_type(d);
      if (type == "Sequence" && d.contains("decoders") && d["decoders"].is_array()) {
        for (const json& e : d["decoders"]) dec(e);
      } else if (type == "Strip") {
        strip_leading_space_ = d.value("content", json()) == " " && d.value("start", json(0)).is_number_integer() &&
                               d.value("start", json(0)).get<int64_t>() >= 1;
      } else if (type == "Metaspace") {
        MetaspacePrepend prepend = MetaspacePrepend::kAlways;
        strip_leading_space_ = read_metaspace(d, &prepend).empty() && prepend != MetaspacePrepend::kNever;
      }
    };
    if (decoder != doc.end() && decoder->is_object()) dec(*decoder);
  }

  // post_processor
  std::function<Status(const json&)> post = [&](const json& p) -> Status {
    const std::string type = json_type(p);
    if (type == "ByteLevel") return Status::OK();
    if (type == "Sequence") {
      auto list = p.find("processors");
      if (list == p.end() || !list->is_array()) return Status::Corruption(file + ": post_processor Sequence without processors");
      for (const json& q : *list) RETURN_IF_ERROR(post(q));
      return Status::OK();
    }
    if (type == "TemplateProcessing") {
      auto single = p.find("single");
      auto specials = p.find("special_tokens");
      if (single == p.end() || !single->is_array() || specials == p.end() || !specials->is_object()) {
        return Status::Corruption(file + ": TemplateProcessing without single / special_tokens");
      }
      bool seen_sequence = false;
      for (const json& item : *single) {
        if (item.is_object() && item.contains("Sequence")) {
          if (seen_sequence) return unimplemented("a TemplateProcessing with two sequences in single");
          seen_sequence = true;
          continue;
        }
        const json* name = nullptr;
        if (item.is_object() && item.contains("SpecialToken") && item["SpecialToken"].is_object() &&
            item["SpecialToken"].contains("id") && item["SpecialToken"]["id"].is_string()) {
          name = &item["SpecialToken"]["id"];
        }
        if (name == nullptr) return Status::Corruption(file + ": TemplateProcessing item " + item.dump() + " not understood");
        auto entry = specials->find(name->get<std::string>());
        if (entry == specials->end() || !entry->is_object() || !entry->contains("ids") || !(*entry)["ids"].is_array()) {
          return Status::Corruption(file + ": TemplateProcessing special token " + name->dump() + " has no ids");
        }
        for (const json& id : (*entry)["ids"]) {
          if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= size) {
            return Status::Corruption(file + ": TemplateProcessing special token " + name->dump() + " has a bad id");
          }
          (seen_sequence ? template_suffix_ : template_prefix_).push_back(static_cast<int32_t>(id.get<int64_t>()));
        }
      }
      return Status::OK();
    }
    return unimplemented("post_processor " + type);
  };
  auto post_processor = doc.find("post_processor");
  if (post_processor != doc.end() && !post_processor->is_null()) RETURN_IF_ERROR(post(*post_processor));
  return Status::OK();
}

Status Tokenizer::load_config(const std::string& file) {
  ASSIGN_OR_RETURN(std::string text, read_file(file));
  const json doc = json::parse(text, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) return Status::Corruption(file + ": not valid JSON");
  ASSIGN_OR_RETURN(const std::string bos, config_token(doc, "bos_token", file));
  ASSIGN_OR_RETURN(const std::string eos, config_token(doc, "eos_token", file));
  if (!bos.empty()) {
    bos_id_ = token_to_id(bos);
    if (bos_id_ < 0) return Status::Corruption(file + ": bos_token \"" + bos + "\" is not in the vocabulary");
    bos_text_ = bos;
  }
  if (!eos.empty()) {
    eos_id_ = token_to_id(eos);
    if (eos_id_ < 0) return Status::Corruption(file + ": eos_token \"" + eos + "\" is not in the vocabulary");
    eos_text_ = eos;
  }
  ASSIGN_OR_RETURN(std::optional<std::string> chat_template, read_chat_template(doc, file, {}));
  if (chat_template) {
    ASSIGN_OR_RETURN(ChatTemplate parsed, ChatTemplate::parse(*chat_template, file + " chat_template", bos_text_, eos_text_));
    chat_ = std::move(parsed);
  }
  return Status::OK();
}

bool Tokenizer::can_cut_after_newlines() const {
  if (!has_split_ || prefix_space_ != PrefixSpace::kNone) return false;
  for (const AddedToken& a : added_) {
    if (a.content.find('\n') != std::string::npos) return false;
  }
  return true;
}

int32_t Tokenizer::token_to_id(std::string_view token) const {
  auto it = vocab_.find(std::string(token));
  return it == vocab_.end() ? -1 : it->second;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return id_to_token_[static_cast<size_t>(id)];
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, const EncodeOptions& options) const {
  std::vector<int32_t> ids;
  std::vector<ByteSpan> spans;
  encode_with_spans(text, options, &ids, &spans);
  return ids;
}

void Tokenizer::encode_with_spans(std::string_view text, const EncodeOptions& options, std::vector<int32_t>* ids,
                                  std::vector<ByteSpan>* spans) const {
  ids->clear();
  spans->clear();
  if (options.add_special_tokens) {
    for (int32_t id : template_prefix_) {
      ids->push_back(id);
      spans->push_back({0, 0});
    }
  }
  // As tokenizers' AddedVocabulary::extract_and_normalize: the added tokens that are not
  // `normalized` are found in the raw text first; each stretch between them is normalized on its
  // own, and the `normalized` added tokens are then found in it (encode_stretch).
  size_t pos = 0;
  if (options.parse_special) {
    for (const auto& [at, a] : find_added(text, /*normalized=*/false)) {
      if (at > pos) encode_stretch(text.substr(pos, at - pos), static_cast<uint32_t>(pos), true, ids, spans);
      ids->push_back(a->id);
      spans->push_back({static_cast<uint32_t>(at), static_cast<uint32_t>(at + a->match.size())});
      pos = at + a->match.size();
    }
  }
  if (pos < text.size()) {
    encode_stretch(text.substr(pos), static_cast<uint32_t>(pos), options.parse_special, ids, spans);
  }
  remove_unencodable(ids, spans, options.unencodable);
  if (options.add_special_tokens) {
    const uint32_t end = static_cast<uint32_t>(text.size());
    for (int32_t id : template_suffix_) {
      ids->push_back(id);
      spans->push_back({end, end});
    }
  }
}

void Tokenizer::remove_unencodable(std::vector<int32_t>* ids, std::vector<ByteSpan>* spans,
                                   std::vector<uint32_t>* unencodable) {
  size_t kept = 0;
  for (size_t i = 0; i < ids->size(); ++i) {
    if ((*ids)[i] < 0) {
      if (unencodable != nullptr) unencodable->push_back((*spans)[i].begin);
      continue;
    }
    (*ids)[kept] = (*ids)[i];
    (*spans)[kept] = (*spans)[i];
    ++kept;
  }
  ids->resize(kept);
  spans->resize(kept);
}

Result<std::vector<int32_t>> Tokenizer::encode_all(std::string_view text, const EncodeOptions& options,
                                                   const std::string& where, uint64_t offset) const {
  std::vector<uint32_t> unencodable;
  EncodeOptions checked = options;
  checked.unencodable = &unencodable;
  std::vector<int32_t> ids;
  std::vector<ByteSpan> spans;
  encode_with_spans(text, checked, &ids, &spans);
  if (unencodable.empty()) return ids;
  const uint32_t at = unencodable.front();
  return Status::InvalidArgument(fmt::format(
      "{}: byte {} (0x{:02X}) and {} more characters have no token in this tokenizer, which has neither byte "
      "fallback nor an <unk> token; they would be dropped from the training text: clean the text, or use a "
      "tokenizer that covers it",
      where, offset + at, static_cast<uint8_t>(text[at]), unencodable.size() - 1));
}

std::vector<std::pair<size_t, const Tokenizer::AddedToken*>> Tokenizer::find_added(std::string_view text,
                                                                                     bool normalized) const {
  std::vector<std::pair<size_t, const AddedToken*>> found;
  for (size_t i = 0; i < text.size(); ++i) {
    for (const AddedToken& a : added_) {  // longest first
      if (a.normalized != normalized || a.match[0] != text[i] || text.compare(i, a.match.size(), a.match) != 0) {
        continue;
      }
      found.push_back({i, &a});
      i += a.match.size() - 1;
      break;
    }
  }
  return found;
}

void Tokenizer::encode_stretch(std::string_view raw, uint32_t base, bool parse_special, std::vector<int32_t>* ids,
                               std::vector<ByteSpan>* spans) const {
  std::string normalized;
  std::vector<NfcEdit> edits;
  MetaspaceText spm;
  std::string_view text = nfc_ && to_nfc(raw, &normalized, &edits) ? std::string_view(normalized) : raw;
  if (spm_normalizer_) {  // Prepend("▁") on non-empty text, then Replace(" ", "▁")
    spm = to_metaspace(raw, !raw.empty());
    text = spm.text;
  }
  const size_t first = ids->size();
  size_t pos = 0;
  if (parse_special && has_normalized_added_) {
    for (const auto& [at, a] : find_added(text, /*normalized=*/true)) {
      if (at > pos) encode_segment(text.substr(pos, at - pos), static_cast<uint32_t>(pos), base == 0 && pos == 0, ids, spans);
      ids->push_back(a->id);
      spans->push_back({static_cast<uint32_t>(at), static_cast<uint32_t>(at + a->match.size())});
      pos = at + a->match.size();
    }
  }
  if (pos < text.size()) encode_segment(text.substr(pos), static_cast<uint32_t>(pos), base == 0 && pos == 0, ids, spans);
  // Spans of the normalized text back to the raw one: a token that covers part of a changed
  // stretch stands for all of it.
  for (size_t i = first; i < spans->size(); ++i) {
    ByteSpan& s = (*spans)[i];
    if (spm_normalizer_) {
      s = {base + spm.begin_of[s.begin], base + spm.end_of[s.end]};
    } else {
      s = {base + nfc_source_begin(edits, s.begin), base + nfc_source_end(edits, s.end)};
    }
  }
}

void Tokenizer::encode_segment(std::string_view text, uint32_t base, bool at_input_start, std::vector<int32_t>* ids,
                               std::vector<ByteSpan>* spans) const {
  std::vector<std::pair<int32_t, uint32_t>> tokens;
  if (metaspace_) {
    encode_metaspace(text, base, at_input_start, ids, spans);
    return;
  }
  std::string scratch;
  // Emits the BPE of s, whose first `inserted` bytes are a prefix space not in the text and
  // whose other bytes start at text byte `begin`.
  auto emit = [&](std::string_view s, uint32_t begin, uint32_t inserted) {
    tokens.clear();
    encode_piece(s, &tokens);
    uint32_t offset = 0;
    for (const auto& [id, len] : tokens) {
      const uint32_t b = begin + (offset > inserted ? offset - inserted : 0);
      const uint32_t e = begin + (offset + len > inserted ? offset + len - inserted : 0);
      ids->push_back(id);  // -1: bytes no token stands for, removed by encode_with_spans
      spans->push_back({b, e});
      offset += len;
    }
  };
  auto emit_piece = [&](std::string_view piece, uint32_t begin) {
    if (prefix_space_ == PrefixSpace::kPiece && piece[0] != ' ') {
      scratch.assign(" ").append(piece);
      emit(scratch, begin, 1);
    } else {
      emit(piece, begin, 0);
    }
  };
  std::string prefixed;
  uint32_t inserted = 0;
  if (prefix_space_ == PrefixSpace::kSegment && text[0] != ' ') {
    prefixed.assign(" ").append(text);
    text = prefixed;
    inserted = 1;
  }
  if (!has_split_) {
    emit(text, base, inserted);
    return;
  }
  std::vector<ByteSpan> pieces;
  split_text(split_, text, &pieces);
  for (const ByteSpan& p : pieces) {
    const std::string_view piece = text.substr(p.begin, p.end - p.begin);
    if (p.begin == 0 && inserted > 0) {
      emit(piece, base, inserted);
    } else {
      emit_piece(piece, base + p.begin - inserted);
    }
  }
}

void Tokenizer::encode_metaspace(std::string_view text, uint32_t base, bool at_input_start, std::vector<int32_t>* ids,
                                 std::vector<ByteSpan>* spans) const {
  // As tokenizers' Metaspace: spaces become "▁"; a "▁" goes first unless the text already
  // starts with one (prepend_scheme "always"), or only in the text's first segment ("first").
  const bool starts_with_space = text[0] == ' ' || text.substr(0, kMetaspace.size()) == kMetaspace;
  const bool prepend = !starts_with_space && (metaspace_prepend_ == MetaspacePrepend::kAlways ||
                                              (metaspace_prepend_ == MetaspacePrepend::kFirst && at_input_start));
  const MetaspaceText m = to_metaspace(text, prepend);
  std::vector<std::pair<int32_t, uint32_t>> tokens;
  auto emit = [&](size_t begin, size_t end) {
    tokens.clear();
    encode_piece(std::string_view(m.text).substr(begin, end - begin), &tokens);
    size_t offset = begin;
    for (const auto& [id, len] : tokens) {
      ids->push_back(id);  // -1: bytes no token stands for, removed by encode_with_spans
      spans->push_back({base + m.begin_of[offset], base + m.end_of[offset + len]});
      offset += len;
    }
  };
  if (!metaspace_split_) {
    emit(0, m.text.size());
    return;
  }
  // split: each "▁" starts a piece (MergedWithNext)
  size_t piece = 0;
  for (size_t at = m.text.find(kMetaspace, 1); at != std::string::npos; at = m.text.find(kMetaspace, at + 1)) {
    emit(piece, at);
    piece = at;
  }
  emit(piece, m.text.size());
}

void Tokenizer::encode_piece(std::string_view piece, std::vector<std::pair<int32_t, uint32_t>>* out) const {
  if (piece.size() > kCacheMaxPiece) {
    bpe(piece, out);
    return;
  }
  const std::string key(piece);
  {
    std::lock_guard<std::mutex> lock(cache_->mu);
    auto it = cache_->pieces.find(key);
    if (it != cache_->pieces.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = out->size();
  bpe(piece, out);
  std::lock_guard<std::mutex> lock(cache_->mu);
  if (cache_->pieces.size() >= kCacheEntries) cache_->pieces.clear();
  cache_->pieces.emplace(key, std::vector<std::pair<int32_t, uint32_t>>(out->begin() + start, out->end()));
}

void Tokenizer::initial_symbols(std::string_view piece, std::vector<std::pair<int32_t, uint32_t>>* out) const {
  if (byte_level_) {
    for (char c : piece) {
      const int32_t id = byte_ids_[static_cast<uint8_t>(c)];
      out->push_back({id >= 0 ? id : unk_id_, 1});
    }
    return;
  }
  // As tokenizers' BPE::merge_word: each character is its token; outside the vocabulary, its
  // bytes' <0xXX> tokens (byte_fallback, when all exist), else <unk>, runs of which fuse_unk
  // joins. (Like the library, a pending <unk> is only written when the next character in the
  // vocabulary or the end comes.) A byte that is not UTF-8 counts as a character.
  std::vector<DecodedChar> chars;
  decode_utf8(piece, &chars);
  int32_t unk = -1;
  uint32_t unk_len = 0;
  for (size_t i = 0; i < chars.size(); ++i) {
    const size_t b = chars[i].byte_offset;
    const size_t e = i + 1 < chars.size() ? chars[i + 1].byte_offset : piece.size();
    const std::string_view c = piece.substr(b, e - b);
    const auto len = static_cast<uint32_t>(c.size());
    auto it = char_ids_.find(chars[i].cp);
    if (chars[i].cp != kInvalidCodepoint && it != char_ids_.end()) {
      if (unk >= 0) out->push_back({unk, unk_len});
      unk = -1;
      out->push_back({it->second, len});
      continue;
    }
    if (byte_fallback_ && std::all_of(c.begin(), c.end(), [&](char x) { return byte_ids_[static_cast<uint8_t>(x)] >= 0; })) {
      for (char x : c) out->push_back({byte_ids_[static_cast<uint8_t>(x)], 1});
      continue;
    }
    if (unk_id_ < 0) {  // no <unk>: the character is dropped
      out->push_back({-1, len});
      continue;
    }
    if (unk >= 0 && fuse_unk_) {
      unk_len += len;
      continue;
    }
    if (unk >= 0) out->push_back({unk, unk_len});
    unk = unk_id_;
    unk_len = len;
  }
  if (unk >= 0) out->push_back({unk, unk_len});
}

void Tokenizer::bpe(std::string_view piece, std::vector<std::pair<int32_t, uint32_t>>* out) const {
  if (ignore_merges_) {
    std::string word;
    if (byte_level_) {
      for (char c : piece) word += byte_chars_[static_cast<uint8_t>(c)];
    } else {
      word = piece;
    }
    auto it = vocab_.find(word);
    if (it != vocab_.end()) {
      out->push_back({it->second, static_cast<uint32_t>(piece.size())});
      return;
    }
  }
  std::vector<std::pair<int32_t, uint32_t>> initial;
  initial_symbols(piece, &initial);
  if (byte_level_) {
    merge_symbols(initial, out);
    return;
  }
  // A symbol no merge takes part in (in practice a <0xXX> byte token, e.g. of a newline) splits
  // the word into runs that merge independently: the same result, from smaller queues.
  size_t run = 0;
  for (size_t i = 0; i < initial.size(); ++i) {
    const int32_t id = initial[i].first;
    if (id >= 0 && in_merges_[static_cast<size_t>(id)]) continue;
    merge_symbols(std::span(initial).subspan(run, i - run), out);
    out->push_back(initial[i]);
    run = i + 1;
  }
  merge_symbols(std::span(initial).subspan(run), out);
}

void Tokenizer::merge_symbols(std::span<const std::pair<int32_t, uint32_t>> initial,
                              std::vector<std::pair<int32_t, uint32_t>>* out) const {
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    uint32_t len;  // bytes; 0 once merged into its left neighbour
  };
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  const auto n = static_cast<int32_t>(initial.size());
  std::vector<Symbol> symbols(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    const auto& [id, len] = initial[static_cast<size_t>(i)];
    symbols[static_cast<size_t>(i)] = {id, i - 1, i + 1 < n ? i + 1 : -1, len};
  }
  auto find_merge = [&](int32_t left, int32_t right) -> const Merge* {
    const int32_t a = symbols[static_cast<size_t>(left)].id, b = symbols[static_cast<size_t>(right)].id;
    if (a < 0 || b < 0) return nullptr;
    auto it = merges_.find((uint64_t{static_cast<uint32_t>(a)} << 32) | static_cast<uint32_t>(b));
    return it == merges_.end() ? nullptr : &it->second;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  for (int32_t i = 0; i + 1 < n; ++i) {
    if (const Merge* m = find_merge(i, i + 1)) queue.push({m->rank, i, m->id});
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& s = symbols[static_cast<size_t>(top.pos)];
    if (s.len == 0 || s.next < 0) continue;
    const Merge* m = find_merge(top.pos, s.next);
    if (m == nullptr || m->id != top.id) continue;  // stale: a neighbour changed since
    Symbol& right = symbols[static_cast<size_t>(s.next)];
    s.id = top.id;
    s.len += right.len;
    right.len = 0;
    s.next = right.next;
    if (s.next >= 0) symbols[static_cast<size_t>(s.next)].prev = top.pos;
    if (s.prev >= 0) {
      if (const Merge* l = find_merge(s.prev, top.pos)) queue.push({l->rank, s.prev, l->id});
    }
    if (s.next >= 0) {
      if (const Merge* r = find_merge(top.pos, s.next)) queue.push({r->rank, top.pos, r->id});
    }
  }
  for (int32_t i = 0; i >= 0 && i < n; i = symbols[static_cast<size_t>(i)].next) {
    const Symbol& s = symbols[static_cast<size_t>(i)];
    out->push_back({s.id, s.len});  // id -1: bytes without a token, dropped by the caller
  }
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  if (!byte_level_) return decode_metaspace(ids);
  std::string out;
  std::vector<DecodedChar> chars;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) continue;
    const std::string& token = id_to_token_[static_cast<size_t>(id)];
    if (is_added_[static_cast<size_t>(id)]) {
      out += token;
      continue;
    }
    decode_utf8(token, &chars);
    for (const DecodedChar& c : chars) {
      auto it = char_to_byte_.find(c.cp);
      if (it != char_to_byte_.end()) {
        out.push_back(static_cast<char>(it->second));
      } else if (c.cp != kInvalidCodepoint) {
        append_utf8(c.cp, &out);
      }
    }
  }
  return out;
}

std::string Tokenizer::decode_metaspace(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) continue;
    const std::string& token = id_to_token_[static_cast<size_t>(id)];
    if (is_added_[static_cast<size_t>(id)]) {
      out += token;
      continue;
    }
    const auto byte = std::find(std::begin(byte_ids_), std::end(byte_ids_), id);
    if (byte != std::end(byte_ids_)) {
      out.push_back(static_cast<char>(byte - std::begin(byte_ids_)));
      continue;
    }
    for (size_t at = 0; at < token.size();) {
      if (token.compare(at, kMetaspace.size(), kMetaspace) == 0) {
        out += ' ';
        at += kMetaspace.size();
      } else {
        out += token[at++];
      }
    }
  }
  if (strip_leading_space_ && !out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

Result<EncodedChat> Tokenizer::encode_chat(const nlohmann::ordered_json& messages, const ChatRenderOptions& options) const {
  if (!chat_) {
    return Status::Unimplemented(config_path_ + ": no chat_template; chat data needs the template of a chat model "
                                 "(tokenizer_config.json's chat_template or chat_template.jinja beside it)");
  }
  ASSIGN_OR_RETURN(RenderedChat rendered, chat_->render_with_spans(messages, options));
  EncodedChat chat;
  chat.text = std::move(rendered.text);
  std::vector<ByteSpan> spans;
  encode_with_spans(chat.text, EncodeOptions{.add_special_tokens = false, .parse_special = true}, &chat.ids, &spans);
  chat.loss_mask.resize(chat.ids.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    uint8_t counts = 0;
    for (const ByteSpan& a : rendered.assistant) counts |= (spans[i].begin < a.end && a.begin < spans[i].end) ? 1 : 0;
    chat.loss_mask[i] = counts;
  }
  return chat;
}

}  // namespace strata::model
