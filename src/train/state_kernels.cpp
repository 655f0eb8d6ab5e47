#include "train/state_kernels.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "kernels/adamw_simd.h"
#include "kernels/bf16.h"
#include "kernels/fp8.h"
#include "kernels/grad_norm.h"

namespace strata {
namespace {

class CpuStateKernels final : public StateKernels {
 public:
  void zero(float* p, int64_t n) override { std::memset(p, 0, static_cast<size_t>(n) * sizeof(float)); }
  void begin_norm() override { sum_ = 0; }
  void add_sum_squares(std::span<const GradBuffer> tensors) override {
    for (const GradBuffer& t : tensors) sum_ += kernels::cpu::sum_squares(t.p, t.n);
  }
  double end_norm() override { return sum_; }
  void set_norm(double sum) override { sum_ = sum; }
  void prepare_clip(double max_norm) override { clip_ = kernels::clip_coefficient(std::sqrt(sum_), max_norm); }
  void adamw(float* master, float* grad, float* m, float* v, void* bf16_copy, int64_t n, const kernels::AdamWParams& p,
             bool clipped, int64_t tag) override {
    // One pass: the gradients read scaled, the bf16 copy written beside the master.
    static const kernels::SimdLevel simd = kernels::detect_simd_level();
    if (!kernels::adamw_step_f32_clipped(master, grad, clipped ? clip_ : 1.0f, m, v,
                                         static_cast<uint16_t*>(bf16_copy), n, p, simd))
      note_nonfinite(tag);
  }
  void adamw_compact(float* master, float* grad, void* m, void* v, kernels::MomentFormat format, int64_t n,
                     const kernels::AdamWParams& p, const kernels::MomentRounding& rounding, bool clipped,
                     int64_t tag) override {
    if (clipped) kernels::cpu::scale_inplace(grad, n, clip_);
    if (!kernels::cpu::adamw_step_compact(master, grad, m, v, format, n, p, rounding)) note_nonfinite(tag);
  }
  int64_t first_nonfinite() override { return std::exchange(first_nonfinite_, -1); }
  void round_copy(void* bf16_copy, const float* master, int64_t n) override {
    kernels::round_to_bf16(static_cast<uint16_t*>(bf16_copy), master, n);
  }
  void quantize_copy(void* copy, const float* master, int64_t rows, int64_t cols) override {
    kernels::cpu::quantize_weight_e4m3(static_cast<uint8_t*>(copy), master, rows, cols);
  }
  void synchronize() override {}

 private:
  void note_nonfinite(int64_t tag) {
    if (first_nonfinite_ < 0 || tag < first_nonfinite_) first_nonfinite_ = tag;
  }

  double sum_ = 0;
  float clip_ = 1.0f;
  int64_t first_nonfinite_ = -1;
};

}  // namespace

std::unique_ptr<StateKernels> make_cpu_state_kernels() { return std::make_unique<CpuStateKernels>(); }

}  // namespace strata
