"""``LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2)`` on a machine with fewer
cores than workers: a Ray it starts itself offers a logical CPU per worker; a cluster that can
never hold the workers fails at once, naming the shortfall, instead of waiting for placement."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from engine import LLM

ROOT = Path(__file__).resolve().parents[3]
ENGINE_ARGS = {"num_kv_blocks": 64, "max_model_len": 256, "device": "cpu"}

SCRIPT = """
import ray
from engine import LLM, SamplingParams
llm = LLM("builtin:tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2,
          num_kv_blocks=64, max_model_len=256, device="cpu")
out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print("TOKENS", len(out[0].outputs[0].token_ids), "CPUS", ray.cluster_resources()["CPU"])
"""


def test_a_local_ray_it_starts_offers_a_cpu_per_worker() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("TOKENS"))
    _, tokens, _, cpus = line.split()
    assert int(tokens) == 4
    assert float(cpus) >= max(os.cpu_count() or 1, 4)


def test_a_cluster_too_small_for_the_workers_fails_at_once_naming_the_shortfall() -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            LLM("builtin:tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2,
                **ENGINE_ARGS)  # fmt: skip
        assert time.monotonic() - start < 60
        message = str(info.value)
        assert "4 workers need 4 CPU" in message and "has 2 CPU" in message and "2 short" in message
    finally:
        ray.shutdown()


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow
