// Helpers shared by the test binaries: deterministic random data, NaN-safe comparisons, reading
// files and central finite differences.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <vector>

namespace strata::testing {

inline std::vector<float> random_vector(int64_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

// ||a - b|| / max(||b||, tiny). Returns +inf when either side holds a NaN or Inf, so that
// `if (!(err <= tol))` style checks fail on them.
inline double relative_error(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}
inline double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return relative_error(a.data(), b.data(), static_cast<int64_t>(std::min(a.size(), b.size())));
}

// Max |a - b| / (atol + rtol * |b|) over elements; <= 1 means every element is within tolerance.
inline double max_scaled_error(const float* a, const float* b, int64_t n, double atol, double rtol) {
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    double e = std::fabs(double(a[i]) - double(b[i])) / (atol + rtol * std::fabs(double(b[i])));
    worst = std::max(worst, e);
  }
  return worst;
}

// An empty folder for the running test: TempDir()/PREFIX_TESTNAME_PID, the '/' of a
// parameterized test's name made '_'. ctest runs each test in a process of its own, so tests
// running side by side never share one.
inline std::filesystem::path fresh_test_dir(const std::string& prefix) {
  std::string name = prefix + "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "_" +
                     std::to_string(::getpid());
  std::replace(name.begin(), name.end(), '/', '_');
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// A file's bytes; "" when it cannot be read.
inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A JSON file, parsed; a discarded value, and a failed expectation naming the file, when it
// cannot be read or parsed.
inline nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << "cannot read or parse " << path;
  return j;
}

#define EXPECT_WITHIN(err, tol) \
  EXPECT_TRUE((err) <= (tol)) << #err " = " << (err) << " exceeds " << (tol)

// Central finite difference of a scalar function f with respect to x[i] (f reads x).
inline double finite_difference(const std::function<double()>& f, float* x, double h) {
  float saved = *x;
  *x = static_cast<float>(saved + h);
  double fp = f();
  *x = static_cast<float>(saved - h);
  double fm = f();
  *x = saved;
  return (fp - fm) / (2 * h);
}

}  // namespace strata::testing
