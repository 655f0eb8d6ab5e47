#!/usr/bin/env bash
# How much of the ranks' communication hides behind compute at ZeRO-1, 2 and 3 (parallel.overlap_comm:
# ZeRO-1's sums at handover; gathers, gradient sums and the updated weights' gathers on the
# communication stream), on the CPU backend: `strata profile`
# at world 2 with the collectives in line and overlapped, the measured hidden share beside the
# plan's prediction, and the step times of both.
#
# The plan predicts with this machine's rates: compute from `strata bench machine` (one thread,
# as each of the two ranks gets on two cores) and the Gloo loopback rate from the in-line run
# (bytes sent per step over the communication's busy time), so that the prediction is the
# overlap model's alone. On a machine with fewer cores than ranks x 2 the communication thread
# and compute take the same cores: the share measured then is what the cores allow, not what
# the streams do.
#
#   tools/overlap_bench.sh [BUILD=build] [OUT=bench/results/DATE-overlap.md]
set -euo pipefail
build=${1:-build}
out=${2:-bench/results/$(date +%F)-overlap.md}
strata="$build/strata"
[[ -x $strata ]] || { echo "overlap_bench: $strata not found; build first" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq 400); do echo "the quick brown fox jumps over the lazy dog $((i * 7919 % 13))"; done > "$work/corpus.txt"
model='model.set=[num_hidden_layers=8,hidden_size=256,intermediate_size=768]'
common=(data.paths=["$work/corpus.txt"] "$model" train.micro_batch=4 train.seq_len=64 optim.warmup_steps=1
        train.grad_accum=2 run.device=cpu memory.host=256MiB memory.device=256MiB)

echo "overlap_bench: measuring this machine's compute rate (one thread)" >&2
OMP_NUM_THREADS=1 "$strata" bench machine "${common[@]}" --quick --dir "$work" --out "$work/machine.yaml" \
  > "$work/machine.log" 2>&1 || { cat "$work/machine.log"; exit 1; }

cat > "$work/rate.py" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "comm_bytes" in l]
busy = json.load(open(sys.argv[2]))["communication"]["busy_s"]
print("%.4f" % (rows[-1]["comm_bytes"] / busy / 1e9))
PY
cat > "$work/row.py" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
ca, cb = a["communication"], b["communication"]
print("| %s | %s | %.0f ms | %.0f ms | %.0f%% | %.0f%% | %.0f ms | %.0f ms | %.3f |" % (
    sys.argv[3], sys.argv[4], ca["busy_s"] * 1e3, cb["busy_s"] * 1e3, 100 * cb["planned_hidden_share"],
    100 * cb["hidden_share"], a["median_step_s"] * 1e3, b["median_step_s"] * 1e3,
    b["median_step_s"] / a["median_step_s"]))
PY

# One profile at world 2: ZERO, OVERLAP, extra keys; prints the report.json path.
profile() {
  local zero=$1 overlap=$2 name="z$1-$2" r pids=()
  shift 2
  for r in 0 1; do
    RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 TORCHELASTIC_RUN_ID="$name" \
      "$strata" profile "${common[@]}" parallel.zero="$zero" parallel.overlap_comm="$overlap" "$@" \
      run.dir="$work/run-$name" parallel.rendezvous="$work/rendezvous" --steps 4 --warmup 2 \
      > "$work/log-$name-$r" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { cat "$work/log-$name-"*; exit 1; }; done
  echo "$work/run-$name/profile/report.json"
}

rows=()
for zero in 1 2 3; do
  echo "overlap_bench: ZeRO-$zero in line" >&2
  inline=$(profile "$zero" false)
  # Bytes each rank sent per step (metrics.jsonl) over the collectives' busy time: Gloo's rate here.
  gbps=$(python3 "$work/rate.py" "$work/run-z$zero-false/metrics.jsonl" "$inline")
  echo "overlap_bench: ZeRO-$zero overlapped (plan at $gbps GB/s)" >&2
  overlapped=$(profile "$zero" true --hardware "$work/machine.yaml" hardware.intra_node_gbps="$gbps")
  rows+=("$(python3 "$work/row.py" "$inline" "$overlapped" "$zero" "$gbps")")
done

{
  echo "# Communication hidden behind compute, ZeRO-1, 2 and 3 at world 2 ($(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
  echo
  echo "\`tools/overlap_bench.sh\` on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)),"
  echo "CPU backend, Gloo over the loopback, two ranks on this machine, one compute thread each. Model"
  echo "\`$model\`, fp32, 2 micro-batches of 4 x 64 tokens per rank per step; \`strata profile --steps 4"
  echo "--warmup 2\`, rank 0's report."
  echo
  echo "- in line: \`parallel.overlap_comm=false\`, every collective on the compute path;"
  echo "- overlapped: \`parallel.overlap_comm=true\`: ZeRO-1's gradient sums at handover on a thread of"
  echo "  their own; the gathers, gradient sums and (ZeRO-1 and 2) the updated weights' gathers on the"
  echo "  communication stream, ordered against compute by events;"
  echo "- hidden (measured): the share of the collectives' busy time during which the compute stream"
  echo "  ran an op (its own waits for events left out) or the optimizer updated a group, from the"
  echo "  trace's timestamps;"
  echo "- hidden (planned): \`strata plan\`'s comm_hidden_s / comm_s with this machine's compute rate"
  echo "  (\`strata bench machine\`, one thread) and the Gloo rate of the in-line run (GB/s column)."
  echo
  echo "| ZeRO | Gloo GB/s | busy, in line | busy, overlapped | hidden (planned) | hidden (measured) | step, in line | step, overlapped | ratio |"
  echo "|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} > "$out"
cat "$out"
