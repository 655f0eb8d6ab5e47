// FlatAccess: a ParamAccess over flat buffers of the whole layout that the caller owns, for
// runs whose state fits in memory once (the tests' references, the benchmarks): no paging, every
// group always addressable, begin() and end() do nothing. The decoder owns no state; a caller
// that wants flat buffers allocates them and hands the model this access over them.
//
// Not thread-safe; does not own the buffers, which must outlive its use.
#pragma once

#include <cstdint>
#include <string>

#include "core/check.h"
#include "core/dtype.h"
#include "core/status.h"
#include "model/param_access.h"

namespace strata::model {

class FlatAccess final : public ParamAccess {
 public:
  // params: (ParamLayout::total_size()) the compute copy the model's backend reads, of
  // param_dtype elements: kF32 (the fp32 master itself on the CPU reference) or kBF16 (the bf16
  // recipe's copy; the fp8 recipe's E4M3 blocks have no flat layout). grads: (total_size) fp32,
  // accumulated by backward; null for a model that only runs forward (generation, evaluation).
  FlatAccess(DType param_dtype, const void* params, float* grads)
      : dtype_(param_dtype), params_(static_cast<const char*>(params)), grads_(grads) {
    CHECK_MSG(param_dtype == DType::kF32 || param_dtype == DType::kBF16,
              std::string("flat parameters are fp32 or bf16, not ") + dtype_name(param_dtype));
    CHECK(params != nullptr);
  }

  Status begin(int group, bool params, bool grads) override {
    (void)group, (void)params, (void)grads;
    return Status::OK();
  }
  void end(int group, bool params, bool grads) override { (void)group, (void)params, (void)grads; }
  const void* param(int64_t offset) override { return params_ + offset * static_cast<int64_t>(dtype_size(dtype_)); }
  float* grad(int64_t offset) override {
    CHECK_MSG(grads_ != nullptr, "this FlatAccess has no gradients (made for forward only)");
    return grads_ + offset;
  }
  DType param_dtype() const override { return dtype_; }

 private:
  DType dtype_;
  const char* params_;
  float* grads_;
};

}  // namespace strata::model
