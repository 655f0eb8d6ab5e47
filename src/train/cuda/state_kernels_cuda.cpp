// StateKernels on CUDA (train/state_kernels.h): kernels::cuda launches on a stream of their own,
// with their scratch from the device's arena.
#include <cuda_runtime_api.h>

#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/cuda_device.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/ops.h"
#include "train/state_kernels.h"

namespace strata {
namespace {

namespace cu = kernels::cuda;

// Partials of the two-pass reductions: far more than multi_tensor_sum_squares needs.
constexpr uint64_t kScratchBytes = 4ull << 20;
// Non-finite flags, one device int per AdamW call between two reads (first_nonfinite). More
// calls than this in one step read the flags early (one wait) and start again.
constexpr int kFlagSlots = 4096;

class CudaStateKernels final : public StateKernels {
 public:
  CudaStateKernels(std::unique_ptr<Stream> stream, DeviceAllocation scratch, DeviceAllocation norm,
                   DeviceAllocation clip, DeviceAllocation flags)
      : stream_(std::move(stream)),
        handle_(as_cuda_stream(*stream_).handle()),
        scratch_(std::move(scratch)),
        norm_(std::move(norm)),
        clip_(std::move(clip)),
        flags_(std::move(flags)),
        ctx_(scratch_.data(), scratch_.size(), nullptr, 0) {
    CUDA_CHECK(cudaMemsetAsync(flags_.data(), 0, flags_.size(), handle_));
  }
  ~CudaStateKernels() override { synchronize(); }

  void zero(float* p, int64_t n) override {
    CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(n) * sizeof(float), handle_));
  }
  void begin_norm() override { CUDA_CHECK(cudaMemsetAsync(norm_.data(), 0, sizeof(double), handle_)); }
  void add_sum_squares(std::span<const GradBuffer> tensors) override {
    std::vector<cu::NormTensor> table;
    table.reserve(tensors.size());
    for (const GradBuffer& t : tensors) table.push_back({t.p, t.n});
    cu::multi_tensor_sum_squares(ctx_, norm_.as<double>(), table.data(), static_cast<int>(table.size()),
                                 /*accumulate=*/true, handle_);
  }
  double end_norm() override {
    double sum = 0;
    CUDA_CHECK(cudaMemcpyAsync(&sum, norm_.data(), sizeof(double), cudaMemcpyDeviceToHost, handle_));
    synchronize();
    return sum;
  }
  void set_norm(double sum) override {
    CUDA_CHECK(cudaMemcpyAsync(norm_.data(), &sum, sizeof(double), cudaMemcpyHostToDevice, handle_));
    synchronize();  // `sum` lives on this frame
  }
  // The factor stays in device memory: computed from the device's sum, read by AdamW.
  void prepare_clip(double max_norm) override {
    cu::clip_factor(clip_.as<float>(), nullptr, norm_.as<double>(), max_norm, handle_);
  }
  void adamw(float* master, float* grad, float* m, float* v, void* bf16_copy, int64_t n, const kernels::AdamWParams& p,
             bool clipped, int64_t tag) override {
    const cu::AdamWTensor t{master, grad, m, v, static_cast<cu::bf16*>(bf16_copy), n};
    cu::adamw_step(&t, 1, p, clipped ? clip_.as<float>() : nullptr, next_flag(tag), handle_);
  }
  void adamw_compact(float* master, float* grad, void* m, void* v, kernels::MomentFormat format, int64_t n,
                     const kernels::AdamWParams& p, const kernels::MomentRounding& rounding, bool clipped,
                     int64_t tag) override {
    cu::adamw_step_compact(master, grad, m, v, format, n, p, rounding, clipped ? clip_.as<float>() : nullptr,
                           next_flag(tag), handle_);
  }
  int64_t first_nonfinite() override {
    read_flags();
    return std::exchange(first_nonfinite_, -1);
  }
  void round_copy(void* bf16_copy, const float* master, int64_t n) override {
    cu::f32_to_bf16(static_cast<cu::bf16*>(bf16_copy), master, n, handle_);
  }
  void quantize_copy(void* copy, const float* master, int64_t rows, int64_t cols) override {
    cu::quantize_weight_e4m3(static_cast<uint8_t*>(copy), master, rows, cols, handle_);
  }
  void synchronize() override { CUDA_CHECK(cudaStreamSynchronize(handle_)); }

 private:
  // The zeroed flag of the next AdamW call, noted as `tag`'s.
  int* next_flag(int64_t tag) {
    if (tags_.size() == static_cast<size_t>(kFlagSlots)) read_flags();
    tags_.push_back(tag);
    return flags_.as<int>() + (tags_.size() - 1);
  }
  // Waits for the queued calls, notes the smallest tag whose flag is set and zeroes the flags
  // used (on the stream, before any later call).
  void read_flags() {
    if (tags_.empty()) return;
    std::vector<int> set(tags_.size());
    CUDA_CHECK(cudaMemcpyAsync(set.data(), flags_.data(), set.size() * sizeof(int), cudaMemcpyDeviceToHost, handle_));
    synchronize();
    for (size_t i = 0; i < set.size(); ++i)
      if (set[i] != 0 && (first_nonfinite_ < 0 || tags_[i] < first_nonfinite_)) first_nonfinite_ = tags_[i];
    CUDA_CHECK(cudaMemsetAsync(flags_.data(), 0, set.size() * sizeof(int), handle_));
    tags_.clear();
  }

  std::unique_ptr<Stream> stream_;
  cudaStream_t handle_;
  DeviceAllocation scratch_, norm_, clip_, flags_;
  cu::Context ctx_;
  std::vector<int64_t> tags_;  // the tag of each flag in use, in call order
  int64_t first_nonfinite_ = -1;
};

}  // namespace

Result<std::unique_ptr<StateKernels>> make_cuda_state_kernels(Device& device) {
  if (device.kind() != DeviceKind::kCuda)
    return Status::InvalidArgument("CUDA state kernels need a CUDA device, not " + device.name());
  std::unique_ptr<Stream> stream = device.create_stream();
  ASSIGN_OR_RETURN(DeviceAllocation scratch, device.allocate(kScratchBytes));
  ASSIGN_OR_RETURN(DeviceAllocation norm, device.allocate(sizeof(double)));
  ASSIGN_OR_RETURN(DeviceAllocation clip, device.allocate(sizeof(float)));
  ASSIGN_OR_RETURN(DeviceAllocation flags, device.allocate(kFlagSlots * sizeof(int)));
  return std::unique_ptr<StateKernels>(std::make_unique<CudaStateKernels>(
      std::move(stream), std::move(scratch), std::move(norm), std::move(clip), std::move(flags)));
}

}  // namespace strata
