#!/usr/bin/env bash
# `strata train` on the GPU end to end, against the CPU backend:
#   1. the same 20-step run (a 4-layer, 256-wide Llama with head_dim 64 learning the license
#      texts) with run.device=cuda and run.device=cpu: every step's loss must agree within
#      5% (bf16 compute against fp32), and the GPU run must learn;
#   2. its step-10 checkpoint resumed on the CPU, and the CPU run's resumed on the GPU: the
#      resumed steps must agree with the uninterrupted runs the same way; resumed on the GPU,
#      the GPU run's own checkpoint must continue bit-exactly (every loss equal);
#   3. the GPU run's Hugging Face export must exist;
#   4. the CPU's emulation of the GPU's bf16 recipe (train.precision=bf16) must track the GPU
#      run closer than the fp32 CPU run does (within 2% per step);
#   5. the GPU run with memory.device so small that a third of the state's chunks fit beside
#      the kernels' scratch pages through host memory and must give bitwise the same losses;
#   6. a mixture-of-experts model (4 experts, 2 per token, a shared expert) must learn on the GPU;
#   7. every run evaluates (data.eval_paths) at steps 10 and 20: the GPU's eval losses agree with
#      the CPU's within 5%, and the paged GPU run's are the resident run's bits.
#
#   tools/gpu_train_check.sh STRATA_BINARY [WORK_DIR]
#   GPU_DEVICE=cpu tools/gpu_train_check.sh build/strata   checks the script itself without a GPU
# Exits 0 when every check passed, 1 otherwise.
set -euo pipefail

strata="${1:?usage: tools/gpu_train_check.sh STRATA_BINARY [WORK_DIR]}"
work="${2:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_train_check.XXXXXX")}"
mkdir -p "$work"
gpu="${GPU_DEVICE:-cuda}"
common=(model.preset=tiny
        'model.set=[hidden_size=256,num_attention_heads=4,num_key_value_heads=2,intermediate_size=512]'
        train.micro_batch=4 train.seq_len=128 train.steps=20 optim.warmup_steps=5 run.log_every=5
        ckpt.every=10 memory.device=8GiB memory.host=0 memory.nvme.path= data.paths='[builtin:licenses]'
        data.eval_paths='[builtin:licenses]' train.eval_every=10 train.eval_steps=4)

train() {  # train NAME DEVICE [more keys...]
  local name="$1" device="$2"
  shift 2
  rm -rf "${work:?}/$name"  # a reused WORK_DIR must not hold an earlier run's checkpoints
  echo "---- $name: strata train run.device=$device $*"
  "$strata" train "${common[@]}" run.device="$device" run.dir="$work/$name" ckpt.dir="$work/$name/ckpt" "$@"
}

train cuda "$gpu" run.export="$work/cuda/export"
train cpu cpu
train cuda-from-cpu "$gpu" --resume "$work/cpu/ckpt/step-10"
train cpu-from-cuda cpu --resume "$work/cuda/ckpt/step-10"
train cuda-from-cuda "$gpu" --resume "$work/cuda/ckpt/step-10"
train cpu-bf16 cpu train.precision=bf16
# 292 MiB of kernel scratch and workspaces (as an H200 reported), 18 MiB of activations, and
# ~20 MiB of chunks for ~51 MiB of state.
if [[ "$gpu" == cuda ]]; then paged_budget=330MiB; else paged_budget=30MiB; fi
train cuda-paged "$gpu" memory.device="$paged_budget"
train cuda-moe "$gpu" \
  'model.set=[hidden_size=256,num_attention_heads=4,num_key_value_heads=2,num_experts=4,num_experts_per_tok=2,moe_intermediate_size=128,shared_expert_intermediate_size=256,output_router_logits=true,router_aux_loss_coef=0.01]' 
[[ -f "$work/cuda/export/model.safetensors" ]] || { echo "no export in $work/cuda/export"; exit 1; }

python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
def losses(name, key="loss"):
    return {j["step"]: j[key] for j in map(json.loads, open(f"{work}/{name}/metrics.jsonl"))
            if "event" not in j and key in j}
cuda, cpu = losses("cuda"), losses("cpu")
failed = False
def compare(a_name, a, b_name, b, steps, tolerance=0.05):
    global failed
    worst = 0.0
    missing = False
    for s in steps:
        if s not in a or s not in b:
            print(f"step {s} missing in {a_name} or {b_name}"); missing = True; continue
        err = abs(a[s] - b[s]) / max(abs(b[s]), 1e-6)
        worst = max(worst, err) if err == err else float("inf")
    ok = worst <= tolerance and not missing
    failed |= not ok
    print(f"{a_name:>14} vs {b_name:<14} steps {steps[0]}-{steps[-1]}: worst relative loss difference "
          f"{worst:.3g} ({'ok' if ok else 'FAIL'}, tolerance {tolerance})")
compare("cuda", cuda, "cpu", cpu, list(range(1, 21)))
compare("cpu-from-cuda", losses("cpu-from-cuda"), "cuda", cuda, list(range(11, 21)))
compare("cuda-from-cpu", losses("cuda-from-cpu"), "cpu", cpu, list(range(11, 21)))
compare("cuda-from-cuda", losses("cuda-from-cuda"), "cuda", cuda, list(range(11, 21)), tolerance=0.0)
compare("cuda", cuda, "cpu-bf16", losses("cpu-bf16"), list(range(1, 21)), tolerance=0.02)
compare("cuda-paged", losses("cuda-paged"), "cuda", cuda, list(range(1, 21)), tolerance=0.0)
compare("cuda eval", losses("cuda", "eval_loss"), "cpu eval", losses("cpu", "eval_loss"), [10, 20])
compare("cuda-paged eval", losses("cuda-paged", "eval_loss"), "cuda eval", losses("cuda", "eval_loss"), [10, 20],
        tolerance=0.0)
moe = losses("cuda-moe")
moe_learned = moe.get(20, 99) < moe.get(1, 0) - 0.5
failed |= not moe_learned
print(f"cuda-moe loss {moe.get(1, float('nan')):.4f} -> {moe.get(20, float('nan')):.4f} "
      f"({'learns' if moe_learned else 'FAIL: does not learn'})")
learned = cuda[20] < cuda[1] - 0.5
failed |= not learned
print(f"cuda loss {cuda[1]:.4f} -> {cuda[20]:.4f} ({'learns' if learned else 'FAIL: does not learn'})")
sys.exit(1 if failed else 0)
PY
