#!/usr/bin/env bash
# strata plan for data-parallel runs on many GPUs: Llama-3-8B and Llama-3-70B's shape on 8 GPUs
# of 24 GB, 8 of 40 GB and 64 of 24 GB (8 per node), every ZeRO level per rank, beside what
# DeepSpeed's own estimator says ZeRO-3 with parameters and optimizer offloaded to the CPU needs
# per node (deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs, zero_init:
# 18 bytes per parameter over the nodes, times its default buffer factor of 1.5). Predictions,
# not measurements: the built-in H200 rates unless hardware.* keys are given after the output.
#
#   tools/plan_many_gpus_bench.sh [BUILD=build] [OUT=bench/results/DATE-plan-many-gpus.md] [key=value ...]
set -euo pipefail
build=${1:-build}
out=${2:-bench/results/$(date +%F)-plan-many-gpus.md}
shift $(( $# > 2 ? 2 : $# ))
strata="$build/strata"
[[ -x $strata ]] || { echo "plan_many_gpus_bench: $strata not found; build first" >&2; exit 1; }

declare -A models=(
  [llama3-8b]="model.preset=llama3-8b"
  [70b]="model.preset=llama3-8b model.set=[hidden_size=8192,intermediate_size=28672,num_hidden_layers=80,num_attention_heads=64]"
)
run=(run.device=cuda train.micro_batch=1 train.seq_len=4096 train.grad_accum=8 "$@")
common=(memory.host=96GiB memory.nvme.path=/nvme memory.nvme.size=1TiB "${run[@]}")

# DeepSpeed ZeRO-3 offload (parameters and optimizer on the CPU, zero_init) per node, in GiB.
deepspeed_per_node() {  # PARAMS NODES
  python3 -c 'import sys; p, n = float(sys.argv[1]), int(sys.argv[2]); print(f"{p * 18 / n * 1.5 / 2**30:.1f}")' "$1" "$2"
}

{
  echo "# strata plan on many GPUs, beside DeepSpeed ZeRO-3 offload ($(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
  echo
  echo "Predictions, not measurements. Each rank: the GPU's budget, 96 GiB of pinned host memory, 1 TiB"
  echo "of nvme; one sequence of 4096 tokens per micro-batch, 8 micro-batches per step. The level table"
  echo "is \`strata plan\`'s (every level per rank; \`*\` marks auto's choice, the fastest that fits);"
  echo "below each, ZeRO-3 without nvme: the least host memory per node strata needs (\`strata plan\`'s"
  echo "smallest memory.host, times the 8 ranks of a node), beside DeepSpeed's own estimator for ZeRO-3"
  echo "with parameters and optimizer offloaded to the CPU (18 bytes per parameter over the nodes,"
  echo "times its default buffer factor 1.5), per node."
  echo
  echo "Command: \`tools/plan_many_gpus_bench.sh $build\`"
  for name in llama3-8b 70b; do
    read -r -a model <<< "${models[$name]}"
    for setup in "8 24GiB" "8 40GiB" "64 24GiB"; do
      read -r world device <<< "$setup"
      text=$("$strata" plan "${model[@]}" memory.device="$device" parallel.world_size="$world" "${common[@]}" 2>&1)
      params=$(grep -oE '[0-9.]+B parameters' <<< "$text" | head -1 | grep -oE '[0-9.]+' || true)
      nodes=$(( (world + 7) / 8 ))
      echo
      echo "## $name on $world GPUs of $device"
      echo
      echo '```text'
      grep -E '^data parallel|^  ZeRO |^  [0-3]\*? |^  collectives per rank|^  predicted throughput' <<< "$text" || true
      echo '```'
      # The least host memory ZeRO-3 needs without nvme, as DeepSpeed's estimate has none.
      least=$("$strata" plan "${model[@]}" memory.device="$device" parallel.world_size="$world" parallel.zero=3 \
                memory.host=4TiB "${run[@]}" 2>&1 | grep -oE 'smallest memory.host that fits[^:]*: [0-9.]+ [KMGT]?i?B' |
              grep -oE '[0-9.]+ [KMGT]?i?B$' || true)
      if [[ -n $params && -n $least ]]; then
        read -r v u <<< "$least"
        per_node=$(python3 -c 'import sys
v, u = float(sys.argv[1]), sys.argv[2]
m = {"B": 2**-30, "KiB": 2**-20, "MiB": 2**-10, "GiB": 1, "TiB": 2**10}
print(f"{v * m[u] * min(8, int(sys.argv[3])):.1f}")' "$v" "$u" "$world")
        ds=$(deepspeed_per_node "$(python3 -c "print(float('$params') * 1e9)")" "$nodes")
        echo
        echo "ZeRO-3 without nvme, host memory per node: strata $per_node GiB at least ($least per rank); DeepSpeed ZeRO-3 offload $ds GiB ($params B parameters, $nodes node(s))."
      fi
    done
  done
} | tee "$out"
