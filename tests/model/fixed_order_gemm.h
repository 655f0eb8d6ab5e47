// FixedOrderGemm: the fixed-order GEMM (kernels/linear.h) for a scope, the setting before it
// restored after. Tests whose claims are bitwise use it: its sums do not depend on the number
// of rows or on the CPU model.
#pragma once

#include "kernels/linear.h"

namespace strata::model {

class FixedOrderGemm {
 public:
  explicit FixedOrderGemm(bool on = true) : before_(kernels::fixed_order_gemm()) { kernels::set_fixed_order_gemm(on); }
  ~FixedOrderGemm() { kernels::set_fixed_order_gemm(before_); }
  FixedOrderGemm(const FixedOrderGemm&) = delete;
  FixedOrderGemm& operator=(const FixedOrderGemm&) = delete;

 private:
  bool before_;
};

}  // namespace strata::model
