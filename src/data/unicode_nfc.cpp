#include "data/unicode_nfc.h"

#include <algorithm>
#include <iterator>

#include "data/tokenizer_unicode.h"
#include "data/unicode_nfc_tables.h"

namespace strata::model {
namespace {

using nfc_tables::kComposesBackward;
using nfc_tables::kNfcChars;
using nfc_tables::kNfcCompositions;
using nfc_tables::kNoBoundary;
using nfc_tables::kNotNfc;
using nfc_tables::NfcChar;
using nfc_tables::NfcComposition;

// Hangul syllables (Unicode 3.12): S = SBase + (L * VCount + V) * TCount + T.
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28;
constexpr uint32_t kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

// Inside a stretch being normalized, an invalid byte b stands as kInvalidByte + b: above every
// code point, so it has no data, is a starter and composes with nothing.
constexpr uint32_t kInvalidByte = 0x110000;

bool is_hangul_syllable(uint32_t cp) { return cp - kSBase < kSCount; }

// The table entry of cp; null for the code points that have none (class 0, no decomposition,
// no flags), which includes everything below U+00C0, Hangul syllables and invalid bytes.
const NfcChar* find_char(uint32_t cp) {
  if (cp < 0xC0 || cp > 0x10FFFF) return nullptr;
  const NfcChar* end = std::end(kNfcChars);
  const NfcChar* it =
      std::lower_bound(std::begin(kNfcChars), end, cp, [](const NfcChar& c, uint32_t v) { return c.cp < v; });
  return it != end && it->cp == cp ? it : nullptr;
}

uint8_t combining_class(uint32_t cp) {
  const NfcChar* c = find_char(cp);
  return c != nullptr ? c->ccc : 0;
}

// Appends the full canonical decomposition of cp.
void decompose(uint32_t cp, std::vector<uint32_t>* out) {
  if (is_hangul_syllable(cp)) {
    const uint32_t s = cp - kSBase;
    out->push_back(kLBase + s / kNCount);
    out->push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out->push_back(kTBase + s % kTCount);
    return;
  }
  const NfcChar* c = find_char(cp);
  if (c == nullptr || c->decomposition[0] == 0) {
    out->push_back(cp);
    return;
  }
  decompose(c->decomposition[0], out);
  if (c->decomposition[1] != 0) decompose(c->decomposition[1], out);
}

// The primary composite of first followed by second; 0 when there is none.
uint32_t compose(uint32_t first, uint32_t second) {
  if (first - kLBase < kLCount && second - kVBase < kVCount) {
    return kSBase + ((first - kLBase) * kVCount + (second - kVBase)) * kTCount;
  }
  if (is_hangul_syllable(first) && (first - kSBase) % kTCount == 0 && second - (kTBase + 1) < kTCount - 1) {
    return first + (second - kTBase);
  }
  const NfcComposition* end = std::end(kNfcCompositions);
  const NfcComposition* it = std::lower_bound(std::begin(kNfcCompositions), end, std::pair{first, second},
                                              [](const NfcComposition& c, std::pair<uint32_t, uint32_t> v) {
                                                return c.first != v.first ? c.first < v.first : c.second < v.second;
                                              });
  return it != end && it->first == first && it->second == second ? it->composite : 0;
}

struct ClassedChar {
  uint32_t cp;
  uint8_t ccc;  // canonical combining class
};

// Appends the NFC of a stretch of code points (invalid bytes as kInvalidByte + b) as UTF-8.
void normalize_stretch(std::span<const uint32_t> cps, std::vector<uint32_t>* scratch, std::vector<ClassedChar>* chars,
                       std::string* out) {
  // Canonical decomposition.
  scratch->clear();
  for (uint32_t cp : cps) decompose(cp, scratch);
  chars->clear();
  for (uint32_t cp : *scratch) chars->push_back({cp, combining_class(cp)});
  // Canonical ordering: each run of non-starters sorted by class, stably.
  for (auto run = chars->begin(); run != chars->end();) {
    if (run->ccc == 0) {
      ++run;
      continue;
    }
    auto run_end = std::find_if(run, chars->end(), [](const ClassedChar& m) { return m.ccc == 0; });
    std::stable_sort(run, run_end, [](const ClassedChar& a, const ClassedChar& b) { return a.ccc < b.ccc; });
    run = run_end;
  }
  // Canonical composition: each character joins the last starter when nothing between them
  // blocks it (a character of class 0 or of a class not below its own). Primary composites
  // start with a starter, so nothing composes before the first one.
  size_t starter = 0;
  bool has_starter = !chars->empty() && (*chars)[0].ccc == 0;
  uint8_t last_ccc = chars->empty() ? 0 : (*chars)[0].ccc;  // of the last character kept
  size_t kept = chars->empty() ? 0 : 1;
  for (size_t i = 1; i < chars->size(); ++i) {
    const ClassedChar m = (*chars)[i];
    if (has_starter && (last_ccc == 0 || last_ccc < m.ccc)) {
      if (const uint32_t composite = compose((*chars)[starter].cp, m.cp); composite != 0) {
        (*chars)[starter].cp = composite;
        continue;
      }
    }
    if (m.ccc == 0) {
      starter = kept;
      has_starter = true;
    }
    last_ccc = m.ccc;
    (*chars)[kept++] = m;
  }
  for (size_t i = 0; i < kept; ++i) {
    const uint32_t cp = (*chars)[i].cp;
    if (cp >= kInvalidByte) {
      out->push_back(static_cast<char>(cp - kInvalidByte));
    } else {
      append_utf8(cp, out);
    }
  }
}

}  // namespace

const char* nfc_unicode_version() { return nfc_tables::kUnicodeVersion; }

bool to_nfc(std::string_view text, std::string* out, std::vector<NfcEdit>* edits) {
  // Every code point from U+0300 up is encoded with a lead byte of 0xCC or more, and every code
  // point below it is NFC.
  if (std::all_of(text.begin(), text.end(), [](char c) { return static_cast<uint8_t>(c) < 0xCC; })) return false;
  std::vector<DecodedChar> chars;
  decode_utf8(text, &chars);

  // The text is cut before every character that NFC never joins with what precedes it (a
  // starter that composes with nothing before it and whose decomposition starts with such a
  // starter), so each stretch normalizes on its own. A stretch passes unchanged when it holds
  // no character that NFC excludes or that may compose backward and its non-starters are in
  // order (the quick check of UAX #15); otherwise it is normalized and compared.
  std::string result;
  std::vector<NfcEdit> changes;
  size_t copied = 0;  // text bytes before this are in result
  std::vector<uint32_t> stretch, scratch;
  std::vector<ClassedChar> classed;
  std::string normalized;
  auto finish = [&](size_t first, size_t last) {  // chars [first, last), which need the full algorithm
    const uint32_t begin = chars[first].byte_offset;
    const uint32_t end = last < chars.size() ? chars[last].byte_offset : static_cast<uint32_t>(text.size());
    stretch.clear();
    for (size_t k = first; k < last; ++k) {
      const uint32_t cp = chars[k].cp;
      stretch.push_back(cp != kInvalidCodepoint ? cp : kInvalidByte + static_cast<uint8_t>(text[chars[k].byte_offset]));
    }
    normalized.clear();
    normalize_stretch(stretch, &scratch, &classed, &normalized);
    if (text.substr(begin, end - begin) == normalized) return;
    result.append(text.substr(copied, begin - copied));
    copied = end;
    const uint32_t out_begin = static_cast<uint32_t>(result.size());
    result.append(normalized);
    const uint32_t out_end = static_cast<uint32_t>(result.size());
    if (!changes.empty() && changes.back().source_end == begin && changes.back().end == out_begin) {
      changes.back().source_end = end;
      changes.back().end = out_end;
    } else {
      changes.push_back({begin, end, out_begin, out_end});
    }
  };
  size_t first = 0;
  bool needs_work = false;
  uint8_t last_ccc = 0;
  for (size_t k = 0; k < chars.size(); ++k) {
    const NfcChar* c = find_char(chars[k].cp);
    const uint8_t flags = c != nullptr ? c->flags : 0;
    const uint8_t ccc = c != nullptr ? c->ccc : 0;
    if (k > first && (flags & kNoBoundary) == 0) {
      if (needs_work) finish(first, k);
      first = k;
      needs_work = false;
    }
    if ((flags & (kNotNfc | kComposesBackward)) != 0 || (ccc != 0 && last_ccc > ccc)) needs_work = true;
    last_ccc = ccc;
  }
  if (needs_work) finish(first, chars.size());
  if (changes.empty()) return false;
  result.append(text.substr(copied));
  *out = std::move(result);
  if (edits != nullptr) *edits = std::move(changes);
  return true;
}

std::string nfc(std::string_view text) {
  std::string out;
  return to_nfc(text, &out) ? out : std::string(text);
}

uint32_t nfc_source_begin(std::span<const NfcEdit> edits, uint32_t offset) {
  // The last edit that starts at or before offset.
  auto it =
      std::upper_bound(edits.begin(), edits.end(), offset, [](uint32_t v, const NfcEdit& e) { return v < e.begin; });
  if (it == edits.begin()) return offset;
  const NfcEdit& e = *std::prev(it);
  return offset < e.end ? e.source_begin : offset - e.end + e.source_end;
}

uint32_t nfc_source_end(std::span<const NfcEdit> edits, uint32_t offset) {
  // The last edit that starts before offset.
  auto it =
      std::lower_bound(edits.begin(), edits.end(), offset, [](const NfcEdit& e, uint32_t v) { return e.begin < v; });
  if (it == edits.begin()) return offset;
  const NfcEdit& e = *std::prev(it);
  return offset <= e.end ? e.source_end : offset - e.end + e.source_end;
}

}  // namespace strata::model
