#!/usr/bin/env bash
# Set up, lint, and run the whole test suite (CPU; gpu-marked tests skip without CUDA).
#   scripts/test.sh                  everything (35-50 min on 2 cores): what CI runs
#   scripts/test.sh --fast           the fast tier (-m "not slow", ~5 min): the working loop
#   scripts/test.sh tests/engine/... a file or test: one pytest, as given
# Every run prints its 20 slowest tests (CI keeps them in its log).
# Without paths the suite runs as two pytest processes side by side: tests/cluster (Ray, Serve:
# mostly waiting on processes, about half a core) and the rest (CPU-bound, one thread each).
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
others_log=$(mktemp)
python -m pytest -q --durations=20 --ignore=tests/cluster "$@" >"$others_log" 2>&1 &
others=$!
cluster_rc=0
python -m pytest -q --durations=20 tests/cluster "$@" || cluster_rc=$?
others_rc=0
wait "$others" || others_rc=$?
echo "==================== tests outside tests/cluster ===================="
cat "$others_log"
rm -f "$others_log"
# pytest exits 5 when a selection (-m ...) leaves one half with no tests: not a failure.
for rc in "$cluster_rc" "$others_rc"; do
  if [[ "$rc" != 0 && "$rc" != 5 ]]; then
    exit "$rc"
  fi
done
