#!/usr/bin/env bash
# The whole GPU acceptance in one command, on a machine with a CUDA GPU, from a fresh checkout,
# no Ray and no package index needed:
#
#   bash scripts/gpu-check.sh [OUT_DIR]      # OUT_DIR default: $OUT if set, else gpu-check-out/
#
# Steps (GPU_CHECK_STEPS="tests kernels throughput peer serving" picks some; each is bounded by
# its own timeout: 540 + 120 + 180 + 60 s, and 150 s for the peer). On an H200 with a cold Triton
# cache (a fresh machine) the tests take about 9 minutes and the benchmarks about 3, so where one
# call may last 10 minutes, run GPU_CHECK_STEPS=tests in one call and the rest in a second:
#   tests       python -m pytest -m gpu on the test files that hold gpu tests (tests/cluster only
#               when Ray is importable); multi-GPU cases skip below 2 / 4 GPUs. Each result is
#               printed as it comes (-v); at the step's timeout pytest gets SIGINT first, so it
#               still prints the failures so far with their tracebacks
#   kernels     benchmarks/kernels.py: decode attention bandwidth, decode step eager vs graphs,
#               FP8 / W4A16 GEMMs vs bf16 at Llama-3-70B's TP-2 layer shapes
#   throughput  benchmarks/engine_throughput.py: offline engine throughput, CUDA graphs on and
#               off, a device-synced step profile, the measured KV budget
#   peer        the same workload through vLLM, when vllm is importable (else skipped)
#   serving     benchmarks/serving_smoke.py: TP = 1 streaming through AsyncLLMEngine in-process
#               (the OpenAI app needs FastAPI and lives in cluster/, so it is not used here)
#
# Writes to OUT_DIR: summary.txt (one line per step: passed / FAILED / skipped, why), log.txt
# (everything printed), pytest-gpu.txt, kernels.json, engine_throughput.json,
# vllm_throughput.json, serving_smoke.json. Exit status 1 when a step failed.
#
# Packages: the engine imports msgspec and xgrammar (+ pydantic, apache-tvm-ffi), which a bare
# GPU image may lack; when they do not import and .whl/ holds wheels (scripts/gpu-wheels.sh,
# run where an index is reachable; carry .whl with the checkout), they are installed from there
# into a scratch directory, offline. Nothing else is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${1:-${OUT:-gpu-check-out}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-python3}
STEPS=${GPU_CHECK_STEPS:-tests kernels throughput peer serving}
SUMMARY=$OUT_DIR/summary.txt
: >"$SUMMARY"
exec > >(tee "$OUT_DIR/log.txt") 2>&1

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export LLM_CLUSTER_CACHE_DIR=${LLM_CLUSTER_CACHE_DIR:-$ROOT/.cache/llm-cluster}
unset TRITON_INTERPRET  # Triton compiles for the GPU here

note() { echo "$*" | tee -a "$SUMMARY"; }
failed=0

# step NAME TIMEOUT_S COMMAND...: run it, record passed / FAILED (exit status) / timed out.
# With STEP_LOG set, its output is also written there. At the timeout the command gets SIGINT
# (pytest then reports what it has), and SIGKILL 20 s later.
step() {
  local name=$1 limit=$2 rc
  shift 2
  echo "=== $name: $*"
  local start=$SECONDS
  if [ -n "${STEP_LOG:-}" ]; then
    timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee "$STEP_LOG"
    rc=${PIPESTATUS[0]}
  else
    timeout --signal=INT --kill-after=20 "$limit" "$@"
    rc=$?
  fi
  local took=$((SECONDS - start))
  if [ "$rc" -eq 0 ]; then
    note "$name: passed (${took}s)"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] || [ "$((SECONDS - start))" -ge "$limit" ]; then
    note "$name: FAILED, timed out after ${limit}s"
    failed=1
  else
    note "$name: FAILED, exit status $rc (${took}s)"
    failed=1
  fi
}

wants() { [[ " $STEPS " == *" $1 "* ]]; }

# ---- preflight -------------------------------------------------------------------------------
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  if [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
    note "preflight: FAILED, $PY sees no CUDA device (torch.cuda.is_available() is False)"
    exit 1
  fi
  # A dry run of this script on a CPU machine: gpu tests skip, benchmarks take CPU defaults.
  note "preflight: no CUDA device; GPU_CHECK_ALLOW_CPU=1, running on CPU"
  export TRITON_INTERPRET=1
else
  "$PY" - <<'EOF' | tee -a "$SUMMARY"
import platform, torch
props = torch.cuda.get_device_properties(0)
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "missing"
nccl = torch.cuda.nccl.version()
nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
print(
    f"device: {torch.cuda.device_count()} x {props.name}, {props.total_memory / 2**30:.1f} GiB; "
    f"torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL {nccl}); "
    f"triton {triton_version}; python {platform.python_version()}"
)
EOF
fi

if ! "$PY" -c "import msgspec, xgrammar" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=$(mktemp -d /tmp/llm-cluster-site.XXXX)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl || true
    export PYTHONPATH="$PYTHONPATH:$SITE"
  fi
fi
if ! "$PY" -c "import engine.worker.worker, engine.client.llm" 2>"$OUT_DIR/import-error.txt"; then
  note "preflight: FAILED, the engine does not import: $(tail -1 "$OUT_DIR/import-error.txt");"
  note "  run scripts/gpu-wheels.sh where a package index is reachable and carry .whl"
  exit 1
fi
rm -f "$OUT_DIR/import-error.txt"
note "preflight: passed (engine imports; steps: $STEPS)"

# ---- steps -----------------------------------------------------------------------------------
if wants tests; then
  mapfile -t files < <(grep -rl "pytest.mark.gpu" tests --include='test_*.py' | sort)
  if ! "$PY" -c "import ray" 2>/dev/null; then
    skipped=$(printf '%s\n' "${files[@]}" | grep '^tests/cluster/' | tr '\n' ' ')
    mapfile -t files < <(printf '%s\n' "${files[@]}" | grep -v '^tests/cluster/')
    [ -n "$skipped" ] && note "tests: Ray not importable, not collected: $skipped"
  fi
  timeout_opt=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && timeout_opt=(--timeout 180)
  STEP_LOG=$OUT_DIR/pytest-gpu.txt step tests 540 "$PY" -m pytest -m gpu -v -rfEs --tb=short \
    --durations=25 -p no:cacheprovider "${timeout_opt[@]}" "${files[@]}"
  note "  $(grep -E "[0-9]+ (passed|failed|skipped|error)" "$OUT_DIR/pytest-gpu.txt" | tail -1)"
fi

if wants kernels; then
  step kernels 120 "$PY" -m benchmarks.kernels --out "$OUT_DIR/kernels.json"
fi

if wants throughput; then
  step throughput 180 "$PY" -m benchmarks.engine_throughput --compare-eager \
    --out "$OUT_DIR/engine_throughput.json"
fi

if wants peer; then
  if "$PY" -c "import vllm" 2>/dev/null; then
    step peer 150 "$PY" -m benchmarks.engine_throughput --system vllm --no-profile \
      --out "$OUT_DIR/vllm_throughput.json"
  else
    note "peer: skipped, vllm is not importable by $PY"
  fi
fi

if wants serving; then
  step serving 60 "$PY" -m benchmarks.serving_smoke --out "$OUT_DIR/serving_smoke.json"
fi

echo "=== summary ($SUMMARY)"
cat "$SUMMARY"
exit "$failed"
