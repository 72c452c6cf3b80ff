#!/usr/bin/env bash
# Set up, then serve the built-in tiny model (random weights, real tokenizer) on CPU:
# an OpenAI-compatible endpoint at http://127.0.0.1:8000/v1 until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
cluster serve configs/tiny.yaml
