#!/usr/bin/env bash
# Set up, then generate with the built-in tiny model (random weights, real tokenizer) on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
cluster generate "The capital of France is" "Once upon a time" --max-tokens 24
