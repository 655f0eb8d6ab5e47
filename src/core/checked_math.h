// Integer arithmetic that reports overflow instead of wrapping (or, for signed types, being
// undefined behaviour). Used wherever a size or count that came from a file or the command line
// is multiplied or summed: a caller turns an empty result into a Status naming the input, or,
// where earlier validation makes overflow impossible, CHECKs it.
#pragma once

#include <concepts>
#include <optional>

namespace strata {

// a + b, or nullopt when the exact result does not fit in T.
template <std::integral T>
[[nodiscard]] constexpr std::optional<T> checked_add(T a, T b) {
  T out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// a * b, or nullopt when the exact result does not fit in T.
template <std::integral T>
[[nodiscard]] constexpr std::optional<T> checked_mul(T a, T b) {
  T out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// The product of all factors, or nullopt on overflow at any step.
template <std::integral T, std::same_as<T>... Rest>
[[nodiscard]] constexpr std::optional<T> checked_product(T first, Rest... rest) {
  std::optional<T> out = first;
  ((out = out ? checked_mul(*out, rest) : std::nullopt), ...);
  return out;
}

}  // namespace strata
