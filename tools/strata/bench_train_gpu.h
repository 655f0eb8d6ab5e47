// strata bench train-gpu: training throughput of `strata train run.device=cuda` (the trainer
// itself, on one GPU) in tokens/s and model TFLOP/s, for comparison with
// tools/bench_gpu_train_torch.py on the same machine.
#pragma once

#include <string>
#include <vector>

namespace strata::tools {

// args are those after "bench train-gpu". Returns 0 on success, 1 when the run failed or this
// build has no CUDA backend (one line printed), 2 for a usage error.
int bench_train_gpu_command(const std::vector<std::string>& args);

}  // namespace strata::tools
