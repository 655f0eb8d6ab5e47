// Rounding a size up to a multiple. Kept free of other headers and of C++20 so that CUDA files,
// which nvcc compiles as C++17, share it with the rest.
#pragma once

#include <type_traits>

namespace strata {

// x rounded up to a multiple of m (m > 0; x + m - 1 must fit in T). m takes x's type.
template <typename T>
constexpr T round_up(T x, typename std::enable_if<std::is_integral<T>::value, T>::type m) {
  return (x + m - 1) / m * m;
}

}  // namespace strata
