#!/usr/bin/env bash
# The fp8 recipe's loss against the bf16 and fp32 recipes, and compact Adam moments against
# fp32 moments, on the same model, data and seed: trains each with `strata train` on the CPU
# backend (the recipes emulated as the GPU computes them) and draws the losses on one chart with
# `strata plot`, which prints each run's mean loss over its last 10% of steps against the first
# run's (the bf16 recipe with fp32 moments).
#
#   tools/fp8_loss_bench.sh [BUILD_DIR] [OUT_DIR] [key=value ...]
#
# BUILD_DIR defaults to build, OUT_DIR to a new temporary folder; the key=value settings go to
# every run (e.g. a larger model through model.set, or train.steps). The defaults train the
# embedded demo (its model, data and budgets) for 200 steps.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-build}"
[[ "$build" = /* ]] || build="$repo/$build"
out="${2:-$(mktemp -d "${TMPDIR:-/tmp}/fp8_loss.XXXXXX")}"
shift $(( $# > 2 ? 2 : $# ))
strata="$build/strata"
[[ -x "$strata" ]] || { echo "fp8_loss_bench: $strata not found; build first" >&2; exit 1; }

common=(train.steps=200 run.log_every=50 "$@")
runs=(bf16:fp32 fp8:fp32 fp32:fp32 bf16:bf16 bf16:int8 fp8:int8)
dirs=()
for r in "${runs[@]}"; do
  precision="${r%%:*}" moments="${r##*:}"
  dir="$out/${precision}-${moments}-moments"
  dirs+=("$dir")
  [[ -f "$dir/metrics.jsonl" ]] && { echo "== $dir exists; kept"; continue; }
  echo "== train.precision=$precision optim.moments=$moments -> $dir"
  "$strata" train "${common[@]}" train.precision="$precision" optim.moments="$moments" run.dir="$dir" \
    2>&1 | grep -E " step +[0-9]+0/| done:|error" || true
done
"$strata" plot "${dirs[@]}" --out "$out"
