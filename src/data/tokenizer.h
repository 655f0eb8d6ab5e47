// A BPE tokenizer read from a Hugging Face tokenizer.json, byte-level (GPT-2, Llama-3, Qwen2
// and models built like them) or sentencepiece style (Llama-2, Mistral, Mixtral), with
// tokenizer_config.json beside it for the BOS/EOS tokens and the chat template.
//
// Supported tokenizer.json: model.type "BPE" (vocab; merges as "a b" strings or [a, b] pairs;
// ignore_merges; byte_fallback and fuse_unk in sentencepiece style), added_tokens (leftmost and
// longest first; lstrip, rstrip and single_word are not interpreted), and either
//   byte-level: normalizer null, NFC or a Sequence of NFC alone (Qwen2, Qwen2-MoE, Qwen3;
//     unicode_nfc.h), pre_tokenizer ByteLevel (add_prefix_space, use_regex) or
//     Sequence[Split(Regex, Isolated), ByteLevel(use_regex false)] with one of the split
//     patterns of tokenizer_split.h; or
//   sentencepiece style: normalizer Sequence[Prepend("▁"), Replace(" ", "▁")] with no
//     pre_tokenizer (Llama-2's files), or no normalizer and pre_tokenizer Metaspace("▁",
//     prepend_scheme always / first / never or the older add_prefix_space, split). Characters
//     are the initial symbols; one outside the vocabulary becomes its <0xXX> byte tokens (a
//     byte that is not UTF-8 too). Prepend and "first" put "▁" only before non-empty text
//     that starts the input or follows an added token (Prepend) / starts the input (first).
//     Decoding maps "▁" to a space and <0xXX> to its byte and drops the first space when the
//     decoder has Strip(" ", 1, 0) or is Metaspace with a prepend scheme; other decoders are
//     not interpreted, and the library's spaces around added tokens are not reproduced.
// and post_processor ByteLevel / TemplateProcessing / a Sequence of them. Anything else is
// Unimplemented naming the file and the field.
//
// Encoding follows tokenizers: added tokens with "normalized": false (the special tokens of
// the models above) are found in the raw text first; the text between them is normalized piece
// by piece, and added tokens with "normalized": true are then found in it by their normalized
// content. Pre-tokenization and BPE see the normalized text; spans refer to the raw text (a
// token inside a stretch that normalization changed stands for the whole stretch). Text that
// is not valid UTF-8 is normalized around its invalid bytes, which pass unchanged. NFC follows
// the Unicode version of unicode_nfc_tables.h; tokenizers' own tables are older and give class
// 0 to the few combining marks added since, so text with those marks can order differently.
//
// Chat: tokenizer_config.json's chat_template (or chat_template.jinja beside it) is rendered by
// strata's Jinja interpreter (chat_template.h).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "data/chat_template.h"
#include "data/tokenizer_split.h"

namespace strata::model {

struct EncodeOptions {
  // Applies the post-processor's template (Llama-3: BOS first), as `tokenizers` does by default.
  bool add_special_tokens = false;
  // Recognises the text of added tokens (e.g. "<|endoftext|>") in the input and emits their ids;
  // when false, such text is encoded as ordinary bytes.
  bool parse_special = true;
  // Bytes of the text no token stands for (a tokenizer with neither byte fallback nor <unk>
  // meeting a character outside its vocabulary) are left out of the ids; when this is set, the
  // byte offset of each such character is appended to it, so that a caller can refuse the text.
  std::vector<uint32_t>* unencodable = nullptr;
};

// A rendered and encoded conversation. loss_mask[i] is 1 when token i overlaps an assistant
// span (the reply and its end marker, chat_template.h), 0 for everything the model is given
// (system and user turns, role headers, generation prompts, default system messages).
struct EncodedChat {
  std::string text;
  std::vector<int32_t> ids;
  std::vector<uint8_t> loss_mask;
};

// Immutable after load except for an internal merge cache guarded by a mutex: safe for
// concurrent use. Movable, not copyable.
class Tokenizer {
 public:
  // `path`: a directory holding tokenizer.json (and optionally tokenizer_config.json), or the
  // tokenizer.json file itself. Errors name the file.
  static Result<Tokenizer> load(const std::string& path);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;
  ~Tokenizer();

  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& options = {}) const;
  // As encode, and spans->at(i) are the bytes of text that token i stands for (empty for a token
  // the post-processor added). Tokens of a prefix space that add_prefix_space inserted start
  // at their segment's first byte.
  void encode_with_spans(std::string_view text, const EncodeOptions& options, std::vector<int32_t>* ids,
                         std::vector<ByteSpan>* spans) const;
  // The bytes the ids stand for: added tokens as their content, others through the byte-level
  // map (sentencepiece style: "▁" as a space, <0xXX> as its byte, see above). Ids outside the vocabulary are skipped. The result is not necessarily valid UTF-8 when
  // the ids end inside a character.
  std::string decode(std::span<const int32_t> ids) const;

