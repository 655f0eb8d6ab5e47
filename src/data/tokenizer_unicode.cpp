#include "data/tokenizer_unicode.h"

#include <algorithm>

namespace strata::model {
namespace {

bool in_ranges(std::span<const CodepointRange> ranges, uint32_t cp) {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), cp,
                             [](uint32_t v, const CodepointRange& r) { return v < r.first; });
  return it != ranges.begin() && cp <= std::prev(it)->last;
}

}  // namespace

bool is_letter(uint32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return in_ranges(letter_ranges(), cp);
}

bool is_number(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return in_ranges(number_ranges(), cp);
}

bool is_space(uint32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  if (cp < 0x85) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
         cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

CharClass char_class(uint32_t cp) {
  if (is_letter(cp)) return CharClass::kLetter;
  if (is_number(cp)) return CharClass::kNumber;
  if (is_space(cp)) return CharClass::kSpace;
  return CharClass::kOther;
}

void decode_utf8(std::string_view text, std::vector<DecodedChar>* out) {
  out->clear();
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const uint8_t b = s[i];
    uint32_t cp = kInvalidCodepoint;
    size_t len = 1;
    if (b < 0x80) {
      cp = b;
    } else {
      size_t need = 0;
      uint32_t min = 0;
      if ((b & 0xE0) == 0xC0) {
        need = 1, min = 0x80, cp = b & 0x1F;
      } else if ((b & 0xF0) == 0xE0) {
        need = 2, min = 0x800, cp = b & 0x0F;
      } else if ((b & 0xF8) == 0xF0) {
        need = 3, min = 0x10000, cp = b & 0x07;
      }
      bool ok = need > 0;
      for (size_t k = 1; ok && k <= need; ++k) {
        if (i + k >= n || (s[i + k] & 0xC0) != 0x80) {
          ok = false;
        } else {
          cp = (cp << 6) | (s[i + k] & 0x3F);
        }
      }
      if (ok && (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))) ok = false;
      if (ok) {
        len = need + 1;
      } else {
        cp = kInvalidCodepoint;
      }
    }
    out->push_back({cp, static_cast<uint32_t>(i)});
    i += len;
  }
}

void append_utf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace strata::model
