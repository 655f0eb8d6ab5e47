// NFC against Python's unicodedata.normalize("NFC"): every code point on its own and a few
// thousand random mixtures of letters, combining marks, Hangul and decomposable characters
// (tests/fixtures/unicode/make_nfc_fixtures.py writes them); invalid UTF-8 and offset mapping.
#include "data/unicode_nfc.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "data/tokenizer_unicode.h"

namespace strata::model {
namespace {

const std::string kUnicodeFixtures = std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/unicode";

// The lines of a fixture after its "# Unicode X: ..." header; version gets X.
std::vector<std::string> read_fixture(const std::string& name, std::string* version) {
  std::ifstream in(kUnicodeFixtures + "/" + name, std::ios::binary);
  EXPECT_TRUE(in.good()) << name;
  std::string line;
  std::getline(in, line);
  const std::string prefix = "# Unicode ";
  EXPECT_EQ(line.rfind(prefix, 0), 0u) << name << ": " << line;
  *version = line.substr(prefix.size(), line.find(':') - prefix.size());
  std::vector<std::string> lines;
  while (std::getline(in, line)) lines.push_back(line);
  return lines;
}

std::string utf8(uint32_t cp) {
  std::string s;
  append_utf8(cp, &s);
  return s;
}

std::string hex_of(const std::string& s) {
  std::vector<DecodedChar> chars;
  decode_utf8(s, &chars);
  std::ostringstream out;
  for (const DecodedChar& c : chars) out << std::hex << std::uppercase << c.cp << ' ';
  return out.str();
}

TEST(NfcTest, EveryCodePointMatchesPython) {
  std::string version;
  const std::vector<std::string> lines = read_fixture("nfc_singles.txt", &version);
  ASSERT_EQ(version, nfc_unicode_version()) << "regenerate the fixture and tools/gen_nfc_tables.py's header together";
  std::unordered_map<uint32_t, std::string> changed;
  for (const std::string& line : lines) {
    std::istringstream in(line);
    uint32_t cp = 0, part = 0;
    in >> std::hex >> cp;
    std::string expected;
    while (in >> std::hex >> part) append_utf8(part, &expected);
    changed[cp] = expected;
  }
  ASSERT_GT(changed.size(), 1000u);
  int failures = 0;
  for (uint32_t cp = 0; cp <= 0x10FFFF; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    const std::string text = utf8(cp);
    auto it = changed.find(cp);
    const std::string& expected = it != changed.end() ? it->second : text;
    const std::string got = nfc(text);
    if (got != expected && ++failures <= 20) {
      ADD_FAILURE() << "U+" << std::hex << std::uppercase << cp << ": got " << hex_of(got) << "expected "
                    << hex_of(expected);
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(NfcTest, RandomSequencesMatchPython) {
  std::string version;
  const std::vector<std::string> lines = read_fixture("nfc_sequences.txt", &version);
  ASSERT_EQ(version, nfc_unicode_version());
  ASSERT_GE(lines.size(), 3000u);
  int failures = 0, changed = 0;
  for (const std::string& line : lines) {
    const size_t tab = line.find('\t');
    ASSERT_NE(tab, std::string::npos) << line;
    const std::string input = line.substr(0, tab), expected = line.substr(tab + 1);
    std::string out;
    std::vector<NfcEdit> edits;
    const bool differs = to_nfc(input, &out, &edits);
    const std::string got = differs ? out : input;
    changed += differs;
    EXPECT_EQ(differs, input != expected) << hex_of(input);
    if (got != expected && ++failures <= 20) {
      ADD_FAILURE() << "input " << hex_of(input) << "\n  got      " << hex_of(got) << "\n  expected "
                    << hex_of(expected);
    }
    // Edits are sorted, disjoint and account for every byte.
    uint32_t source = 0, normalized = 0;
    for (const NfcEdit& e : edits) {
      ASSERT_GE(e.source_begin, source);
      ASSERT_EQ(e.begin - normalized, e.source_begin - source);
      ASSERT_LT(e.source_begin, e.source_end);
      ASSERT_LT(e.begin, e.end);
      source = e.source_end;
      normalized = e.end;
    }
    if (differs) {
      EXPECT_EQ(out.size() - normalized, input.size() - source);
    }
  }
  EXPECT_EQ(failures, 0);
  EXPECT_GT(changed, 1000);  // the fixture exercises composition, not just copying
}

TEST(NfcTest, TextBelowU0300AndTextAlreadyNfcAreLeftAlone) {
  std::string out = "untouched";
  std::vector<NfcEdit> edits;
  EXPECT_FALSE(to_nfc("plain ASCII and Latin-1: caf\u00e9 \u00c5 \u00ff \u02ff", &out, &edits));
  EXPECT_FALSE(to_nfc("", &out, &edits));
  EXPECT_FALSE(to_nfc("Ti\u1ebfng Vi\u1ec7t \ud55c\uae00 \u65e5\u672c\u8a9e a\u0316 \U0001F600", &out, &edits));
  EXPECT_EQ(out, "untouched");
  EXPECT_TRUE(edits.empty());
}

TEST(NfcTest, ComposesDecomposedText) {
  EXPECT_EQ(nfc("e\u0301"), "\u00e9");
  EXPECT_EQ(nfc("\u1112\u1161\u11ab\u1100\u1173\u11af"), "\ud55c\uae00");  // jamo -> syllables
  EXPECT_EQ(nfc("\ud558\u11ab"), "\ud55c");                                // LV + T -> LVT
  EXPECT_EQ(nfc("Vie\u0302\u0323t"), "Vi\u1ec7t");                         // marks reordered first
  EXPECT_EQ(nfc("\u212b"), "\u00c5");                                      // singleton
  EXPECT_EQ(nfc("\u0958"), "\u0915\u093c");                                // composition exclusion
  EXPECT_EQ(nfc("\u0f73"), "\u0f71\u0f72");                                // non-starter decomposition
  EXPECT_EQ(nfc("\u0301e"), "\u0301e");                                    // a leading mark stays
}

TEST(NfcTest, LongRunsOfMarksAreSortedAndComposed) {
  std::string text = "a", expected = "\u00e1";
  for (int i = 0; i < 2000; ++i) text += "\u0301\u0316";  // classes 230, 220
  for (int i = 0; i < 2000; ++i) expected += "\u0316";
  for (int i = 0; i < 1999; ++i) expected += "\u0301";
  EXPECT_EQ(nfc(text), expected);
}

TEST(NfcTest, InvalidUtf8PassesThroughAndBlocksComposition) {
  // Valid text around invalid bytes is normalized; the bytes stay, and nothing composes across.
  const std::string ff = "\xff", surrogate = "\xed\xa0\x80";
  EXPECT_EQ(nfc(ff + "e\u0301\xc3"), ff + "\u00e9\xc3");
  EXPECT_EQ(nfc("e\xff\u0301"), "e\xff\u0301");
  EXPECT_EQ(nfc("\xc0\xaf\u0301\u0316"), "\xc0\xaf\u0316\u0301");  // overlong, then marks
  EXPECT_EQ(nfc(surrogate + "e\u0301"), surrogate + "\u00e9");
  EXPECT_EQ(nfc("e\u0301\xe1\x84"), "\u00e9\xe1\x84");  // truncated at the end
  EXPECT_EQ(nfc("\x80\x80\xcc"), "\x80\x80\xcc");
  std::string out;
  EXPECT_FALSE(to_nfc("\xcc\xcd\xff\xfe", &out));
}

TEST(NfcTest, EditsMapNormalizedOffsetsToTheSource) {
  // "xe\u0301yA\u030a" (8 bytes) -> "x\u00e9y\u00c5" (6 bytes).
  std::string out;
  std::vector<NfcEdit> edits;
  ASSERT_TRUE(to_nfc("xe\u0301yA\u030a", &out, &edits));
  EXPECT_EQ(out, "x\u00e9y\u00c5");
  ASSERT_EQ(edits.size(), 2u);
  EXPECT_EQ(edits[0].source_begin, 1u);
  EXPECT_EQ(edits[0].source_end, 4u);
  EXPECT_EQ(edits[0].begin, 1u);
  EXPECT_EQ(edits[0].end, 3u);
  EXPECT_EQ(nfc_source_begin(edits, 0), 0u);
  EXPECT_EQ(nfc_source_begin(edits, 1), 1u);
  EXPECT_EQ(nfc_source_begin(edits, 2), 1u);  // inside é: its whole source
  EXPECT_EQ(nfc_source_end(edits, 2), 4u);
  EXPECT_EQ(nfc_source_end(edits, 3), 4u);
  EXPECT_EQ(nfc_source_begin(edits, 3), 4u);  // 'y'
  EXPECT_EQ(nfc_source_end(edits, 4), 5u);
  EXPECT_EQ(nfc_source_begin(edits, 4), 5u);  // Å
  EXPECT_EQ(nfc_source_end(edits, 6), 8u);
  EXPECT_EQ(nfc_source_begin({}, 7), 7u);
}

}  // namespace
}  // namespace strata::model
