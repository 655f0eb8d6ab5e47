// CUBLAS_CHECK: a failed cuBLAS or cuBLASLt call (bad shapes, a type combination the library
// does not support) is a programmer error; it aborts through check_failed (core/check.h) with
// the status name and string added. Usable from .cpp and .cu files (C++17, no fmt).
#pragma once

#include <cublasLt.h>

#include <string>

#include "core/check.h"

#define CUBLAS_CHECK(expr)                                                                                         \
  do {                                                                                                             \
    const cublasStatus_t strata_cublas_status_ = (expr);                                                           \
    if (strata_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                                          \
      ::strata::check_failed(#expr, __FILE__, __LINE__,                                                            \
                             std::string("cuBLAS status ") + cublasLtGetStatusName(strata_cublas_status_) + " (" + \
                                 cublasLtGetStatusString(strata_cublas_status_) + ")");                            \
    }                                                                                                              \
  } while (0)
