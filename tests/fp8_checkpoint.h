// An FP8 checkpoint as DeepSeek-V3's are stored, for tests: every linear weight of a layout in
// F8_E4M3 with NAME_scale_inv (fp32 block scales), the other tensors in F32, one file per tensor
// with a model.safetensors.index.json.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/hf_io.h"
#include "model/param_access.h"
#include "model/params.h"
#include "model/safetensors.h"

namespace strata::model {

struct Written {
  std::vector<uint8_t> bytes;  // the E4M3 codes, row-major
  std::vector<float> scales;   // (ceil(rows/128), ceil(cols/128))
  std::vector<float> values;   // an fp32 tensor's values
};

// One file per tensor, with an index: the linear weights in F8_E4M3 with block scales (of
// `scale_shape(t)`), the rest in F32.
inline std::map<std::string, Written> write_checkpoint(const std::filesystem::path& dir, const ParamLayout& layout,
                                                const std::function<std::vector<int64_t>(const TensorSpec&)>& scale_shape) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::mt19937 rng(17);
  nlohmann::json weight_map = nlohmann::json::object();
  std::map<std::string, Written> out;
  int k = 0;
  auto write = [&](const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape,
                   const void* data, uint64_t bytes) {
    const std::string header =
        nlohmann::json{{name, {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {0, bytes}}}}}.dump();
    const std::string file = "part-" + std::to_string(k++) + ".safetensors";
    std::ofstream f(dir / file, std::ios::binary);
    for (int i = 0; i < 8; ++i) f.put(static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i)));
    f << header;
    f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    weight_map[name] = file;
  };
  for (const TensorSpec& t : layout.tensors()) {
    Written w;
    if (param_is_linear_weight(layout, t)) {
      w.bytes.resize(static_cast<size_t>(t.numel));
      for (uint8_t& b : w.bytes) {
        do b = static_cast<uint8_t>(rng() & 0xff); while ((b & 0x7f) == 0x7f);  // no NaN codes
      }
      const std::vector<int64_t> s = scale_shape(t);
      w.scales.resize(static_cast<size_t>(s[0] * s[1]));
      std::uniform_real_distribution<float> scale(1e-4f, 1e-2f);
      for (float& v : w.scales) v = scale(rng);
      write(t.name, "F8_E4M3", t.shape, w.bytes.data(), w.bytes.size());
      write(block_scale_name(t.name), "F32", s, w.scales.data(), w.scales.size() * sizeof(float));
    } else {
      w.values.resize(static_cast<size_t>(t.numel));
      std::normal_distribution<float> normal(0.0f, 0.5f);
      for (float& v : w.values) v = normal(rng);
      write(t.name, "F32", t.shape, w.values.data(), w.values.size() * sizeof(float));
    }
    out[t.name] = std::move(w);
  }
  std::ofstream(dir / kSafetensorsIndexName) << nlohmann::json{{"weight_map", weight_map}}.dump();
  return out;
}

// One scale per 128 x 128 block, as published.
inline std::vector<int64_t> block_grid(const TensorSpec& t) {
  return {(t.shape[0] + 127) / 128, (t.shape[1] + 127) / 128};
}

}  // namespace strata::model
