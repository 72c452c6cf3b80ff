#!/usr/bin/env bash
# Set up, lint, and run the whole test suite (CPU; gpu-marked tests skip without CUDA).
#   scripts/test.sh                  everything (32-35 min on 2 cores): what CI runs
#   scripts/test.sh --fast           the fast tier (-m "not slow", ~4 min): the working loop
#   scripts/test.sh tests/engine/... a file or test: one pytest, as given
# Every run prints its 20 slowest tests (CI keeps them in its log).
# Without paths the suite runs as two streams of pytest processes side by side (below).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# A crash after the last test (interpreter shutdown, where pytest's own fault handler is off)
# still prints every thread's Python stack: one such crash, rc 139, was seen on 2026-12-06.
export PYTHONFAULTHANDLER=1
if [[ "${1:-}" == "--fast" ]]; then
  shift
  set -- -m "not slow" "$@"
fi
for arg in "$@"; do
  if [[ -e "${arg%%::*}" ]]; then
    exec python -m pytest -q --durations=20 "$@"
  fi
done
# Two pytest streams side by side, each about half the work in both tiers (BENCHMARKS.md,
# "The test suite's two streams"). Stream 1: tests/cluster/cli (its `ray stop` ends every Ray
# on the machine, so it runs while no other Ray does), then the rest of tests/cluster on one
# shared Ray (runtime/ and bench/ aside), then the Ray-free SPLIT dirs. Stream 2: the other
# Ray-free tests, then, once the CLI tests are done, tests/cluster/runtime and bench/ (each
# runtime module its own local Ray, bench/ a shared one of its own, all under a Ray temp
# directory of its own, so no engine there joins stream 1's Ray).
SPLIT=(tests/engine/worker tests/engine/client tests/llm_kernels tests/parallel)
OWN_RAY=(tests/cluster/runtime tests/cluster/bench)
marker=$(mktemp -d)
others_log=$(mktemp)
(
  rc=0
  python -m pytest -q --durations=20 --ignore=tests/cluster "${SPLIT[@]/#/--ignore=}" "$@" \
    || rc=$?
  while [[ ! -e "$marker/cli-done" ]] && kill -0 $$ 2>/dev/null; do sleep 2; done
  ray_tmp=$(mktemp -d /tmp/ray2.XXXX)  # short: Ray's socket paths must fit 107 bytes
  own_ray_rc=0
  # Their Ray's workers at nice 0, not Ray's 15: beside stream 1 (nice 0) a Serve app at 15
  # starves, and the soak's /health took 2.3 s at the median (BENCHMARKS.md, "Soak").
  RAY_TMPDIR=$ray_tmp RAY_worker_niceness=0 python -m pytest -q --durations=20 "${OWN_RAY[@]}" \
    "$@" || own_ray_rc=$?
  rm -rf "$ray_tmp"
  for r in "$rc" "$own_ray_rc"; do
    if [[ "$r" != 0 && "$r" != 5 ]]; then exit "$r"; fi
  done
) >"$others_log" 2>&1 &
others=$!
cli_rc=0
python -m pytest -q --durations=20 tests/cluster/cli "$@" || cli_rc=$?
touch "$marker/cli-done"
cluster_rc=0
python -m pytest -q --durations=20 tests/cluster --ignore=tests/cluster/cli \
  "${OWN_RAY[@]/#/--ignore=}" "$@" || cluster_rc=$?
split_rc=0
python -m pytest -q --durations=20 "${SPLIT[@]}" "$@" || split_rc=$?
others_rc=0
wait "$others" || others_rc=$?
echo "==================== stream 2: Ray-free tests, then tests/cluster/runtime and bench ===================="
cat "$others_log"
rm -rf "$others_log" "$marker"
# pytest exits 5 when a selection (-m ...) leaves one part with no tests: not a failure.
for rc in "$cli_rc" "$cluster_rc" "$split_rc" "$others_rc"; do
  if [[ "$rc" != 0 && "$rc" != 5 ]]; then
    exit "$rc"
  fi
done
