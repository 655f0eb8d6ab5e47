#!/usr/bin/env bash
# The planner's step time against the engine's, held to the 15% target: runs the plan accuracy
# test (tests/train/plan_accuracy_test.cpp) with STRATA_PLAN_TIME_TOL=0.15 and prints its table
# (each config's tier peaks, bytes moved per step and step time, planned beside measured, and
# their ratio). Run it on a quiet machine: the test suite checks only the bytes and prints the
# times unchecked, because the CPU model and a neighbour's load move the rates it measured.
#
#   tools/plan_accuracy_bench.sh [BUILD_DIR] [TOLERANCE]
#
# BUILD_DIR defaults to build, TOLERANCE to 0.15 (relative). Exit status: the test's.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-build}"
[[ "$build" = /* ]] || build="$repo/$build"
tol="${2:-0.15}"
bin="$build/tests/test_train"
[[ -x "$bin" ]] || { echo "plan_accuracy_bench: $bin not found; build first" >&2; exit 1; }
STRATA_PLAN_TIME_TOL="$tol" "$bin" --gtest_filter=PlanAccuracy.PlanMatchesTheEngineInBytes
