#!/usr/bin/env bash
# Training throughput with a checkpoint save in flight every step versus no checkpoints.
# Builds nothing. Usage: tools/bench_ckpt_overhead.sh path/to/strata [steps] [rounds] [extra overrides...]
# Runs the same training (model.preset=tiny) with ckpt.every=0 and ckpt.every=1, alternating,
# `rounds` times each (default 3, to even out a busy machine), and prints the median tokens/s
# of each mode from metrics.jsonl (the first 3 steps of every run skipped) and their ratio.
set -euo pipefail

strata=${1:?usage: $0 path/to/strata [steps] [rounds] [extra overrides...]}
steps=${2:-30}
rounds=${3:-3}
shift $(( $# >= 3 ? 3 : $# ))
[[ -x "$strata" ]] || { echo "error: $strata is not an executable" >&2; exit 1; }
command -v python3 >/dev/null || { echo "error: python3 is needed to read metrics.jsonl" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/strata_ckpt_bench.XXXXXX")
trap 'rm -rf "$work"' EXIT

median_tps() {  # metrics.jsonl files -> "median_tokens_per_s count" over the steps after the third
  python3 - "$@" <<'PY'
import json, statistics, sys
v = []
for path in sys.argv[1:]:
    for line in open(path):
        line = line.strip()
        if not line:
            continue
        m = json.loads(line)
        if "tokens_per_s" in m and m.get("step", 0) > 3:
            v.append(float(m["tokens_per_s"]))
if not v:
    sys.exit("no steps after the third in " + " ".join(sys.argv[1:]))
print(f"{statistics.median(v):.1f} {len(v)}")
PY
}

declare -A tps n
for r in $(seq "$rounds"); do
  for every in 0 1; do
    run="$work/every$every.round$r"
    if ! "$strata" train model.preset=tiny train.steps="$steps" run.log_every=1000 \
         run.dir="$run" ckpt.every="$every" ckpt.keep_last=2 "$@" >"$work/log$every.$r.txt" 2>&1; then
      echo "error: training with ckpt.every=$every failed:" >&2
      tail -20 "$work/log$every.$r.txt" >&2
      exit 1
    fi
    read -r t _ < <(median_tps "$run/metrics.jsonl")
    echo "round $r ckpt.every=$every: $t tokens/s" >&2
  done
done
for every in 0 1; do
  read -r tps[$every] n[$every] < <(median_tps "$work"/every$every.round*/metrics.jsonl)
done

printf '%-30s %14s %8s\n' "$rounds x $steps steps, tiny" "tokens/s (med)" "steps"
printf '%-30s %14s %8s\n' "ckpt.every=0 (no saves)" "${tps[0]}" "${n[0]}"
printf '%-30s %14s %8s\n' "ckpt.every=1 (save in flight)" "${tps[1]}" "${n[1]}"
python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); print(f'ratio with/without saves: {b/a:.3f}  (overhead {100*(1-b/a):.1f}%)')" "${tps[0]}" "${tps[1]}"
