// The pre-tokenizer's regex splits, written by hand for the three patterns in use by byte-level
// BPE models (Hugging Face `tokenizers` runs them through Oniguruma; std::regex has no \p{L}).
// Each splitter reproduces the leftmost-first alternation and backtracking of its pattern, so
// its pieces equal the matches of the regex. Pure functions; safe for concurrent use.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace strata::model {

enum class SplitPattern : uint8_t {
  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kGpt2,
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
  // \s*[\r\n]+|\s+(?!\S)|\s+
  kLlama3,
  // As kLlama3 with \p{N} (one digit per piece) in place of \p{N}{1,3}.
  kQwen2,
};

// The pattern whose regex source is exactly `regex`; nullopt for any other.
std::optional<SplitPattern> recognise_split_pattern(std::string_view regex);
// The regex source of a pattern.
std::string_view split_pattern_regex(SplitPattern pattern);

// A piece of text: bytes [begin, end).
struct ByteSpan {
  uint32_t begin;
  uint32_t end;
};

// Appends the pieces of text to out, in order; together they cover text exactly.
void split_text(SplitPattern pattern, std::string_view text, std::vector<ByteSpan>* out);

}  // namespace strata::model
