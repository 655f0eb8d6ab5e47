// What an op set sizes its own per-micro-batch buffers by (activation_block and
// extra_activation_bytes of kernels/cpu/backend.h and kernels/cuda/backend.h): the model's
// dimensions that bound them, for N tokens.
#pragma once

#include <cstdint>

namespace strata::kernels {

struct MicroBatchShape {
  int64_t N = 0;  // tokens
  int64_t E = 0;  // routed experts (0: a dense model)
  int64_t K = 0;  // experts per token (0: a dense model)
  int64_t C = 0;  // hidden size
  int64_t F = 0;  // the widest linear layer's other side: q/k/v projections, MLPs, experts
  int64_t V = 0;  // vocabulary
  // Ranks of an expert group (model/expert_parallel.h): an expert may compute the rows of all
  // of them, P x N x K at most. 1: no expert parallelism.
  int64_t P = 1;
};

}  // namespace strata::kernels
