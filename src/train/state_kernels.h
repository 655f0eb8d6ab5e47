// StateKernels: the arithmetic the one optimizer (PagedState) does on training state that sits
// in the device tier — zeroing gradients, the global gradient norm, clipping, AdamW writing the
// master and the bf16 compute copy — done by the backend that owns that memory. On the CPU
// backend "device memory" is host memory and these are the kernels::cpu ops; on CUDA they are
// kernels::cuda launches on a stream of their own. State acquired in host memory always uses
// the CPU's SIMD AdamW. Every implementation applies the same per-element operations (AdamW is
// bitwise the reference on each backend), so where a group is updated never changes the result.
//
// Calls may queue work; synchronize() waits for it, and PagedState calls it before it releases
// what the work touched. Not thread-safe: one caller at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "core/device.h"
#include "core/status.h"
#include "kernels/adamw.h"
#include "kernels/moments.h"

namespace strata {

// n fp32 gradient values at p, in the memory the kernels work on.
struct GradBuffer {
  const float* p;
  int64_t n;
};

class StateKernels {
 public:
  virtual ~StateKernels() = default;
  virtual void zero(float* p, int64_t n) = 0;
  // The sum of squares over the tensors passed to add_sum_squares() since begin_norm(), in the
  // order they were passed (each backend's order is fixed, so the norm is reproducible; CUDA
  // sums each call's tensors in one launch). end_norm() reads the sum on the host.
  virtual void begin_norm() = 0;
  virtual void add_sum_squares(std::span<const GradBuffer> tensors) = 0;
  virtual double end_norm() = 0;
  // Replaces the sum end_norm() read by `sum` (data-parallel ranks each sum the squares of the
  // groups they own, then all take the total), so that prepare_clip() clips by the global norm.
  virtual void set_norm(double sum) = 0;
  // After end_norm(): the clip factor of that sum, kernels::clip_coefficient(sqrt(sum),
  // max_norm), kept where this backend's AdamW reads it. CUDA computes it in device memory from
  // the device's own sum (bit for bit the host's coefficient), so nothing is sent to the device.
  virtual void prepare_clip(double max_norm) = 0;
  // AdamW on the fp32 master; when bf16_copy is not null, writes the updated master there
  // rounded to bf16 (nearest even). With `clipped`, every gradient is first multiplied by the
  // prepared clip factor (one fp32 rounding, as kernels::cpu::scale_inplace rounds), applied
  // as grad is read; the buffer is left alone. The update is bitwise that of scaling the
  // gradients, then AdamW. `tag` (>= 0) is
  // the caller's name for the tensor, reported by first_nonfinite().
  virtual void adamw(float* master, float* grad, float* m, float* v, void* bf16_copy, int64_t n,
                     const kernels::AdamWParams& p, bool clipped, int64_t tag) = 0;
  // AdamW on the fp32 master with moments stored compactly (kernels/moments.h: bf16 or int8),
  // updated in place; the compute copy is written apart (round_copy / quantize_copy).
  // `clipped` and `tag` as for adamw().
  virtual void adamw_compact(float* master, float* grad, void* m, void* v, kernels::MomentFormat format, int64_t n,
                             const kernels::AdamWParams& p, const kernels::MomentRounding& rounding, bool clipped,
                             int64_t tag) = 0;
  // The finiteness of what AdamW wrote, checked by the kernels in the pass that writes it (finite
  // gradients do not prove it: eps = 0 divides 0 by 0 where a gradient is 0). Returns the
  // smallest tag of the adamw() and adamw_compact() calls since the last first_nonfinite() that
  // wrote a NaN or Inf master value, or -1 when every value was finite, and forgets them. CUDA
  // reads its flags here, after the queued work: call it where the caller waits anyway.
  virtual int64_t first_nonfinite() = 0;
  // The bf16 compute copy of n master values (nearest even).
  virtual void round_copy(void* bf16_copy, const float* master, int64_t n) = 0;
  // The fp8 recipe's compute copy of a (rows, cols) master matrix: E4M3 blocks (kernels/fp8.h).
  virtual void quantize_copy(void* copy, const float* master, int64_t rows, int64_t cols) = 0;
  virtual void synchronize() = 0;
};

// The CPU's: plain loops and the kernels::cpu ops, in the calling thread.
std::unique_ptr<StateKernels> make_cpu_state_kernels();
// The CUDA backend's, on `device` (a CUDA device; defined only in builds with CUDA): its own
// stream and a small scratch from the device's arena.
Result<std::unique_ptr<StateKernels>> make_cuda_state_kernels(Device& device);

}  // namespace strata
