#!/usr/bin/env bash
# LoRA over each base format against the bf16 base, on the same model, data and seed: trains the
# adapters with `strata train train.method=lora` on the CPU backend (the recipes emulated as the
# GPU computes them) over a bf16, an fp8 (E4M3 blocks) and an nf4 (QLoRA's NormalFloat) base, and
# full fine-tuning beside them, and draws the losses on one chart with `strata plot`, which prints
# each run's mean loss over its last 10% of steps against the first run's (LoRA over bf16).
#
#   tools/lora_loss_bench.sh [BUILD_DIR] [OUT_DIR] [key=value ...]
#
# BUILD_DIR defaults to build, OUT_DIR to a new temporary folder; the key=value settings go to
# every run (a model through model.from, lora.rank, train.steps, ...). The defaults train the
# embedded demo (its model, data and budgets) for 200 steps, rank 16.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-build}"
[[ "$build" = /* ]] || build="$repo/$build"
out="${2:-$(mktemp -d "${TMPDIR:-/tmp}/lora_loss.XXXXXX")}"
shift $(( $# > 2 ? 2 : $# ))
strata="$build/strata"
[[ -x "$strata" ]] || { echo "lora_loss_bench: $strata not found; build first" >&2; exit 1; }

common=(train.steps=200 run.log_every=50 "$@")
runs=("lora-bf16:train.method=lora lora.base=bf16"
      "lora-fp8:train.method=lora lora.base=fp8"
      "lora-nf4:train.method=lora lora.base=nf4"
      "full-bf16:train.precision=bf16")
dirs=()
for r in "${runs[@]}"; do
  name="${r%%:*}"
  read -r -a settings <<< "${r#*:}"
  dir="$out/$name"
  dirs+=("$dir")
  [[ -f "$dir/metrics.jsonl" ]] && { echo "== $dir exists; kept"; continue; }
  echo "== ${settings[*]} -> $dir"
  "$strata" train "${common[@]}" "${settings[@]}" run.dir="$dir" 2>&1 | grep -E " step +[0-9]+0/| done:|error" || true
done
"$strata" plot "${dirs[@]}" --out "$out"
