#!/usr/bin/env bash
# The bytes each data-parallel rank sends per step, measured by `strata train` (metrics.jsonl's
# comm_bytes: the Comm's own count, averaged over the ranks) beside what `strata plan` predicts
# for the same model, world and ZeRO level (0 to 3) (its "comm/rank" column), on the CPU backend through
# Gloo over the loopback. The two should agree within 5%.
#
#   tools/comm_volume_bench.sh [BUILD=build] [OUT=bench/results/DATE-comm-volume.md]
set -euo pipefail
build=${1:-build}
out=${2:-bench/results/$(date +%F)-comm-volume.md}
strata="$build/strata"
[[ -x $strata ]] || { echo "comm_volume_bench: $strata not found; build first" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq 400); do echo "the quick brown fox jumps over the lazy dog $((i * 7919 % 13))"; done > "$work/corpus.txt"
dense='model.set=[num_hidden_layers=4,hidden_size=128,intermediate_size=256]'
# Top-2 of 4 experts: each rank's tokens reach experts of their own, and at ZeRO-2 and 3 every rank
# still sums and gathers every expert.
moe='model.set=[num_hidden_layers=4,hidden_size=128,intermediate_size=256,model_type=mixtral,num_local_experts=4,num_experts_per_tok=2]'

# "3.76 MiB" -> bytes
to_bytes() {
  python3 -c 'import sys
v, u = sys.argv[1], sys.argv[2]
m = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
print(int(float(v) * m[u]))' "$1" "$2"
}

rows=()
status=0
# One row: model NAME at ZeRO level ZERO over WORLD ranks in expert groups of EP (1: none).
run_case() {
  local name=$1 zero=$2 world=$3 ep=$4
  local model=${!name}
  local common=(data.paths=["$work/corpus.txt"] "$model" train.micro_batch=2 train.seq_len=32 train.steps=3
                optim.warmup_steps=1 train.grad_accum=2 run.device=cpu memory.host=256MiB parallel.expert_parallel=$ep)
  local run="$work/run-$name-$zero-$world-$ep" pids=() r
  for ((r = 0; r < world; r++)); do
    RANK=$r WORLD_SIZE=$world LOCAL_RANK=$r LOCAL_WORLD_SIZE=$world TORCHELASTIC_RUN_ID="bench-$name-$zero-$world-$ep" \
      "$strata" train "${common[@]}" run.dir="$run" parallel.zero=$zero \
      parallel.rendezvous="$work/rendezvous" > "$work/log-$name-$zero-$world-$ep-$r" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { cat "$work/log-$name-$zero-$world-$ep-"*; exit 1; }; done
  local measured line fits cv cu planned ratio ok
  measured=$(python3 -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "comm_bytes" in l]
print(int(rows[-1]["comm_bytes"]))' "$run/metrics.jsonl")
  line=$("$strata" plan "${common[@]}" parallel.world_size=$world parallel.zero=$zero 2>&1 |
         grep -E "^  $zero\*? " | head -1)
  # columns: level device host nvme fits comm/rank(value unit) ...
  read -r _ _ _ _ _ _ _ fits cv cu _ <<< "$line"
  planned=$(to_bytes "$cv" "$cu")
  ratio=$(python3 -c "print(f'{$measured / $planned:.3f}')")
  ok=$(python3 -c "print('yes' if abs($measured / $planned - 1) <= 0.05 else 'NO')")
  [[ $ok == yes ]] || status=1
  rows+=("| $name | $zero | $world | $ep | $measured | $planned | $ratio | $ok |")
}
for name in dense moe; do
  for zero in 0 1 2 3; do
    for world in 2 4; do run_case $name $zero $world 1; done
  done
done
# Expert parallelism: the routed rows' all-to-all (its share depends on the routing, even in
# the plan), and the experts' sums and gathers over the ranks holding them.
for zero in 1 2 3; do
  run_case moe $zero 2 2
  run_case moe $zero 4 2
  run_case moe $zero 4 4
done

{
  echo "# Bytes sent per rank per step: strata train against strata plan ($(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
  echo
  echo "CPU backend, Gloo over the loopback; the models are \`$dense\` and \`$moe\` (fp32 recipe: 4-byte gradients and"
  echo "compute copy), 2 micro-batches of 2 x 32 tokens per rank per step. Measured: the third step's comm_bytes"
  echo "(metrics.jsonl), what each rank's Comm counted as sent, averaged over the ranks. Planned: the"
  echo "\"comm/rank\" column of \`strata plan parallel.world_size=W parallel.zero=Z\` (ring collectives:"
  echo "ZeRO-0 all-reduces the gradients, 2(W-1)/W of their bytes; ZeRO-1 reduces them onto each"
  echo "range's rank, (W-1)/W, and gathers the updated copy, (W-1)/W of it, which strata sends as"
  echo "broadcasts of each rank's ranges; ZeRO-2 reduces each micro-batch's gradients onto the ranges'"
  echo "ranks as backward ends, grad_accum x (W-1)/W, and gathers the copy as ZeRO-1; ZeRO-3 sums as"
  echo "ZeRO-2 and gathers each layer's copy for every batch of the step program that computes with it)."
  echo "With expert groups of P (parallel.expert_parallel), a rank's experts are summed and gathered over the"
  echo "W/P ranks holding them, and each MoE layer's routed rows go out and back in forward, recompute"
  echo "and backward: (P-1)/P of them with even routing, which is what the plan counts."
  echo "The plan"
  echo "prints 3 significant digits; the step's scalars (loss, stop flag) are in the measurement only."
  echo
  echo "| model | ZeRO | world | expert groups | measured bytes | planned bytes | measured/planned | within 5% |"
  echo "|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "Command: \`tools/comm_volume_bench.sh $build\`"
} | tee "$out"
exit $status
