#!/usr/bin/env bash
# Set up, lint, and run the whole test suite (CPU; gpu-marked tests skip without CUDA).
#   scripts/test.sh                  everything (~30 min on 2 cores): what CI runs
#   scripts/test.sh --fast           the fast tier (-m "not slow", ~5 min): the working loop
#   scripts/test.sh tests/engine/... a file or test: one pytest, as given
# Every run prints its 20 slowest tests (CI keeps them in its log).
# Without paths the suite runs as two streams side by side, each about half the wall time:
#   1. tests/cluster less the tests in APART: Ray and Serve in the pytest process itself;
#   2. the tests in APART, then everything outside tests/cluster (CPU-bound, one thread each).
# The fast tier keeps APART in stream 1: there the tests outside tests/cluster are the long pole.
# APART's tests start Ray only in subprocesses of their own (`cluster serve --address local`,
# `ray start --head`, `cluster bench`), under a Ray temp directory of their own (RAY_TMPDIR), so
# neither stream's Ray is the other's: nothing joins a Ray it merely finds running (the engine
# joins what `ray.init()` would: RAY_ADDRESS or the temp directory's `ray start` address) and
# nothing runs `ray stop`, which would stop every Ray on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
APART=(tests/cluster/cli tests/cluster/bench/test_bench.py)
if [[ "${1:-}" == "--fast" ]]; then
  shift
  set -- -m "not slow" "$@"
  APART=()
fi
for arg in "$@"; do
  if [[ -e "${arg%%::*}" ]]; then
    exec python -m pytest -q --durations=20 "$@"
  fi
done
ignore_apart=()
for path in "${APART[@]}"; do
  ignore_apart+=("--ignore=$path")
done
# pytest exits 5 when a selection (-m ...) leaves a part with no tests: not a failure.
passed() { [[ "$1" == 0 || "$1" == 5 ]]; }
second_log=$(mktemp)
ray_tmp=$(mktemp -d /tmp/ray-apart.XXXXXX)  # short: Ray's socket paths are limited
(
  apart_rc=0
  if ((${#APART[@]})); then
    RAY_TMPDIR=$ray_tmp python -m pytest -q --durations=20 "${APART[@]}" "$@" || apart_rc=$?
  fi
  rest_rc=0
  python -m pytest -q --durations=20 --ignore=tests/cluster "$@" || rest_rc=$?
  passed "$apart_rc" && passed "$rest_rc"
) >"$second_log" 2>&1 &
second=$!
first_rc=0
python -m pytest -q --durations=20 tests/cluster "${ignore_apart[@]}" "$@" || first_rc=$?
second_rc=0
wait "$second" || second_rc=$?
echo "========= ${APART[*]:+${APART[*]}, then }tests outside tests/cluster ========="
cat "$second_log"
rm -rf "$second_log" "$ray_tmp"
passed "$first_rc" && passed "$second_rc"
