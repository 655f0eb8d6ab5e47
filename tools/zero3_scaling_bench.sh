#!/usr/bin/env bash
# ZeRO-3 from 1 to N GPUs on one machine: `strata profile` with one rank per GPU (torchrun's
# variables; rank r on GPU r), the same micro-batches per rank (so the global batch grows with
# the world), at worlds 1, 2, 4, ... up to N. Per world: the step time, tokens/s of the world
# and per GPU, the scaling efficiency against one GPU (tokens/s per GPU over one GPU's), and the
# share of the collectives' time hidden behind compute (measured from the trace, and planned).
# At one GPU nothing is sharded or communicated: the row is the baseline.
#
#   tools/zero3_scaling_bench.sh BUILD [max GPUs] [OUT] [key=value ...]
#   e.g. tools/zero3_scaling_bench.sh build-gpu 8 bench/results/DATE-zero3-scaling.md
# Default model: model.preset=llama3.2-1b, bf16, 4 sequences of 2048 tokens per micro-batch,
# 2 micro-batches per step per rank, memory.device=24GiB (the commodity card the trainer is for).
# DEVICE=cpu runs it on the CPU backend instead (max = 2 ranks by default, a small model): the
# dry run that checks the script, not a measurement of GPUs.
set -euo pipefail
build=${1:?usage: $0 BUILD [max GPUs] [OUT] [key=value ...]}
device=${DEVICE:-cuda}
if [[ $device == cuda ]]; then
  max=${2:-$(nvidia-smi --list-gpus 2>/dev/null | wc -l)}
else
  max=${2:-2}
fi
out=${3:-bench/results/$(date +%F)-zero3-scaling-$device.md}
shift $(( $# < 3 ? $# : 3 ))
strata="$build/strata"
[[ -x $strata ]] || { echo "zero3_scaling_bench: $strata not found; build first" >&2; exit 1; }
(( max >= 1 )) || { echo "zero3_scaling_bench: no GPU found (nvidia-smi lists none)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq 2000); do echo "the quick brown fox jumps over the lazy dog $((i * 7919 % 13)) and runs on"; done \
  > "$work/corpus.txt"
if [[ $device == cuda ]]; then
  model=(model.preset=llama3.2-1b train.precision=bf16 train.micro_batch=4 train.seq_len=2048 memory.device=24GiB)
else
  model=('model.set=[num_hidden_layers=4,hidden_size=128,intermediate_size=384]' train.micro_batch=2
         train.seq_len=64 memory.device=256MiB memory.host=256MiB)
fi
common=(data.paths=["$work/corpus.txt"] "${model[@]}" train.grad_accum=2 optim.warmup_steps=1 run.device=$device
        parallel.zero=3 "$@")

cat > "$work/row.py" <<'PY'
import json, sys
world, report, base = int(sys.argv[1]), json.load(open(sys.argv[2])), sys.argv[3]
tokens = float(sys.argv[4])  # tokens per rank per step
step = report["median_step_s"]
per_gpu = tokens / step
eff = "1.00" if base == "-" else "%.2f" % (per_gpu / float(base))
c = report.get("communication", {})
hidden = "%.0f%%" % (100 * c["hidden_share"]) if c.get("busy_s") else "-"
planned = "%.0f%%" % (100 * c["planned_hidden_share"]) if c.get("busy_s") else "-"
print("| %d | %.0f ms | %.0f | %.0f | %s | %s | %s |" % (world, step * 1e3, per_gpu * world, per_gpu, eff, hidden, planned))
print("BASE %.6f" % per_gpu, file=sys.stderr)
PY

# Tokens per rank per step: micro_batch * seq_len * grad_accum, read back from the config keys.
tokens_per_rank=$(python3 - "${common[@]}" <<'PY'
import sys
kv = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a and not a.startswith("model.set"))
print(int(kv["train.micro_batch"]) * int(kv["train.seq_len"]) * int(kv["train.grad_accum"]))
PY
)

rows=()
base=-
for ((world = 1; world <= max; world *= 2)); do
  echo "zero3_scaling_bench: $world rank(s) on $device" >&2
  pids=()
  for ((r = 0; r < world; r++)); do
    RANK=$r WORLD_SIZE=$world LOCAL_RANK=$r LOCAL_WORLD_SIZE=$world TORCHELASTIC_RUN_ID="scaling-$world" \
      "$strata" profile "${common[@]}" run.dir="$work/run-$world" parallel.rendezvous="$work/rendezvous" \
      --steps 4 --warmup 2 > "$work/log-$world-$r" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { tail -n 20 "$work/log-$world-"*; exit 1; }; done
  row=$(python3 "$work/row.py" "$world" "$work/run-$world/profile/report.json" "$base" "$tokens_per_rank" 2> "$work/base")
  [[ $base == - ]] && base=$(awk '/^BASE/ {print $2}' "$work/base")
  rows+=("$row")
done

{
  echo "# ZeRO-3 scaling on $device, 1 to $max ranks ($(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
  echo
  if [[ $device == cuda ]]; then
    echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $max; \`tools/zero3_scaling_bench.sh $build $max\`."
  else
    echo "CPU backend ($(nproc) cores), Gloo over the loopback: a dry run of the script, not a GPU measurement."
  fi
  echo "Each rank: \`${model[*]}\`, 2 micro-batches per step, ZeRO-3 with the collectives overlapped"
  echo "(parallel.overlap_comm, the default); \`strata profile --steps 4 --warmup 2\`, rank 0's report."
  echo "Efficiency: tokens/s per rank over one rank's. Hidden: the share of the collectives' busy time"
  echo "during which the compute stream ran an op (measured), and the plan's prediction."
  echo
  echo "| ranks | step | tokens/s | tokens/s per rank | efficiency | hidden (measured) | hidden (planned) |"
  echo "|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} > "$out"
cat "$out"
