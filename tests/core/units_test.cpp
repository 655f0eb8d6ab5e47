#include "core/units.h"

#include <gtest/gtest.h>

#include <cstdlib>

namespace strata {
namespace {

TEST(FormatBytes, PicksTheLargestBinaryUnitWithTwoDecimals) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(512 * kMiB), "512.00 MiB");
  EXPECT_EQ(format_bytes(3 * kGiB / 2), "1.50 GiB");
  EXPECT_EQ(format_bytes(24 * kGiB), "24.00 GiB");
  EXPECT_EQ(format_bytes(2 * kTiB), "2.00 TiB");
  // Just under a unit must not print as "1024.00 MiB".
  EXPECT_EQ(format_bytes(kGiB - 1), "1.00 GiB");
}

TEST(ParseBytes, ReadsBinaryAndDecimalUnitsCaseInsensitively) {
  struct Case {
    const char* text;
    uint64_t bytes;
  };
  const Case cases[] = {
      {"4096", 4096},
      {"0", 0},
      {"24GiB", 24 * kGiB},
      {"24gib", 24 * kGiB},
      {"512MiB", 512 * kMiB},
      {"512 MiB", 512 * kMiB},
      {"100GB", 100'000'000'000ull},
      {"100gb", 100'000'000'000ull},
      {"1.5G", 3 * kGiB / 2},
      {"1.5g", 3 * kGiB / 2},
      {"2K", 2048},
      {"3M", 3 * kMiB},
      {"1T", kTiB},
      {"1TiB", kTiB},
      {"1TB", 1'000'000'000'000ull},
      {"7KB", 7000},
      {"7kib", 7 * kKiB},
      {"12B", 12},
      {"12 b", 12},
      {"0.1GB", 100'000'000},
      {".5KiB", 512},
      {"  8MiB  ", 8 * kMiB},
  };
  for (const Case& c : cases) {
    Result<uint64_t> r = parse_bytes(c.text);
    ASSERT_TRUE(r.ok()) << c.text << ": " << r.status().to_string();
    EXPECT_EQ(r.value(), c.bytes) << c.text;
  }
}

TEST(ParseBytes, RejectsMalformedTextWithAMessageNamingIt) {
  for (const char* text : {"", "GiB", "12 apples", "1.5", "1.5B", "-3G", "1..5G", "1.G", "1e9",
                           "12GiB extra", "99999999999999999999", "20000000TiB", "0x10"}) {
    Result<uint64_t> r = parse_bytes(text);
    ASSERT_FALSE(r.ok()) << "'" << text << "' parsed as " << r.value();
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find("'" + std::string(text) + "'"), std::string::npos)
        << r.status().message();
  }
}

TEST(ParseBytes, RoundTripsFormattedWholeUnits) {
  for (uint64_t v : {kKiB, 3 * kMiB, 24 * kGiB, 5 * kTiB}) {
    std::string text = format_bytes(v);
    text.erase(text.find(' '), 1);
    Result<uint64_t> r = parse_bytes(text);
    ASSERT_TRUE(r.ok()) << text;
    EXPECT_EQ(r.value(), v) << text;
  }
}

TEST(FormatShortest, PrintsTheShortestTextThatReadsBackExactly) {
  EXPECT_EQ(format_shortest(3e-3), "0.003");  // not 0.0030000000000000001
  EXPECT_EQ(format_shortest(0.1), "0.1");
  EXPECT_EQ(format_shortest(1e-8), "1e-08");
  EXPECT_EQ(format_shortest(2.0), "2");
  EXPECT_EQ(format_shortest(-0.95), "-0.95");
  EXPECT_EQ(format_shortest(1.0 / 3.0), "0.3333333333333333");
  for (double v : {3e-3, 0.1, 1.0 / 3.0, 6.02214076e23, 5e-324, -2.2250738585072014e-308}) {
    EXPECT_EQ(std::strtod(format_shortest(v).c_str(), nullptr), v) << format_shortest(v);
  }
}

}  // namespace
}  // namespace strata
