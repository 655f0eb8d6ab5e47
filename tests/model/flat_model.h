// FlatModel<Net>: a CPU decoder (model::LlamaModel, the fp32 reference, or model::LlamaModelBf16,
// the GPU's bf16 recipe) over flat buffers the test owns, read through a model::FlatAccess: the
// fp32 master parameters, the compute copy the ops read (the master itself in fp32, rounded to
// bf16 from it otherwise) and the fp32 gradients, each of layout().total_size() elements. The
// tests' stand-in for a training state without paging; the decoder itself owns none.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/status.h"
#include "kernels/bf16.h"
#include "model/decoder.h"
#include "model/flat_access.h"
#include "model/hf_io.h"
#include "model/params.h"

namespace strata::model {

template <class Net>
class FlatModel {
 public:
  using OpSet = typename Net::OpSet;
  using W = typename Net::W;

  // Parameters and gradients start at zero; call init_weights or load_safetensors.
  explicit FlatModel(const ModelConfig& config, OpSet ops = OpSet())
      : net_(config, std::move(ops)),
        master_(size(), 0.0f),
        compute_(std::is_same_v<W, float> ? 0 : size()),
        grads_(size(), 0.0f),
        access_(OpSet::kWeightDType, compute_data(), grads_.data()) {
    net_.set_access(&access_);
  }
  ~FlatModel() { net_.set_access(nullptr); }
  FlatModel(const FlatModel&) = delete;
  FlatModel& operator=(const FlatModel&) = delete;

  Net& net() { return net_; }
  const Net& net() const { return net_; }
  const ModelConfig& config() const { return net_.config(); }
  const ParamLayout& layout() const { return net_.layout(); }

  // The fp32 master (call sync_compute_copy() after changing it) and the gradients.
  float* params() { return master_.data(); }
  const float* params() const { return master_.data(); }
  float* grads() { return grads_.data(); }
  const float* grads() const { return grads_.data(); }

  void init_weights(uint64_t seed) {
    model::init_weights(layout(), master_.data(), seed);
    sync_compute_copy();
  }
  // Every parameter by Hugging Face name from a safetensors file, index or directory; on error
  // the parameters are unchanged.
  Status load_safetensors(const std::string& path) {
    std::vector<float> loaded(size(), 0.0f);
    RETURN_IF_ERROR(load_hf_weights(path, layout(), loaded.data()));
    if (config().router_selection_bias) {
      ASSIGN_OR_RETURN(SafetensorsReader reader, SafetensorsReader::open(path));
      RETURN_IF_ERROR(read_hf_selection_bias(reader, config(), &net_.mutable_expert_selection_bias()));
    }
    std::copy(loaded.begin(), loaded.end(), master_.begin());
    sync_compute_copy();
    return Status::OK();
  }
  // Rounds the master into the compute copy (nothing to do in fp32: the ops read the master).
  void sync_compute_copy() {
    if constexpr (!std::is_same_v<W, float>) {
      static_assert(sizeof(W) == sizeof(uint16_t), "a bf16 compute copy");
      kernels::round_to_bf16(reinterpret_cast<uint16_t*>(compute_.data()), master_.data(),
                             static_cast<int64_t>(master_.size()));
    }
  }
  // What an optimizer step starts from: zero gradients and expert token counts.
  void zero_grads() {
    std::fill(grads_.begin(), grads_.end(), 0.0f);
    net_.reset_expert_token_counts();
  }

  double forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T, float grad_scale) {
    return net_.forward_backward(inputs, targets, B, T, grad_scale);
  }
  double forward_loss(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T) {
    return net_.forward_loss(inputs, targets, B, T);
  }
  Result<double> compute(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T, float grad_scale,
                         bool backward, const int32_t* positions = nullptr) {
    return net_.compute(inputs, targets, B, T, grad_scale, backward, positions);
  }
  int64_t activation_bytes() const { return net_.activation_bytes(); }

 private:
  size_t size() const { return static_cast<size_t>(net_.layout().total_size()); }
  const void* compute_data() const {
    if constexpr (std::is_same_v<W, float>) return master_.data();
    else return compute_.data();
  }

  // Declared in this order: each is made from the ones before it.
  Net net_;
  std::vector<float> master_;  // (total_size)
  std::vector<W> compute_;     // (total_size) the bf16 compute copy; empty in fp32
  std::vector<float> grads_;   // (total_size)
  FlatAccess access_;
};

}  // namespace strata::model