  // As encode, but a text with bytes no token stands for is an InvalidArgument naming `where`,
  // the first such byte's offset (+ `offset`, where the text starts in the file) and its value:
  // dropping them would train on a text that is not the file's. Byte-level and byte-fallback
  // tokenizers always succeed.
  Result<std::vector<int32_t>> encode_all(std::string_view text, const EncodeOptions& options,
                                          const std::string& where, uint64_t offset = 0) const;

  // The id of a token as the vocabulary spells it ("Ġthe") or of an added token; -1 if absent.
  int32_t token_to_id(std::string_view token) const;
  // The vocabulary spelling of id; empty when absent.
  std::string id_to_token(int32_t id) const;
  // One more than the largest id of the vocabulary or the added tokens.
  int64_t vocab_size() const { return static_cast<int64_t>(id_to_token_.size()); }
  // From tokenizer_config.json (bos_token / eos_token); -1 when not set. Without an eos_token
  // there, an added token "<|endoftext|>" serves as EOS (GPT-2 ships no eos_token).
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }

  // The ids the post-processor template puts before and after a sequence (add_special_tokens).
  std::span<const int32_t> template_prefix() const { return template_prefix_; }
  std::span<const int32_t> template_suffix() const { return template_suffix_; }
  // True when encoding a text in parts, cut right after a '\n' that an ASCII letter or digit
  // follows, gives the ids of encoding it whole (a split pattern ends every piece there, no
  // prefix space is added per part and no added token contains a newline).
  bool can_cut_after_newlines() const;

  // The chat template, when the tokenizer has one.
  const std::optional<ChatTemplate>& chat_template() const { return chat_; }
  // Renders messages (a JSON list of {"role", "content", ...}) with the chat template and
  // encodes the text (added tokens parsed, no post-processor template), as
  // apply_chat_template(tokenize=True) does; the loss mask marks the tokens that overlap an
  // assistant span (chat_template.h). Unimplemented naming tokenizer_config.json when there is
  // no template; InvalidArgument for a conversation the template refuses.
  Result<EncodedChat> encode_chat(const nlohmann::ordered_json& messages, const ChatRenderOptions& options = {}) const;

 private:
  struct AddedToken {
    int32_t id;
    std::string content;
    bool normalized;    // looked for in normalized text
    std::string match;  // what is looked for: content, normalized when `normalized`
  };
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  struct Cache;

  Tokenizer();
  Status load_tokenizer_json(const std::string& file);
  Status load_config(const std::string& file);
  // Where the added tokens with this `normalized` flag occur in text: (offset, token), leftmost
  // and longest first, not overlapping.
  std::vector<std::pair<size_t, const AddedToken*>> find_added(std::string_view text, bool normalized) const;
  // Encodes a stretch of raw text that holds no non-normalized added token: normalizes it, then
  // finds the normalized added tokens (when parse_special) and encodes the rest. Spans refer to
  // the raw text and are offset by `base`.
  void encode_stretch(std::string_view raw, uint32_t base, bool parse_special, std::vector<int32_t>* ids,
                      std::vector<ByteSpan>* spans) const;
  // Encodes text without added tokens: prefix space, split, BPE. Spans are offset by `base`.
  // at_input_start: text begins the input (Metaspace's prepend_scheme "first").
  void encode_segment(std::string_view text, uint32_t base, bool at_input_start, std::vector<int32_t>* ids,
                      std::vector<ByteSpan>* spans) const;
  // encode_segment for the Metaspace pre-tokenizer. REQUIRES: text is not empty.
  void encode_metaspace(std::string_view text, uint32_t base, bool at_input_start, std::vector<int32_t>* ids,
                        std::vector<ByteSpan>* spans) const;
  // Removes the id -1 entries the encoders leave for bytes no token stands for, appending their
  // start offsets to `unencodable` when it is not null.
  static void remove_unencodable(std::vector<int32_t>* ids, std::vector<ByteSpan>* spans,
                                 std::vector<uint32_t>* unencodable);
  // BPE of one piece: (id, byte length) pairs, from the cache when there; id -1 for bytes that
  // have no token (no <unk>), which the caller passes on as -1.
  void encode_piece(std::string_view piece, std::vector<std::pair<int32_t, uint32_t>>* out) const;
  void bpe(std::string_view piece, std::vector<std::pair<int32_t, uint32_t>>* out) const;
  // Applies the merges to symbols (id, byte length), lowest rank first, leftmost first.
  void merge_symbols(std::span<const std::pair<int32_t, uint32_t>> initial,
                     std::vector<std::pair<int32_t, uint32_t>>* out) const;
  // The symbols BPE starts from: (id, byte length), id -1 for a byte with no token.
  std::string decode_metaspace(std::span<const int32_t> ids) const;
  void initial_symbols(std::string_view piece, std::vector<std::pair<int32_t, uint32_t>>* out) const;

  std::string config_path_;  // tokenizer_config.json, named in chat errors
  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<uint8_t> is_added_;                 // by id
  std::unordered_map<uint64_t, Merge> merges_;    // (left id << 32 | right id) -> merge
  std::vector<uint8_t> in_merges_;                // by id: 1 when a merge has it on either side
  int32_t byte_ids_[256];                         // id of each single-byte token, -1 if absent
  std::string byte_chars_[256];                   // UTF-8 of each byte's byte-level character
  std::unordered_map<uint32_t, uint8_t> char_to_byte_;  // byte-level character -> byte
  std::vector<AddedToken> added_;                 // sorted: longest match first
  bool has_normalized_added_ = false;
  bool nfc_ = false;                              // the normalizer is NFC
  bool ignore_merges_ = false;
  // Where ByteLevel's add_prefix_space puts a space: before each text segment (ByteLevel before
  // or doing the split) or before each piece (ByteLevel after a Split).
  enum class PrefixSpace : uint8_t { kNone, kSegment, kPiece };
  PrefixSpace prefix_space_ = PrefixSpace::kNone;
  bool has_split_ = false;
  // Sentencepiece style (byte_level_ false): the model's symbols are characters, a character
  // outside the vocabulary becomes its <0xXX> byte tokens (byte_fallback_) or <unk>, and "▁"
  // stands for a space, put there by the Prepend/Replace normalizer or the Metaspace
  // pre-tokenizer.
  enum class MetaspacePrepend : uint8_t { kAlways, kFirst, kNever };
  // Reads a Metaspace pre-tokenizer or decoder; what is not supported, or empty.
  static std::string read_metaspace(const nlohmann::json& p, MetaspacePrepend* prepend);
  bool byte_level_ = true;
  std::unordered_map<uint32_t, int32_t> char_ids_;  // code point -> id of its one-character token
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool spm_normalizer_ = false;  // Sequence[Prepend("▁"), Replace(" ", "▁")]
  bool metaspace_ = false;       // the Metaspace pre-tokenizer
  MetaspacePrepend metaspace_prepend_ = MetaspacePrepend::kAlways;
  bool metaspace_split_ = true;      // pieces start at each "▁"
  bool strip_leading_space_ = false;  // the decoder drops the first " " of the text
  SplitPattern split_ = SplitPattern::kGpt2;
  int32_t unk_id_ = -1;
  std::vector<int32_t> template_prefix_;  // post-processor ids before the sequence
  std::vector<int32_t> template_suffix_;  // and after it
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  std::string bos_text_;
  std::string eos_text_;
  std::optional<ChatTemplate> chat_;
  std::unique_ptr<Cache> cache_;
};

}  // namespace strata::model
