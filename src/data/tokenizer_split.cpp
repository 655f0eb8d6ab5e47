#include "data/tokenizer_split.h"

#include "core/check.h"
#include "data/tokenizer_unicode.h"

namespace strata::model {
namespace {

constexpr std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// The decoded text with each character's class, and a cursor-free view for the matchers.
class Chars {
 public:
  explicit Chars(std::string_view text) : text_size_(static_cast<uint32_t>(text.size())) {
    decode_utf8(text, &chars_);
    classes_.reserve(chars_.size());
    for (const DecodedChar& c : chars_) classes_.push_back(char_class(c.cp));
  }
  size_t size() const { return chars_.size(); }
  uint32_t cp(size_t i) const { return chars_[i].cp; }
  CharClass cls(size_t i) const { return classes_[i]; }
  uint32_t byte(size_t i) const { return i < chars_.size() ? chars_[i].byte_offset : text_size_; }
  bool is(size_t i, CharClass c) const { return i < chars_.size() && classes_[i] == c; }
  bool is_newline(size_t i) const { return i < chars_.size() && (chars_[i].cp == '\r' || chars_[i].cp == '\n'); }
  // End of the run of class c starting at i.
  size_t run(size_t i, CharClass c) const {
    while (is(i, c)) ++i;
    return i;
  }

 private:
  uint32_t text_size_;
  std::vector<DecodedChar> chars_;
  std::vector<CharClass> classes_;
};

// 's 't 're 've 'm 'll 'd at i: the match length in characters, or 0. With ignore_case, letters
// match either case (and 's also matches U+017F LONG S, which case-folds to s).
size_t match_contraction(const Chars& c, size_t i, bool ignore_case) {
  if (i >= c.size() || c.cp(i) != '\'') return 0;
  auto letter = [&](size_t k, char want) {
    if (k >= c.size()) return false;
    uint32_t cp = c.cp(k);
    if (cp == static_cast<uint32_t>(want)) return true;
    if (!ignore_case) return false;
    if (cp < 0x80 && (cp | 0x20) == static_cast<uint32_t>(want)) return true;
    return want == 's' && cp == 0x17F;
  };
  if (letter(i + 1, 's') || letter(i + 1, 't')) return 2;
  if ((letter(i + 1, 'r') || letter(i + 1, 'v')) && letter(i + 2, 'e')) return 3;
  if (letter(i + 1, 'm')) return 2;
  if (letter(i + 1, 'l') && letter(i + 2, 'l')) return 3;
  if (letter(i + 1, 'd')) return 2;
  return 0;
}

// \s+(?!\S)|\s+ at the start of a whitespace run [i, j): the whole run at the end of the text,
// else all of it but the last character, else (a run of one before a non-space) that one.
size_t match_trailing_space(const Chars& c, size_t i) {
  size_t j = c.run(i, CharClass::kSpace);
  if (j == c.size()) return j;
  return j - 1 > i ? j - 1 : j;
}

size_t next_gpt2(const Chars& c, size_t i) {
  if (size_t n = match_contraction(c, i, /*ignore_case=*/false)) return i + n;
  // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+'
  const size_t j = c.cp(i) == ' ' ? i + 1 : i;
  for (CharClass cls : {CharClass::kLetter, CharClass::kNumber, CharClass::kOther}) {
    if (c.is(j, cls)) return c.run(j, cls);
  }
  return match_trailing_space(c, i);  // c.cls(i) is kSpace here
}

size_t next_llama3(const Chars& c, size_t i, size_t max_digits) {
  if (size_t n = match_contraction(c, i, /*ignore_case=*/true)) return i + n;
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (c.is(i, CharClass::kLetter)) return c.run(i, CharClass::kLetter);
  if (!c.is_newline(i) && !c.is(i, CharClass::kNumber) && c.is(i + 1, CharClass::kLetter)) {
    return c.run(i + 1, CharClass::kLetter);
  }
  // \p{N}{1,max_digits}
  if (c.is(i, CharClass::kNumber)) {
    size_t j = i;
    while (j - i < max_digits && c.is(j, CharClass::kNumber)) ++j;
    return j;
  }
  // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
  const size_t j = c.cp(i) == ' ' ? i + 1 : i;
  if (c.is(j, CharClass::kOther)) {
    size_t k = c.run(j, CharClass::kOther);
    while (c.is_newline(k)) ++k;
    return k;
  }
  // \s*[\r\n]+ : up to and including the last CR/LF of the whitespace run.
  const size_t end = c.run(i, CharClass::kSpace);
  for (size_t k = end; k > i; --k) {
    if (c.is_newline(k - 1)) return k;
  }
  return match_trailing_space(c, i);
}

}  // namespace

std::optional<SplitPattern> recognise_split_pattern(std::string_view regex) {
  if (regex == kGpt2Regex) return SplitPattern::kGpt2;
  if (regex == kLlama3Regex) return SplitPattern::kLlama3;
  if (regex == kQwen2Regex) return SplitPattern::kQwen2;
  return std::nullopt;
}

std::string_view split_pattern_regex(SplitPattern pattern) {
  switch (pattern) {
    case SplitPattern::kGpt2:
      return kGpt2Regex;
    case SplitPattern::kLlama3:
      return kLlama3Regex;
    case SplitPattern::kQwen2:
      return kQwen2Regex;
  }
  return {};
}

void split_text(SplitPattern pattern, std::string_view text, std::vector<ByteSpan>* out) {
  const Chars chars(text);
  size_t i = 0;
  while (i < chars.size()) {
    size_t j = 0;
    switch (pattern) {
      case SplitPattern::kGpt2:
        j = next_gpt2(chars, i);
        break;
      case SplitPattern::kLlama3:
        j = next_llama3(chars, i, 3);
        break;
      case SplitPattern::kQwen2:
        j = next_llama3(chars, i, 1);
        break;
    }
    CHECK(j > i);
    out->push_back({chars.byte(i), chars.byte(j)});
    i = j;
  }
}

}  // namespace strata::model
