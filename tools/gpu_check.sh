#!/usr/bin/env bash
# One command for a GPU machine: runs the GPU tests of an existing build, the op parity runner
# in perf mode, and prints a summary table last. Builds nothing.
#
#   tools/gpu_check.sh [BUILD_DIR]          (default: build-gpu, relative to the repository)
#   SANITIZE=1 tools/gpu_check.sh           also runs the parity runner under compute-sanitizer
#   SANITIZE=1 SANITIZE_TOOLS="memcheck racecheck synccheck initcheck" tools/gpu_check.sh
#
# Exits 0 when every step passed, 1 otherwise (a machine without a visible CUDA device fails:
# this script is for GPU machines).
set -u -o pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-build-gpu}"
[[ "$build" = /* ]] || build="$repo/$build"
test_gpu="$build/tests/test_gpu"
sanitize="${SANITIZE:-0}"
sanitize_tools="${SANITIZE_TOOLS:-memcheck}"

if [[ ! -x "$test_gpu" ]]; then
  echo "gpu_check: $test_gpu not found; build first, e.g." >&2
  echo "  cmake -S $repo -B $build -G Ninja -DSTRATA_CUDA=ON && ninja -C $build" >&2
  exit 1
fi

log_dir="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
names=()
results=()
seconds=()
failed=0

# run NAME CMD...: runs a step, tees its output to $log_dir/NAME.log, records the outcome.
run() {
  local name="$1"
  shift
  echo
  echo "==== $name: $*"
  local start=$SECONDS
  "$@" 2>&1 | tee "$log_dir/$name.log"
  local rc=${PIPESTATUS[0]}
  local result=PASS
  if [[ $rc -eq 77 ]]; then
    result="FAIL (no CUDA device visible)"
  elif [[ $rc -ne 0 ]]; then
    result="FAIL (exit $rc)"
  fi
  [[ $result == PASS ]] || failed=1
  names+=("$name")
  results+=("$result")
  seconds+=($((SECONDS - start)))
}

# ctest reports a test that exits 77 as skipped, which is a failure on a GPU machine.
ctest_gpu() {
  local out rc
  out="$(cd "$build" && ctest -L gpu --output-on-failure 2>&1)"
  rc=$?
  printf '%s\n' "$out"
  [[ $rc -eq 0 ]] || return $rc
  if grep -q "No tests were found" <<< "$out"; then return 1; fi
  if grep -q "Skipped" <<< "$out"; then return 77; fi
  return 0
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
run ctest ctest_gpu
# Again on its own so the log shows every tensor's error margins (ctest hides passing output).
run model "$test_gpu" --gtest_filter='*ModelParity*'
run perf "$test_gpu" --perf --gtest_filter='OpsPerf.*'
if [[ "$sanitize" == 1 ]]; then
  if ! command -v compute-sanitizer > /dev/null; then
    names+=("sanitize"); results+=("FAIL (compute-sanitizer not on PATH)"); seconds+=(0)
    failed=1
  else
    for tool in $sanitize_tools; do
      run "sanitize-$tool" compute-sanitizer --tool "$tool" --error-exitcode 99 \
        "$test_gpu" --gtest_filter='OpsParity.*:MoeParity.*:*ModelParity*'
    done
  fi
fi

echo
echo "==== perf (achieved vs ceiling measured in the same run)"
if grep -q '^PERF|' "$log_dir/perf.log" 2>/dev/null; then
  printf '%-24s %-36s %10s %-8s %7s\n' op shape achieved unit "%ceil"
  grep '^PERF|' "$log_dir/perf.log" | while IFS='|' read -r _ op shape ms value unit ceiling pct; do
    printf '%-24s %-36s %10s %-8s %7s\n' "$op" "$shape" "$value" "$unit" "$pct"
  done
else
  echo "(no perf lines)"
fi

echo
echo "==== summary (logs in $log_dir)"
printf '%-22s %-36s %8s\n' step result seconds
for i in "${!names[@]}"; do
  printf '%-22s %-36s %8s\n' "${names[$i]}" "${results[$i]}" "${seconds[$i]}"
done
if [[ $failed -ne 0 ]]; then
  echo "gpu_check: FAILED"
  exit 1
fi
echo "gpu_check: all passed"
