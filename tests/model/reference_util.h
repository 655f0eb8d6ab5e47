// Running a PyTorch reference script from a parity test, and comparing its scalars.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace strata::model {

inline constexpr const char* kReferencePython = "/usr/bin/python3";

// |a - b| / |b|; +inf when either is not finite, so `!(err <= tol)` checks fail on NaN.
inline double relative(double a, double b) {
  if (!std::isfinite(a) || !std::isfinite(b)) return INFINITY;
  return std::fabs(a - b) / std::max(std::fabs(b), 1e-30);
}

// True when the reference interpreter can import `module` (e.g. "torch", "transformers").
inline bool python_can_import(const std::string& module) {
  const std::string cmd = std::string(kReferencePython) + " -c 'import " + module + "' >/dev/null 2>&1";
  return std::filesystem::exists(kReferencePython) && std::system(cmd.c_str()) == 0;
}

// True when tests/model/SCRIPT probe exits 0 (the script can run its reference here).
inline bool reference_script_runs(const std::string& script) {
  const std::string cmd = std::string(kReferencePython) + " " + STRATA_SOURCE_DIR + "/tests/model/" + script +
                          " probe >/dev/null 2>&1";
  return std::filesystem::exists(kReferencePython) && std::system(cmd.c_str()) == 0;
}

// Runs tests/model/SCRIPT OUT VARIANT with OUT = BUILD/tests/OUT_NAME; returns OUT/VARIANT.
inline std::string run_reference(const std::string& script, const std::string& out_name, const std::string& variant) {
  namespace fs = std::filesystem;
  const fs::path out = fs::path(STRATA_BINARY_DIR) / "tests" / out_name;
  fs::create_directories(out);
  const std::string path = std::string(STRATA_SOURCE_DIR) + "/tests/model/" + script;
  const std::string log = (out / (variant + ".log")).string();
  const std::string cmd =
      std::string(kReferencePython) + " " + path + " " + out.string() + " " + variant + " >" + log + " 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << "reference script failed; see " << log;
  return (out / variant).string();
}

// The reference's rows of token ids (reference.json's "inputs" / "targets"), flattened.
inline std::vector<int32_t> flatten(const nlohmann::json& rows) {
  std::vector<int32_t> out;
  for (const auto& row : rows)
    for (const auto& tok : row) out.push_back(tok.get<int32_t>());
  return out;
}

// A file of float32 values (grads.bin, params_after.bin).
inline std::vector<float> read_floats(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<float> out;
  for (float v; in.read(reinterpret_cast<char*>(&v), sizeof(v));) out.push_back(v);
  return out;
}

}  // namespace strata::model
