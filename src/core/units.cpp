#include "core/units.h"

#include <cctype>
#include <charconv>
#include <cstdio>

namespace strata {
namespace {

struct Unit {
  const char* name;  // lower case
  uint64_t scale;
};

constexpr Unit kUnits[] = {
    {"", 1},
    {"b", 1},
    {"kb", 1000ull},
    {"mb", 1000ull * 1000},
    {"gb", 1000ull * 1000 * 1000},
    {"tb", 1000ull * 1000 * 1000 * 1000},
    {"k", kKiB},
    {"m", kMiB},
    {"g", kGiB},
    {"t", kTiB},
    {"kib", kKiB},
    {"mib", kMiB},
    {"gib", kGiB},
    {"tib", kTiB},
};

Status bad_bytes(const std::string& text, const std::string& why) {
  return Status::InvalidArgument("cannot read '" + text + "' as a byte count (" + why +
                                 "); write e.g. 4096, 512MiB, 24GiB, 1.5G or 100GB");
}

}  // namespace

std::string format_bytes(uint64_t bytes) {
  static constexpr const char* kNames[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < kKiB) return std::to_string(bytes) + " B";
  double value = static_cast<double>(bytes) / static_cast<double>(kKiB);
  int unit = 0;
  // Moving up at 1023.995 keeps "%.2f" from printing "1024.00 KiB".
  while (value >= 1023.995 && unit + 1 < static_cast<int>(std::size(kNames))) {
    value /= 1024.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f %s", value, kNames[unit]);
  return buf;
}

Result<uint64_t> parse_bytes(const std::string& text) {
  size_t i = 0;
  const size_t n = text.size();
  while (i < n && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  // Digits, with at most one decimal point.
  const size_t number_begin = i;
  uint64_t whole = 0;
  bool whole_overflow = false;
  while (i < n && std::isdigit(static_cast<unsigned char>(text[i]))) {
    const uint64_t digit = static_cast<uint64_t>(text[i] - '0');
    if (whole > (UINT64_MAX - digit) / 10) whole_overflow = true;
    whole = whole * 10 + digit;
    ++i;
  }
  const size_t whole_digits = i - number_begin;
  std::string fraction;
  if (i < n && text[i] == '.') {
    ++i;
    while (i < n && std::isdigit(static_cast<unsigned char>(text[i]))) fraction += text[i++];
    if (fraction.empty()) return bad_bytes(text, "a decimal point needs digits after it");
  }
  if (whole_digits == 0 && fraction.empty()) return bad_bytes(text, "no number");
  if (whole_overflow) return bad_bytes(text, "too large");
  while (i < n && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit;
  while (i < n && std::isalpha(static_cast<unsigned char>(text[i]))) {
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
    ++i;
  }
  while (i < n && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i != n) return bad_bytes(text, "unexpected '" + text.substr(i) + "'");

  uint64_t scale = 0;
  for (const Unit& u : kUnits) {
    if (unit == u.name) scale = u.scale;
  }
  if (scale == 0) return bad_bytes(text, "unknown unit '" + unit + "'");
  if (!fraction.empty() && scale == 1) {
    return bad_bytes(text, "a fraction of a byte");
  }
  if (whole > UINT64_MAX / scale) return bad_bytes(text, "too large");
  uint64_t bytes = whole * scale;
  if (!fraction.empty()) {
    // Exact integer arithmetic, so "0.1GB" is 100000000 and not one byte short.
    if (fraction.size() > 18) return bad_bytes(text, "more than 18 decimals");
    unsigned __int128 numerator = 0;
    unsigned __int128 denominator = 1;
    for (char c : fraction) {
      numerator = numerator * 10 + static_cast<unsigned>(c - '0');
      denominator *= 10;
    }
    const auto extra = static_cast<uint64_t>(numerator * scale / denominator);
    if (bytes > UINT64_MAX - extra) return bad_bytes(text, "too large");
    bytes += extra;
  }
  return bytes;
}

std::string format_shortest(double value) {
  char text[32];  // the longest shortest double, "-2.2250738585072014e-308", is 24 characters
  const std::to_chars_result r = std::to_chars(text, text + sizeof text, value);
  return std::string(text, r.ptr);
}

}  // namespace strata
