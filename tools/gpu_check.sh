#!/usr/bin/env bash
# One command for a GPU machine, in order of what a first run on a new GPU must show:
#   1. op parity: each GPU test group (a gtest suite of test_gpu) in its own process, so one
#      cuBLAS or cuDNN corner case that aborts cannot take the later groups with it;
#   2. model parity: the whole model on CUDA against the CPU's bf16 recipe;
#   3. training: `strata train` on the GPU against the CPU backend, paged against resident,
#      resumed across devices (tools/gpu_train_check.sh);
#   4. op speed: the perf lines of test_gpu --perf, each against a ceiling measured in the run;
#   5. the 0.44B training benchmark, strata against PyTorch, in the same run;
#   6. the paged benchmarks: the 3.6B shape under a 24 GiB cap in bf16, then in fp8 (the 8B
#      one with BIG_BENCH=1);
#   7. `strata profile` of that 3.6B step in bf16: where its time goes, phase by phase, against
#      the plan (the report's step and critical-path tables go into the summary).
# It prints one summary table last and writes it, with the perf and throughput tables, to
# SUMMARY. Builds nothing (tools/build_gpu.sh builds and packs what it runs).
#
#   tools/gpu_check.sh [BUILD_DIR]            (default: build-gpu, relative to the repository)
#
# Settings (environment):
#   BUDGET_S=600       the seconds all steps may take together. Each step's timeout is cut to
#                      what is left, and a step that would start with under 15 s left is
#                      skipped and listed as such: the steps above run in order of value.
#   SUMMARY=FILE       where the summary goes (default bench/results/gpu-check-DATE-COMMIT.md)
#   LOG_DIR=DIR        where each step's log goes (default a new temporary folder)
#   TRAIN_BENCH=0      skips the 0.44B benchmark (strata and PyTorch)
#   PAGED_BENCH=0      skips the 3.6B paged benchmarks (bf16 and fp8)
#   PROFILE_PAGED=0    skips the profile of the 3.6B paged step
#   BIG_BENCH=1        adds the Llama-3-8B shape under 24 GiB, host <= 100 GiB, nvme in NVME_DIR
#   SANITIZE=1         adds the parity groups and two training steps under compute-sanitizer
#                      (SANITIZE_TOOLS="memcheck racecheck synccheck initcheck"; default memcheck)
#   GPU_DEVICE=cpu     a dry run without a GPU: checks the build folder, the library path and
#                      the test groups, then runs every step through a stand-in that prints the
#                      command instead of running it, so the sequencing, timeouts, budget and
#                      tables run as they would on a GPU. GPU_CHECK_FAKE="STEP=fail,STEP=hang"
#                      makes a stand-in fail or hang (until its timeout), TIMEOUT_SCALE=0.01
#                      shrinks every timeout; tests/tools/gpu_check_test.sh uses both.
#
# The shared libraries a GPU machine may lack (tools/build_gpu.sh packs them into
# BUILD_DIR/devlibs) are found on their own: nothing to export first. Nothing depends on the
# absolute path the build folder had where it was built: test binaries run directly, not
# through CTest, whose files hold that path.
# Exits 0 when every step that ran passed (skipped steps are listed), 1 otherwise; a machine
# without a visible CUDA device fails outside a dry run.
set -u -o pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-build-gpu}"
[[ "$build" = /* ]] || build="$repo/$build"
test_gpu="$build/tests/test_gpu"
strata="$build/strata"
dry=0
[[ "${GPU_DEVICE:-cuda}" == cpu ]] && dry=1
budget="${BUDGET_S:-600}"
timeout_scale="${TIMEOUT_SCALE:-1}"
fake="${GPU_CHECK_FAKE:-}"
sanitize="${SANITIZE:-0}"
sanitize_tools="${SANITIZE_TOOLS:-memcheck}"
train_bench="${TRAIN_BENCH:-1}"
paged_bench="${PAGED_BENCH:-1}"
big_bench="${BIG_BENCH:-0}"
profile_paged="${PROFILE_PAGED:-1}"
# Each benchmark: model build, 3 warm-up and 20 timed steps of 8 x 2048 tokens (well under a
# minute on an H200 at the baseline's speed); the timeout bounds a slow or hung run.
train_args=(--preset 0.44b --warmup 3 --steps 20 --micro-batch 8 --seq 2048 --grad-accum 1)
# The 3.6B model of DESIGN §2 under a 24 GiB cap, 4 x 2048 tokens per micro-batch, 4 per step.
paged_args=(--preset 3.6b --warmup 1 --steps 3 --micro-batch 4 --seq 2048 --grad-accum 4 --memory-device 24GiB)
big_args=(--preset 8b --warmup 1 --steps 2 --micro-batch 4 --seq 2048 --grad-accum 4 --memory-device 24GiB
          --memory-host 100GiB --nvme "${NVME_DIR:-${TMPDIR:-/tmp}}/strata-bench-nvme" --nvme-size 200GiB)
# The same 3.6B step for `strata profile` (1 warm-up and 2 traced steps), as train keys.
profile_args=(model.preset=llama3-8b
              'model.set=[hidden_size=3072,intermediate_size=8192,num_hidden_layers=28,num_attention_heads=24,rms_norm_eps=1e-6]'
              run.device=cuda memory.device=24GiB train.micro_batch=4 train.seq_len=2048 train.grad_accum=4
              data.paths='[builtin:licenses]' --warmup 1 --steps 2)
# Per-step timeouts, seconds: a parity group, the model group, the training check, the perf
# runner, one 0.44B benchmark, one paged benchmark.
t_group=90 t_model=150 t_train=240 t_perf=120 t_bench=150 t_paged=300

die() { echo "gpu_check: $*" >&2; exit 1; }
for f in "$test_gpu" "$strata"; do
  [[ -x "$f" ]] || die "$f not found; build first: tools/build_gpu.sh ${build#"$repo"/}"
done
if [[ -d "$build/devlibs" ]]; then
  export LD_LIBRARY_PATH="$build/devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
commit="$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
summary="${SUMMARY:-$repo/bench/results/gpu-check-$(date -u +%Y-%m-%d)-$commit.md}"
log_dir="${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}"
mkdir -p "$log_dir" "$(dirname "$summary")" || die "cannot create $log_dir or the folder of $summary"

# The test groups: every suite test_gpu lists (listing needs no device), parameterised suites
# under their full names. Model parity runs as its own step, the perf runner last.
listing="$("$test_gpu" --gtest_list_tests 2>&1)" ||
  die "$test_gpu --gtest_list_tests failed (a missing shared library? BUILD_DIR/devlibs holds the packed ones): $listing"
mapfile -t suites < <(sed -n 's/^\([A-Za-z0-9_/]*\)\.\( .*\)\{0,1\}$/\1/p' <<< "$listing")
[[ ${#suites[@]} -gt 0 ]] || die "$test_gpu --gtest_list_tests listed no test suites"
op_groups=() model_groups=()
for s in "${suites[@]}"; do
  case "$s" in
    *ModelParity*) model_groups+=("$s") ;;
    OpsPerf) ;;
    *) op_groups+=("$s") ;;
  esac
done

start_all=$SECONDS
names=() results=() seconds=()
failed=0 skipped=0

# fake_outcome NAME: what GPU_CHECK_FAKE asks of the stand-in for step NAME (pass by default).
fake_outcome() {
  local item
  for item in ${fake//,/ }; do
    [[ "${item%%=*}" == "$1" ]] && { echo "${item#*=}"; return; }
  done
  echo pass
}

# stand_in NAME CMD...: the dry run's step. Checks that the program exists, prints the command.
stand_in() {
  local name="$1"
  shift
  local program="$1"
  if [[ "$program" == */* ]]; then
    [[ -e "$program" ]] || { echo "dry run: $program does not exist"; return 127; }
  else
    command -v "$program" > /dev/null || { echo "dry run: $program is not on PATH"; return 127; }
  fi
  echo "dry run: would run: $*"
  case "$(fake_outcome "$name")" in
    fail) return 3 ;;
    hang) sleep 100000 ;;
  esac
}

