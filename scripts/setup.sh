#!/usr/bin/env bash
# Create .venv (if missing) and install llm-cluster with its serving, Triton, S3 and test extras.
# torch is installed first and pinned, so pip never resolves a multi-GB CUDA build on a
# CPU-only machine (here torch==2.13.0 comes from a local CPU wheel). Override with
# TORCH_SPEC, e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  # shellcheck disable=SC2086
  python -m pip install -q ${TORCH_SPEC:-torch==2.13.0}
fi
python -m pip install -q -e ".[serve,triton,s3,bench,test]"
