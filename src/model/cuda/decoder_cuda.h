// The decoder (model/decoder.h) on the CUDA backend: Decoder<kernels::CudaOps>, the same layer
// graph as the CPU's, computing from a ParamAccess whose compute copy is bf16 in device memory
// (PagedState on a CUDA Device). Declared in every build; defined only with the CUDA backend.
#pragma once

#include <memory>

#include "core/device.h"
#include "core/dtype.h"
#include "core/status.h"
#include "model/config.h"
#include "model/decoder.h"

namespace strata::model {

// OK when the CUDA ops run `config` with compute weights of type `compute` (kBF16: the bf16
// recipe; kF8E4M3: the fp8 recipe); Unimplemented naming what they lack (attention head dims
// other than 64 and 128, fp32 weights, fp8 GEMM widths that are not multiples of 16).
Status cuda_supports(const ModelConfig& config, DType compute = DType::kBF16);

// The decoder on `device` (a CUDA device, current on this thread) in the recipe whose compute
// copy is `compute`; set a ParamAccess before computing. Its ops take their scratch, workspace
// and activations from the device's arena. The errors of cuda_supports().
Result<std::unique_ptr<Model>> make_cuda_decoder(Device& device, const ModelConfig& config,
                                                 DType compute = DType::kBF16);

}  // namespace strata::model
