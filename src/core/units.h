// Byte quantities as people write them in configs and read them in messages, and numbers
// printed back to people.
// Pure functions; safe for concurrent use.
#pragma once

#include <cstdint>
#include <string>

#include "core/round_up.h"
#include "core/status.h"

namespace strata {

inline constexpr uint64_t kKiB = uint64_t{1} << 10;
inline constexpr uint64_t kMiB = uint64_t{1} << 20;
inline constexpr uint64_t kGiB = uint64_t{1} << 30;
inline constexpr uint64_t kTiB = uint64_t{1} << 40;

// Binary units with two decimals: 512 -> "512 B", 1536 -> "1.50 KiB", 3 << 30 -> "3.00 GiB".
std::string format_bytes(uint64_t bytes);

// Parses "24GiB", "512 MiB", "100GB", "1.5G", "4096". Units are case-insensitive:
// B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB and K/M/G/T (powers of 1024).
// Fractions need a unit other than B ("1.5G"); the result is rounded down to whole bytes.
// Returns InvalidArgument naming the text for anything else, including overflow.
Result<uint64_t> parse_bytes(const std::string& text);

// The shortest text that reads back as exactly `value` (std::to_chars): 3e-3 -> "0.003",
// 1e-8 -> "1e-08", 2.0 -> "2", 0.1 -> "0.1"; "inf", "-inf", "nan".
std::string format_shortest(double value);

}  // namespace strata
