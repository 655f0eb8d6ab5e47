#!/usr/bin/env bash
# Fuzzes every input format for a fixed time each and fails on a crash, a sanitizer report, a
# slow input or one that needs too much memory.
#
#   tests/fuzz/run.sh BUILD_DIR [SECONDS]     (BUILD_DIR configured with STRATA_FUZZ=ON)
#
# SECONDS per target (default 25). FUZZ_JOBS targets run at once (default: the core count).
# FUZZ_SEED (default 1) fixes libFuzzer's mutation sequence, so a CI run explores the same inputs
# first every time and a finding reproduces; FUZZ_SEED=0 draws a new seed per run (longer
# explorations by hand).
# Inputs that fail are copied to BUILD_DIR/fuzz-findings/<target>/; add one to
# tests/fuzz/<target>/ as crash-<what> once it is fixed, so the suite replays it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:?usage: tests/fuzz/run.sh BUILD_DIR [SECONDS]}"
seconds="${2:-25}"
jobs="${FUZZ_JOBS:-$(nproc)}"
targets=(safetensors safetensors_index manifest train_config model_config tokenizer token_files)

cmake --build "$build" --target "${targets[@]/#/fuzz_}"

findings="$build/fuzz-findings"
rm -rf "$findings"
work="$(mktemp -d "${TMPDIR:-/tmp}/strata-fuzz-run.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# Leaks count as failures; any undefined behaviour stops the target at once.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

fuzz_one() {
  local t="$1" dir="$work/$1"
  mkdir -p "$dir/corpus" "$dir/artifacts"
  # New inputs go to the scratch corpus; the committed seeds are only read. -timeout: one input
  # running longer is a hang; -rss_limit_mb/-malloc_limit_mb: a header that sizes a huge
  # allocation is a bug (sizes read from files are bounded first).
  local rc=0
  timeout $((seconds + 120)) "$build/tests/fuzz_$t" -max_total_time="$seconds" -seed="${FUZZ_SEED:-1}" -timeout=10 \
    -rss_limit_mb=2048 -malloc_limit_mb=1024 -print_final_stats=1 \
    -artifact_prefix="$dir/artifacts/" "$dir/corpus" "$here/$t" >"$dir/log" 2>&1 || rc=$?
  local runs
  runs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$dir/log" | grep -o '[0-9]*$' || echo '?')"
  if ((rc != 0)) || compgen -G "$dir/artifacts/*" >/dev/null; then
    mkdir -p "$findings/$t"
    cp "$dir"/artifacts/* "$findings/$t/" 2>/dev/null || true
    # One write, so that the reports of targets running side by side do not interleave.
    echo "fuzz $t: FAILED (exit $rc) after $runs inputs; failing inputs in $findings/$t/; log tail:
$(tail -n 40 "$dir/log" | sed "s/^/  [$t] /")"
    return 1
  fi
  echo "fuzz $t: ok, $runs inputs in ${seconds}s"
}

failed=0
running=0
for t in "${targets[@]}"; do
  if ((running >= jobs)); then
    wait -n || failed=1
    running=$((running - 1))
  fi
  fuzz_one "$t" &
  running=$((running + 1))
done
while ((running > 0)); do
  wait -n || failed=1
  running=$((running - 1))
done
if ((failed)); then
  echo "fuzz: failures (see above)" >&2
  exit 1
fi
echo "fuzz: all ${#targets[@]} targets ran ${seconds}s each without a finding"
