// Shared by the fuzz targets: a scratch directory for entry points that take a path, and
// quiet logging (a parser's warnings would drown libFuzzer's status lines).
#pragma once

#include <spdlog/spdlog.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace strata::fuzz {

// One directory per fuzzing process, made on first use and left for the OS to clean (libFuzzer
// ends the process with _exit, so no destructor would run). Several jobs may fuzz at once.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const char* base = getenv("TMPDIR");
    std::string pattern = std::string(base && *base ? base : "/tmp") + "/strata-fuzz-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) {
      perror("strata fuzz: mkdtemp");
      abort();
    }
    spdlog::set_level(spdlog::level::off);
    return pattern;
  }();
  return dir;
}

// Replaces `name` in the scratch directory with `bytes`; returns its path. A failure here is
// the harness's, not the parser's, so it aborts loudly.
inline std::string write_scratch(const std::string& name, std::string_view bytes) {
  const std::string path = scratch_dir() + "/" + name;
  FILE* f = fopen(path.c_str(), "wb");
  if (f == nullptr || fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() || fclose(f) != 0) {
    perror(("strata fuzz: writing " + path).c_str());
    abort();
  }
  return path;
}

inline std::string_view as_view(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace strata::fuzz
