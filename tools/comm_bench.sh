#!/usr/bin/env bash
# Reduce-scatter and all-gather bandwidth of the Gloo Comm over loopback TCP, one process per
# rank on this machine, beside a memcpy of the same size measured in the same run.
# Usage: tools/comm_bench.sh BUILD_DIR [worlds] [MiB sizes] [bench|bench-nccl]
#   e.g. tools/comm_bench.sh build-cpu "2 4" "4 16 64"
# bench-nccl (a CUDA build, one GPU per rank: rank r uses GPU r) runs NCCL on device buffers
# instead, beside a device-to-device cudaMemcpy; tools/nccl_bench.sh calls it that way.
# Sizes are whole buffers as nccl-tests counts them (the reduce-scatter's input, the
# all-gather's output). Columns: bus bandwidth = size / time * (n-1)/n, the slowest rank's time
# (the mean of a few repeats after a warm-up); memcpy GB/s = size / time of one memcpy on
# rank 0, an upper bound no copy between processes can beat on this machine.
set -euo pipefail

build=${1:?usage: $0 BUILD_DIR [worlds] [MiB sizes]}
worlds=${2:-"2 4"}
sizes=${3:-"4 16 64"}
mode=${4:-bench}
worker="$build/tests/parallel_comm_worker"
[[ -x "$worker" ]] || { echo "error: $worker is missing; build the target parallel_comm_worker" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/strata_comm_bench.XXXXXX")
trap 'rm -rf "$work"' EXIT

for world in $worlds; do
  pids=()
  for ((rank = 0; rank < world; rank++)); do
    RANK=$rank WORLD_SIZE=$world LOCAL_RANK=$rank LOCAL_WORLD_SIZE=$world \
      STRATA_RENDEZVOUS="$work/rdv_$world" "$worker" "$mode" $sizes >"$work/rank_$rank.log" 2>&1 &
    pids+=($!)
  done
  status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  cat "$work/rank_0.log"
  if ((status != 0)); then
    for ((rank = 1; rank < world; rank++)); do cat "$work/rank_$rank.log" >&2; done
    echo "error: a rank failed at world $world" >&2
    exit 1
  fi
  echo
done