# run NAME TIMEOUT CMD...: one step under its timeout (scaled, and cut to the budget left),
# teed to $log_dir/NAME.log, with its outcome recorded.
run() {
  local name="$1" limit="$2"
  shift 2
  local left=$((budget - (SECONDS - start_all)))
  limit="$(awk -v t="$limit" -v s="$timeout_scale" 'BEGIN { t = int(t * s + 0.5); print t < 1 ? 1 : t }')"
  # Under 15 s left nothing real finishes; a scaled (test) run keeps going to the last second.
  local least=15
  [[ "$timeout_scale" == 1 ]] || least=1
  if ((left < least)); then
    names+=("$name") results+=("SKIPPED (budget of ${budget} s spent)") seconds+=(0)
    skipped=$((skipped + 1))
    return
  fi
  ((limit > left)) && limit=$left
  echo
  echo "==== $name (timeout ${limit} s): $*"
  local begin=$SECONDS rc
  if ((dry)); then
    # The stand-in runs in a child bash so that `timeout` can kill it like a real step.
    timeout --kill-after=5 "$limit" bash -c "$(declare -f fake_outcome stand_in); fake='$fake'; stand_in \"\$@\"" \
      stand_in "$name" "$@" 2>&1 | tee "$log_dir/$name.log"
    rc=${PIPESTATUS[0]}
  else
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log_dir/$name.log"
    rc=${PIPESTATUS[0]}
  fi
  local result=PASS
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    result="FAIL (timed out after ${limit} s)"
  elif [[ $rc -eq 77 ]]; then
    result="FAIL (no CUDA device visible)"
  elif [[ $rc -ne 0 ]]; then
    result="FAIL (exit $rc)"
  fi
  [[ $result == PASS ]] || failed=1
  names+=("$name") results+=("$result") seconds+=($((SECONDS - begin)))
}

