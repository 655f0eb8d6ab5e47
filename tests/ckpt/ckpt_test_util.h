// Helpers for the checkpoint tests: a scratch directory per test, aligned host regions and a
// small training state (parameters, Adam m and v) laid out the way the trainer lays it out.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ckpt/reader.h"
#include "ckpt/writer.h"
#include "core/io_engine.h"
#include "test_util.h"

namespace strata::ckpt::testing {

namespace fs = std::filesystem;

// A 4 KiB-aligned host buffer; `misalign` shifts the start by that many bytes.
class HostBuffer {
 public:
  explicit HostBuffer(uint64_t size, uint64_t misalign = 0)
      : base_(static_cast<char*>(std::aligned_alloc(4096, (size + misalign + 4095) / 4096 * 4096 + 4096))),
        data_(base_ + misalign),
        size_(size) {}
  ~HostBuffer() { std::free(base_); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  char* data() { return data_; }
  const char* data() const { return data_; }
  float* f32() { return reinterpret_cast<float*>(data_); }
  uint64_t size() const { return size_; }

 private:
  char* base_;
  char* data_;
  uint64_t size_;
};

// Parameters, Adam m and Adam v of a toy model, each one region. Tensor sizes are chosen so
// that runs start at unaligned file offsets too (exercising staging), with a gap in m.
struct TrainState {
  std::vector<std::unique_ptr<HostBuffer>> buffers;
  std::vector<Region> regions;

  explicit TrainState(uint64_t scale = 1, uint64_t misalign = 0) {
    // name, elements
    const std::vector<std::pair<std::string, int64_t>> params = {
        {"model.embed_tokens.weight", int64_t(64 * 1024 * scale)},
        {"model.layers.0.input_layernorm.weight", 333},
        {"model.layers.0.self_attn.q_proj.weight", int64_t(128 * 96 * scale)},
        {"model.layers.0.mlp.down_proj.weight", int64_t(96 * 160 * scale + 7)},
        {"model.norm.weight", 96},
        {"lm_head.weight", int64_t(32 * 1024 * scale)}};
    for (TensorKind kind : {TensorKind::kParam, TensorKind::kAdamM, TensorKind::kAdamV}) {
      Region r;
      r.kind = kind;
      uint64_t off = 0;
      for (const auto& [name, n] : params) {
        r.tensors.push_back(RegionTensor{name, {n}, DType::kF32, off});
        off += uint64_t(n) * 4;
        if (kind == TensorKind::kAdamM) off += 256;  // a gap between tensors
      }
      buffers.push_back(std::make_unique<HostBuffer>(off, kind == TensorKind::kAdamV ? misalign : 0));
      r.data = buffers.back()->data();
      r.size = off;
      regions.push_back(std::move(r));
    }
    fill(1);
  }
  void fill(uint64_t seed) {
    for (auto& b : buffers) {
      std::mt19937 rng(static_cast<uint32_t>(seed++));
      std::uniform_real_distribution<float> dist(-1.f, 1.f);
      float* f = b->f32();
      for (uint64_t i = 0; i < b->size() / 4; ++i) f[i] = dist(rng);
    }
  }
  // Copies of every region's bytes, for comparisons after the regions change.
  std::vector<std::vector<char>> snapshot() const {
    std::vector<std::vector<char>> out;
    for (const auto& b : buffers) out.emplace_back(b->data(), b->data() + b->size());
    return out;
  }
  SaveRequest request(const std::string& dir, int64_t step) const {
    SaveRequest r;
    r.dir = dir;
    r.step = step;
    r.regions = regions;
    r.manifest.strata_version = "test";
    r.manifest.tokens_seen = uint64_t(step) * 4096;
    r.manifest.data_cursor = {1, step * 8};
    r.manifest.optimizer_step = step;
    r.manifest.rng = {{"data", "0123456789abcdef"}, {"dropout", 42}};
    r.manifest.lr_schedule = {{"kind", "cosine"}, {"step", step}};
    r.manifest.model_config = {{"model_type", "llama"}, {"hidden_size", 96}, {"num_hidden_layers", 1}};
    return r;
  }
};

// Every tensor of `state` equals, byte for byte, the checkpoint's copy; `expected` holds the
// region bytes to compare with (default: the regions as they are now).
inline void expect_checkpoint_equals(const CheckpointReader& reader, const TrainState& state,
                                     const std::vector<std::vector<char>>& expected) {
  size_t count = 0;
  for (size_t r = 0; r < state.regions.size(); ++r) {
    for (const RegionTensor& t : state.regions[r].tensors) {
      const std::string q = qualified_name(state.regions[r].kind, t.name);
      const SavedTensor* saved = reader.find(q);
      ASSERT_NE(saved, nullptr) << q;
      EXPECT_EQ(saved->shape, t.shape) << q;
      std::vector<char> got(saved->nbytes);
      ASSERT_TRUE(reader.read_raw(q, got.data(), got.size()).ok()) << q;
      ASSERT_EQ(0, std::memcmp(got.data(), expected[r].data() + t.offset, got.size())) << "tensor " << q << " differs";
      ++count;
    }
  }
  EXPECT_EQ(count, reader.tensors().size());
}

using strata::testing::read_text;

class CkptTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("strata_ckpt_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir() const { return dir_.string(); }
  fs::path dir_;
};

// The engine kinds a round trip runs on; io_uring is skipped where the kernel refuses it.
inline IoEngineFactory engine_of_kind(const std::string& kind) {
  return [kind]() {
    IoEngineOptions o;
    o.kind = kind;
    return make_io_engine(o);
  };
}

}  // namespace strata::ckpt::testing
