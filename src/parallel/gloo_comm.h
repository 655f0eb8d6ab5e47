// Comm over Gloo's TCP transport, for host buffers (the CPU backend, and NCCL's bootstrap).
// Ranks meet through Gloo's FileStore in CommOptions::rendezvous_dir, keyed by the options'
// name, then connect every pair directly. Compiled only when Gloo is found (STRATA_HAVE_GLOO).
#pragma once

#include <memory>

#include "core/status.h"
#include "parallel/comm.h"
#include "parallel/launch.h"

namespace strata::parallel {

// Blocks until every rank of `launch` has connected, or options.timeout passes (IOError).
// Operations passed a stream abort: this backend moves host memory only. Sets SIGPIPE to be
// ignored (when it has its default action), so that a peer's exit is an error, not a kill.
Result<std::unique_ptr<Comm>> connect_gloo(const LaunchInfo& launch, const CommOptions& options);

}  // namespace strata::parallel
