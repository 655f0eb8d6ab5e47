// Messages of the cuBLASLt GEMMs (gemm_plan.h).
#include "kernels/gemm_plan.h"

namespace strata::kernels {

std::string describe(const GemmDescription& g) {
  const std::string m = std::to_string(g.M), n = std::to_string(g.N), k = std::to_string(g.K);
  return "C (" + m + " x " + n + ", " + g.c_type + ") = A" + (g.trans_a ? "^T" : "") + " (" + m +
         " x " + k + ", " + g.a_type + ") @ B" + (g.trans_b ? "^T" : "") + " (" + k + " x " + n + ", " + g.b_type +
         "); M=" + m + ", N=" + n + ", K=" + k + ", trans_a=" + (g.trans_a ? "yes" : "no") +
         ", trans_b=" + (g.trans_b ? "yes" : "no") + ", epilogue " + g.epilogue + ", " + g.accumulate;
}

std::string gemm_heuristic_failure_message(const GemmDescription& gemm, const std::string& status_name,
                                           const std::string& status_text, int found) {
  return "cuBLASLt found no algorithm (heuristic status " + status_name + ": " + status_text + "; " +
         std::to_string(found) + " algorithms returned) for the GEMM " + describe(gemm);
}

}  // namespace strata::kernels
