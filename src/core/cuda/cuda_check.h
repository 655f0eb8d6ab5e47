// CUDA_CHECK: CUDA runtime errors are programmer or hardware errors; they abort through
// check_failed (core/check.h), which prints the statement, file, line, device and rank, here
// with the CUDA error name and string added. Usable from .cpp and .cu files (C++17, no fmt).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "core/check.h"

namespace strata {

[[noreturn]] inline void cuda_check_failed(cudaError_t error, const char* expr, const char* file,
                                           int line) {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) current = -1;
  check_failed(expr, file, line,
               std::string(cudaGetErrorName(error)) + " (" + cudaGetErrorString(error) +
                   ") on CUDA device " + std::to_string(current));
}

}  // namespace strata

#define CUDA_CHECK(expr)                                                          \
  do {                                                                            \
    const cudaError_t strata_cuda_error_ = (expr);                                \
    if (strata_cuda_error_ != cudaSuccess) {                                      \
      ::strata::cuda_check_failed(strata_cuda_error_, #expr, __FILE__, __LINE__); \
    }                                                                             \
  } while (0)
