#!/usr/bin/env bash
# Training throughput with a checkpoint save in flight versus without. Builds nothing.
# Usage: tools/bench_ckpt_overhead.sh path/to/strata [steps] [rounds] [extra overrides...]
# Two measurements of the same training (model.preset=tiny; wall-clock time from metrics.jsonl
# `elapsed_s`, so starting saves and waiting for a busy writer count against it):
#  1. separate runs with ckpt.every=0 and ckpt.every=1, alternating, `rounds` times each
#     (default 3): tokens from step 3 to the last over the time between them, median per mode;
#  2. within one run with ckpt.every=2, each step's wall time (since the previous step ended)
#     for steps that began with a save in flight versus steps that did not, median of each,
#     which pairs neighbouring steps and so is immune to the machine's load drifting.
set -euo pipefail

strata=${1:?usage: $0 path/to/strata [steps] [rounds] [extra overrides...]}
steps=${2:-30}
rounds=${3:-3}
shift $(( $# >= 3 ? 3 : $# ))
[[ -x "$strata" ]] || { echo "error: $strata is not an executable" >&2; exit 1; }
command -v python3 >/dev/null || { echo "error: python3 is needed to read metrics.jsonl" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/strata_ckpt_bench.XXXXXX")
trap 'rm -rf "$work"' EXIT

run_tps() {  # metrics.jsonl -> wall-clock tokens/s from the end of step 3 to the last step
  python3 - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if "elapsed_s" in r and "event" not in r]
first = next((r for r in rows if r["step"] == 3), None)
last = rows[-1] if rows else None
if first is None or last["step"] <= first["step"]:
    sys.exit("fewer than 4 steps in " + sys.argv[1])
print(f"{(last['tokens'] - first['tokens']) / (last['elapsed_s'] - first['elapsed_s']):.1f}")
PY
}

paired_tps() {  # metrics.jsonl -> "with without" median tokens/s by ckpt_in_flight, after step 3
  python3 - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if "event" not in r]  # the run's goodput line is not a step
w, wo = [], []
for prev, r in zip(rows, rows[1:]):
    if r["step"] <= 3:
        continue
    tps = (r["tokens"] - prev["tokens"]) / (r["elapsed_s"] - prev["elapsed_s"])
    (w if r["ckpt_in_flight"] else wo).append(tps)
if not w or not wo:
    sys.exit("no steps with and without a save in flight in " + sys.argv[1])
print(f"{statistics.median(w):.1f} {statistics.median(wo):.1f} {len(w)} {len(wo)}")
PY
}

median() { python3 -c "import statistics, sys; print(f'{statistics.median(map(float, sys.argv[1:])):.1f}')" "$@"; }

declare -A runs
for r in $(seq "$rounds"); do
  for every in 0 1; do
    run="$work/every$every.round$r"
    if ! "$strata" train model.preset=tiny train.steps="$steps" run.log_every=1000 \
         run.dir="$run" ckpt.every="$every" ckpt.keep_last=2 "$@" >"$work/log$every.$r.txt" 2>&1; then
      echo "error: training with ckpt.every=$every failed:" >&2
      tail -20 "$work/log$every.$r.txt" >&2
      exit 1
    fi
    t=$(run_tps "$run/metrics.jsonl")
    runs[$every]+=" $t"
    echo "round $r ckpt.every=$every: $t tokens/s" >&2
  done
done
# shellcheck disable=SC2086
t0=$(median ${runs[0]}); t1=$(median ${runs[1]})

printf '%-30s %14s\n' "$rounds x $steps steps, tiny" "tokens/s (med)"
printf '%-30s %14s\n' "ckpt.every=0 (no saves)" "$t0"
printf '%-30s %14s\n' "ckpt.every=1 (save in flight)" "$t1"
python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); print(f'ratio with/without saves: {b/a:.3f}  (overhead {100*(1-b/a):.1f}%)')" "$t0" "$t1"

run="$work/paired"
if ! "$strata" train model.preset=tiny train.steps="$((steps * rounds))" run.log_every=1000 \
     run.dir="$run" ckpt.every=2 ckpt.keep_last=2 "$@" >"$work/log.paired.txt" 2>&1; then
  echo "error: training with ckpt.every=2 failed:" >&2
  tail -20 "$work/log.paired.txt" >&2
  exit 1
fi
read -r pw pwo nw nwo < <(paired_tps "$run/metrics.jsonl")
echo
printf '%-40s %14s %6s\n' "one run of $((steps * rounds)) steps, ckpt.every=2" "tokens/s (med)" "steps"
printf '%-40s %14s %6s\n' "steps with a save in flight" "$pw" "$nw"
printf '%-40s %14s %6s\n' "steps without" "$pwo" "$nwo"
python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); print(f'ratio with/without a save in flight: {b/a:.3f}')" "$pwo" "$pw"
