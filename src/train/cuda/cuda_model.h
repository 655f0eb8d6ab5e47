// The CUDA model (model::CudaLlama) as a ResidentModel for the trainer's ResidentEngine.
// Declared in every build; defined only in builds with the CUDA backend (STRATA_HAVE_CUDA).
#pragma once

#include <cstdint>
#include <memory>

#include "core/status.h"
#include "model/config.h"
#include "train/optimizer.h"
#include "train/resident_engine.h"

namespace strata {

struct CudaModelOptions {
  int device = 0;
  int64_t micro_batch = 1;     // B and T of the largest micro-batch, for the activation table
  int64_t seq_len = 1;
  uint64_t budget_bytes = 0;   // device memory the run may use; 0 = what the device has free
};

// Creates the model on the device with zero parameters and moments. Errors, each naming what
// to change: NotFound without a usable CUDA device; Unimplemented for what the CUDA model
// does not run (mixture-of-experts, head dims other than 64 and 128); OutOfMemory when the
// state and activations exceed the budget or the device's free memory (paging on the GPU is
// the CPU engine's job for now: run.device=cpu).
Result<std::unique_ptr<ResidentModel>> make_cuda_model(const model::ModelConfig& config, const OptimizerConfig& oc,
                                                       const CudaModelOptions& options);

// Device memory make_cuda_model() plans for: the parameter state, the activation table, the
// kernels' scratch and GEMM workspace, and a margin for the CUDA and cuBLAS runtimes.
uint64_t cuda_model_bytes(const model::ModelConfig& config, int64_t micro_batch, int64_t seq_len);

}  // namespace strata
