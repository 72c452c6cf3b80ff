#!/usr/bin/env bash
# Set up, lint, and run the whole test suite (CPU; gpu-marked tests skip without CUDA).
#   scripts/test.sh                  everything (~17 min on 2 cores)
#   scripts/test.sh -m "not slow"    the fast tier
#   scripts/test.sh tests/engine/... a file or test: one pytest, as given
# Without paths the suite runs as two pytest processes side by side: tests/cluster (Ray, Serve:
# mostly waiting on processes, about half a core) and the rest (CPU-bound, one thread each).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for arg in "$@"; do
  if [[ -e "${arg%%::*}" ]]; then
    exec python -m pytest -q --durations=15 "$@"
  fi
done
others_log=$(mktemp)
python -m pytest -q --durations=15 --ignore=tests/cluster "$@" >"$others_log" 2>&1 &
others=$!
cluster_rc=0
python -m pytest -q --durations=15 tests/cluster "$@" || cluster_rc=$?
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
