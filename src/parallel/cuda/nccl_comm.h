// Comm over NCCL for buffers in CUDA device memory, queued on the stream each operation is
// given. Built on a bootstrap Comm (Gloo across processes, local for one) that carries NCCL's
// unique id from rank 0 to the others and serves the operations given no stream (host
// buffers: sum_over_ranks, barrier). Compiled only in CUDA builds.
#pragma once

#include <memory>

#include "core/status.h"
#include "parallel/comm.h"

namespace strata::parallel {

// REQUIRES: the CUDA device this rank uses is current on the calling thread (the caller sets
// it, usually from LaunchInfo::local_rank), and every rank calls this at once. Takes the
// bootstrap Comm. Errors: IOError naming the rank and NCCL's message.
Result<std::unique_ptr<Comm>> connect_nccl(std::unique_ptr<Comm> bootstrap);

}  // namespace strata::parallel
