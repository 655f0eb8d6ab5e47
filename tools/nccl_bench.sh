#!/usr/bin/env bash
# Collective bandwidth on a multi-GPU machine, at 1..N GPUs: nccl-tests' all_reduce_perf,
# reduce_scatter_perf and all_gather_perf where they are on PATH, then strata's own NCCL Comm
# (tools/comm_bench.sh bench-nccl) on the same sizes.
# Usage: tools/nccl_bench.sh BUILD_DIR [max GPUs] [MiB sizes]
#   BUILD_DIR is a CUDA build with parallel_comm_worker built (cmake --build BUILD_DIR
#   --target parallel_comm_worker); max GPUs defaults to nvidia-smi's count.
#
# Reading the output: nccl-tests print, per size, time and "algbw"/"busbw" in GB/s for the
# out-of-place and in-place runs; compare busbw (algbw * (n-1)/n for all-gather and
# reduce-scatter, * 2(n-1)/n for all-reduce), which is what a link carries and does not depend on
# n. strata's table prints the same busbw for reduce-scatter and all-gather (sizes are the whole
# buffer, as nccl-tests counts them) beside a device-to-device copy on GPU 0. strata's figures
# should come within a few percent of nccl-tests' at large sizes (both are NCCL); well below
# means a wrong stream, a synchronisation per call or a slow bootstrap. At 1 GPU busbw is 0 by
# definition; the row only shows that the calls work. Over PCIe expect a few to ~25 GB/s,
# over NVLink hundreds.
set -euo pipefail

build=${1:?usage: $0 BUILD_DIR [max GPUs] [MiB sizes]}
max=${2:-$(nvidia-smi --list-gpus 2>/dev/null | wc -l)}
sizes=${3:-"4 16 64 256"}
here=$(cd "$(dirname "$0")" && pwd)
(( max >= 1 )) || { echo "error: no GPU found (nvidia-smi lists none)" >&2; exit 1; }

min_bytes=$(( $(echo $sizes | tr ' ' '\n' | sort -n | head -1) << 20 ))
max_bytes=$(( $(echo $sizes | tr ' ' '\n' | sort -n | tail -1) << 20 ))
for ((n = 1; n <= max; n *= 2)); do
  echo "=== $n GPU(s) ==="
  for t in all_reduce_perf reduce_scatter_perf all_gather_perf; do
    if command -v "$t" >/dev/null; then
      echo "--- nccl-tests $t"
      "$t" -b "$min_bytes" -e "$max_bytes" -f 4 -g "$n" -w 5 -n 20
    else
      echo "--- nccl-tests $t: not on PATH, skipped"
    fi
  done
  echo "--- strata NCCL Comm"
  "$here/comm_bench.sh" "$build" "$n" "$sizes" bench-nccl
done
