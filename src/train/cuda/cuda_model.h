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

enum class ActivationMode : uint8_t {
  kAuto,       // keep when it fits the budget, else recompute
  kKeep,       // the forward keeps every layer's intermediates: nothing is recomputed
  kRecompute,  // backward recomputes each layer from its input (less memory, ~1/3 more compute)
};

struct CudaModelOptions {
  int device = 0;
  int64_t micro_batch = 1;     // B and T of the largest micro-batch, for the activation table
  int64_t seq_len = 1;
  uint64_t budget_bytes = 0;   // device memory the run may use; 0 = what the device has free
  ActivationMode activations = ActivationMode::kAuto;
};

// Device memory for the CUDA model of `config` and the choice of activation mode.
struct CudaMemoryPlan {
  uint64_t keep_bytes = 0;       // everything, with every layer's intermediates kept
  uint64_t recompute_bytes = 0;  // everything, with one shared set of intermediates
  uint64_t available = 0;        // the budget, or the device's free memory when smaller
  bool budget_limits = false;    // memory.device, not free memory, sets `available`
  bool fits = false;
  bool keep = false;             // the mode chosen
};
// Reads the current device's free memory. REQUIRES: the device is current.
CudaMemoryPlan plan_cuda_memory(const model::ModelConfig& config, const CudaModelOptions& options);

// Creates the model on the device with zero parameters and moments. Errors, each naming what
// to change: NotFound without a usable CUDA device; Unimplemented for what the CUDA model
// does not run (mixture-of-experts, head dims other than 64 and 128); OutOfMemory when the
// state and activations exceed the budget or the device's free memory (paging on the GPU is
// the CPU engine's job for now: run.device=cpu).
Result<std::unique_ptr<ResidentModel>> make_cuda_model(const model::ModelConfig& config, const OptimizerConfig& oc,
                                                       const CudaModelOptions& options);

// Device memory make_cuda_model() plans for: the parameter state, the activation table, the
// kernels' scratch and GEMM workspace, and a margin for the CUDA and cuBLAS runtimes.
uint64_t cuda_model_bytes(const model::ModelConfig& config, int64_t micro_batch, int64_t seq_len,
                          bool keep_layer_activations);

}  // namespace strata
