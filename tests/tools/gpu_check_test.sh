#!/usr/bin/env bash
# tools/gpu_check.sh's own logic, without a GPU (its dry run, GPU_DEVICE=cpu): the test groups
# it lists and runs one process each, the library path it sets up, a failing and a hanging step
# that do not stop the later ones, the time budget, the summary file, and a missing build.
# It runs against a stand-in build folder (a test_gpu that lists suites as gtest does), and also
# against this build's real test_gpu when it has one.
#
#   tests/tools/gpu_check_test.sh SOURCE_DIR BINARY_DIR
set -u -o pipefail

src="${1:?usage: gpu_check_test.sh SOURCE_DIR BINARY_DIR}"
bin="${2:?usage: gpu_check_test.sh SOURCE_DIR BINARY_DIR}"
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_test.XXXXXX")"
trap 'rm -rf "$work"' EXIT
check="$src/tools/gpu_check.sh"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# A stand-in build: test_gpu lists like gtest (a plain suite, a parameterised one, the model
# groups and the perf runner), and only when the packed libraries are on the library path.
fake="$work/build with space"
mkdir -p "$fake/tests" "$fake/devlibs"
cat > "$fake/tests/test_gpu" <<'EOF'
#!/usr/bin/env bash
here="$(cd "$(dirname "$0")/.." && pwd)"
case ":${LD_LIBRARY_PATH:-}:" in *":$here/devlibs:"*) ;; *) echo "devlibs not on the library path" >&2; exit 5 ;; esac
[[ "$1" == --gtest_list_tests ]] || exit 9
printf '%s\n' 'CudaDevice.' '  Creates' 'OpsParity.' '  Rmsnorm' 'Variants/ModelParity.' '  Dense/0  # GetParam() = x' \
  'ModelParityErrors.' '  Names' 'OpsPerf.' '  Gemm' 'Typed/Quant.  # TypeParam = int' '  Rounds'
EOF
printf '#!/bin/sh\nexit 0\n' > "$fake/strata"
chmod +x "$fake/tests/test_gpu" "$fake/strata"

# dry NAME [VAR=VALUE...]: a dry run on the stand-in build; output in $work/NAME.out, summary in
# $work/NAME.md, exit status in $rc.
dry() {
  local name="$1"
  shift
  env GPU_DEVICE=cpu TRAIN_BENCH=1 PAGED_BENCH=1 SUMMARY="$work/$name.md" LOG_DIR="$work/$name-logs" "$@" \
    bash "$check" "$fake" > "$work/$name.out" 2>&1
  rc=$?
}
# row NAME STEP: the step's result in run NAME's summary table.
row() { sed -n "s/^$2 \{1,\}\(.*[^ ]\) \{1,\}[0-9]\{1,\}\$/\1/p" "$work/$1.md"; }
expect_row() {  # expect_row RUN STEP PATTERN
  local got
  got="$(row "$1" "$2")"
  [[ "$got" == $3 ]] || fail "$1: step $2 is '${got}', expected '$3' (see $work/$1.out)"
}

dry plain
[[ $rc -eq 0 ]] || { fail "plain dry run exited $rc"; cat "$work/plain.out"; }
expect_row plain ops-CudaDevice PASS
expect_row plain ops-OpsParity PASS
expect_row plain ops-Typed-Quant PASS
expect_row plain model PASS
expect_row plain train-cuda PASS
expect_row plain perf PASS
expect_row plain train-strata PASS
expect_row plain paged-3.6b PASS
expect_row plain paged-3.6b-fp8 PASS
grep -q -- "bench train-gpu .*--preset 3.6b.* --precision fp8" "$work/plain.out" ||
  fail "plain: the fp8 paged benchmark does not ask for the fp8 recipe"
expect_row plain profile-3.6b PASS
grep -q -- "strata profile model.preset=llama3-8b .*memory.device=24GiB.* --out " "$work/plain.out" ||
  fail "plain: the profile step does not profile the 3.6B shape under 24 GiB into the log folder"
grep -q -- "--gtest_filter=Variants/ModelParity\.\*:ModelParityErrors\.\*" "$work/plain.out" ||
  fail "plain: the model step does not run both model groups in one filter"
grep -q "^ops-OpsPerf" "$work/plain.md" && fail "plain: the perf runner ran as an op group"
# The steps in order of value: op groups, model, training, perf, benchmarks.
order="$(awk '/^total / { t = 0 } t { print $1 } /^step / { t = 1 }' "$work/plain.md" | tr '\n' ' ')"
[[ "$order" == "ops-CudaDevice ops-OpsParity ops-Typed-Quant model train-cuda perf train-strata train-torch paged-3.6b paged-3.6b-fp8 profile-3.6b " ]] ||
  fail "plain: steps ran in the order '$order'"

dry faults TIMEOUT_SCALE=0.02 GPU_CHECK_FAKE="ops-OpsParity=fail,model=hang"
[[ $rc -eq 1 ]] || fail "faults: exited $rc, expected 1"
expect_row faults ops-CudaDevice PASS
expect_row faults ops-OpsParity "FAIL (exit 3)"
expect_row faults ops-Typed-Quant PASS
expect_row faults model "FAIL (timed out after 3 s)"
expect_row faults train-cuda PASS
expect_row faults paged-3.6b PASS

dry budget TIMEOUT_SCALE=0.02 BUDGET_S=2 GPU_CHECK_FAKE="ops-CudaDevice=hang"
[[ $rc -eq 1 ]] || fail "budget: exited $rc, expected 1"
expect_row budget ops-CudaDevice "FAIL (timed out after 2 s)"
expect_row budget train-cuda "SKIPPED (budget of 2 s spent)"
grep -q "^total .* 2 s budget; [1-9][0-9]* skipped" "$work/budget.md" || fail "budget: no skipped count"

rm "$fake/strata"
dry missing
[[ $rc -eq 1 ]] || fail "missing: exited $rc, expected 1"
grep -q "strata not found; build first" "$work/missing.out" || fail "missing: no message naming the binary"
[[ -e "$work/missing.md" ]] && fail "missing: wrote a summary"

# This build's own test_gpu (a CUDA-enabled build): its real listing needs no device.
if [[ -x "$bin/tests/test_gpu" && -x "$bin/strata" ]]; then
  GPU_DEVICE=cpu SUMMARY="$work/real.md" LOG_DIR="$work/real-logs" bash "$check" "$bin" > "$work/real.out" 2>&1
  rc=$?
  [[ $rc -eq 0 ]] || { fail "real build: dry run exited $rc"; tail -20 "$work/real.out"; }
  grep -q "^ops-OpsParity \+PASS" "$work/real.md" || fail "real build: no OpsParity group"
  grep -q "^model \+PASS" "$work/real.md" || fail "real build: no model step"
  grep -q "^ops-Fp8Parity \+PASS" "$work/real.md" || fail "real build: no Fp8Parity group"
  grep -q -- "--gtest_filter=.*Fp8ModelParity" "$work/real.out" || fail "real build: the model step lacks the fp8 decoder"
else
  echo "no test_gpu in $bin (a build without CUDA): the real listing is not checked"
fi

if [[ $failures -ne 0 ]]; then
  echo "gpu_check_test: $failures failures"
  exit 1
fi
echo "gpu_check_test: all passed"