if ((dry)); then
  echo "gpu_check: dry run (GPU_DEVICE=cpu): no GPU command runs"
else
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
fi
echo "gpu_check: build $build, commit $commit, budget ${budget} s, logs in $log_dir"
echo "gpu_check: ${#op_groups[@]} op groups (${op_groups[*]}), model groups: ${model_groups[*]:-none}"

for g in "${op_groups[@]}"; do
  run "ops-${g//\//-}" "$t_group" "$test_gpu" --gtest_filter="$g.*"
done
if [[ ${#model_groups[@]} -gt 0 ]]; then
  run model "$t_model" "$test_gpu" --gtest_filter="$(printf '%s.*:' "${model_groups[@]}" | sed 's/:$//')"
fi
run train-cuda "$t_train" bash "$repo/tools/gpu_train_check.sh" "$strata" "$log_dir/train-cuda-runs"
run perf "$t_perf" "$test_gpu" --perf --gtest_filter='OpsPerf.*'
if [[ "$train_bench" == 1 ]]; then
  run train-strata "$t_bench" "$strata" bench train-gpu "${train_args[@]}"
  run train-torch "$t_bench" python3 "$repo/tools/bench_gpu_train_torch.py" "${train_args[@]}"
fi
if [[ "$paged_bench" == 1 ]]; then
  run paged-3.6b "$t_paged" "$strata" bench train-gpu "${paged_args[@]}"
  run paged-3.6b-fp8 "$t_paged" "$strata" bench train-gpu "${paged_args[@]}" --precision fp8
fi
[[ "$big_bench" == 1 ]] && run paged-8b "$t_paged" "$strata" bench train-gpu "${big_args[@]}"
if [[ "$profile_paged" == 1 ]]; then
  run profile-3.6b "$t_paged" "$strata" profile "${profile_args[@]}" --out "$log_dir/profile-3.6b" \
    run.dir="$log_dir/profile-3.6b-run"
fi
if [[ "$sanitize" == 1 ]]; then
  if ! ((dry)) && ! command -v compute-sanitizer > /dev/null; then
    names+=("sanitize") results+=("FAIL (compute-sanitizer not on PATH)") seconds+=(0)
    failed=1
  else
    for tool in $sanitize_tools; do
      run "sanitize-$tool" "$t_model" compute-sanitizer --tool "$tool" --error-exitcode 99 \
        "$test_gpu" --gtest_filter='OpsParity.*:MoeParity.*:*ModelParity*'
      # Two steps of `strata train` on the GPU with a checkpoint after each (the host copy).
      run "sanitize-train-$tool" "$t_model" compute-sanitizer --tool "$tool" --error-exitcode 99 \
        "$strata" train model.preset=tiny \
        'model.set=[hidden_size=256,num_attention_heads=4,num_key_value_heads=2]' \
        train.micro_batch=2 train.seq_len=64 train.steps=2 optim.warmup_steps=1 run.device=cuda \
        memory.device=0 memory.host=0 memory.nvme.path= ckpt.every=1 \
        run.dir="$log_dir/sanitize-train-$tool" ckpt.dir="$log_dir/sanitize-train-$tool/ckpt"
    done
  fi
fi

# result_field LOG KEY: the number under KEY in the log's last "RESULT {json}" line, or nothing.
result_field() {
  [[ -f "$1" ]] || return 0
  grep '^RESULT ' "$1" | tail -n 1 | sed -n 's/.*"'"$2"'": \([-0-9.eE+]*\).*/\1/p'
}

# The tables, printed and written to the summary file together.
tables() {
  echo "# GPU check, commit $commit, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "\`tools/gpu_check.sh\` on: $( ((dry)) && echo "a dry run (GPU_DEVICE=cpu), no GPU" ||
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)"
  echo
  echo '```'
  printf '%-28s %-40s %8s\n' step result seconds
  local i
  for i in "${!names[@]}"; do
    printf '%-28s %-40s %8s\n' "${names[$i]}" "${results[$i]}" "${seconds[$i]}"
  done
  echo "total $((SECONDS - start_all)) s of a ${budget} s budget; $skipped skipped"
  echo '```'
  echo
  echo "Ops, achieved against the ceiling measured in the same run:"
  echo
  echo '```'
  if grep -q '^PERF|' "$log_dir/perf.log" 2>/dev/null; then
    printf '%-24s %-36s %10s %-8s %7s\n' op shape achieved unit "%ceil"
    grep '^PERF|' "$log_dir/perf.log" | while IFS='|' read -r _ op shape ms value unit ceiling pct; do
      printf '%-24s %-36s %10s %-8s %7s\n' "$op" "$shape" "$value" "$unit" "$pct"
    done
  else
    echo "(no perf lines)"
  fi
  echo '```'
  if [[ "$train_bench" == 1 ]]; then
    echo
    echo "Training throughput (${train_args[*]}; target: strata >= 1.3x PyTorch):"
    echo
    echo '```'
    local strata_tps torch_tps
    strata_tps="$(result_field "$log_dir/train-strata.log" tokens_per_s)"
    torch_tps="$(result_field "$log_dir/train-torch.log" tokens_per_s)"
    printf '%-24s %12s %10s\n' implementation tokens/s TFLOP/s
    printf '%-24s %12s %10s\n' "strata bench train-gpu" "${strata_tps:--}" \
      "$(result_field "$log_dir/train-strata.log" tflops)"
    printf '%-24s %12s %10s\n' "PyTorch (HF, SDPA, AMP)" "${torch_tps:--}" \
      "$(result_field "$log_dir/train-torch.log" tflops)"
    if [[ -n "$strata_tps" && -n "$torch_tps" ]]; then
      awk -v s="$strata_tps" -v t="$torch_tps" 'BEGIN {
        printf "%-24s %12.3f   (target 1.3: %s)\n", "ratio strata / PyTorch", s / t,
               (s >= 1.3 * t) ? "met" : "NOT met"
      }'
    else
      echo "ratio strata / PyTorch: - (a benchmark printed no RESULT line; see its log)"
    fi
    echo '```'
  fi
  local bench
  for bench in paged-3.6b paged-3.6b-fp8 paged-8b; do
    [[ -f "$log_dir/$bench.log" ]] || continue
    echo
    echo "$bench (anchors: FSDP2 + CPU offload 619 tokens/s for 3.6B under 24 GiB, killed by host OOM"
    echo "for 8B; PyTorch unlimited 15,619 tokens/s for 3.6B; targets: 3.6B >= 14,600 tokens/s, 8B >= 30% MFU):"
    echo
    echo '```'
    grep '^plan: ' "$log_dir/$bench.log" || true
    printf '%-24s %12s %10s\n' implementation tokens/s TFLOP/s
    printf '%-24s %12s %10s\n' "strata $bench" "$(result_field "$log_dir/$bench.log" tokens_per_s)" \
      "$(result_field "$log_dir/$bench.log" tflops)"
    echo '```'
  done
  if [[ -f "$log_dir/profile-3.6b/report.txt" ]]; then
    echo
    echo "Where the 3.6B paged bf16 step goes (strata profile; host time on the training thread):"
    echo
    echo '```'
    sed -n '/^the step.s critical path/,/^notes:/p' "$log_dir/profile-3.6b/report.txt" | grep -v '^notes:'
    echo '```'
  fi
}

echo
tables | tee "$summary"
echo
echo "gpu_check: summary in $summary, logs in $log_dir"
if [[ $failed -ne 0 ]]; then
  echo "gpu_check: FAILED"
  exit 1
fi
echo "gpu_check: every step that ran passed ($skipped skipped)"
