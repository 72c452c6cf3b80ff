#!/usr/bin/env bash
# Set up, lint, and run the whole test suite (CPU; gpu-marked tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python -m pytest -q --durations=15 "$@"
