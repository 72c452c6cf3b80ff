"""A local Ray the engine started itself fits what the process asks of it next: a second
``LLM`` needing more workers than that Ray has CPUs restarts it with room once the first is
shut down; while an engine still runs on it, the refusal says why it was not restarted. An
``LLM`` dropped without shutdown (``del``, or out of scope, even inside a reference cycle)
frees its workers and placement group for the next.

Run in a fresh interpreter that sees one core (``os.cpu_count`` patched), so the first Ray is
started with 1 logical CPU whatever this machine has, with its own Ray temp directory (no
``ray start`` address) and no ``RAY_ADDRESS``, while another program's Ray (3 CPUs) runs on
this machine: an engine joins only what ``ray.init()`` would, never a Ray it finds running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.cluster.conftest import start_local_ray

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import json, os
os.cpu_count = lambda: 1
import ray
from engine import LLM, SamplingParams
from cluster.runtime.ray_executor import PlacementError

args = dict(num_kv_blocks=64, max_model_len=128, device="cpu")
greedy = SamplingParams(temperature=0, max_tokens=6)
report = {}

first = LLM("builtin:tiny-llama", distributed_executor_backend="ray", **args)
report["first_cpus"] = ray.cluster_resources()["CPU"]
report["first"] = first.generate("hello", greedy, use_tqdm=False)[0].outputs[0].token_ids
first.llm_engine.shutdown()

second = LLM("builtin:tiny-llama", tensor_parallel_size=2, **args)
report["second_cpus"] = ray.cluster_resources()["CPU"]
report["second"] = second.generate("hello", greedy, use_tqdm=False)[0].outputs[0].token_ids
try:
    LLM("builtin:tiny-llama", tensor_parallel_size=4, **args)
except PlacementError as exc:
    report["refusal"] = str(exc)
# Dropped without shutdown, as a script drops one LLM for the next: its workers and placement
# group go with it, so the next one on the same 2 CPUs starts, even from a reference cycle.
del second
third = LLM("builtin:tiny-llama", tensor_parallel_size=2, **args)
report["third"] = third.generate("hello", greedy, use_tqdm=False)[0].outputs[0].token_ids
third.itself = third
del third
fourth = LLM("builtin:tiny-llama", tensor_parallel_size=2, **args)
report["fourth"] = fourth.generate("hello", greedy, use_tqdm=False)[0].outputs[0].token_ids
fourth.llm_engine.shutdown()
print("REPORT", json.dumps(report))
"""


@pytest.mark.slow  # ~60 s: two local Ray starts in a fresh interpreter, five engines
def test_an_engine_started_ray_too_small_for_the_next_llm_is_restarted_with_room() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    env["LLM_CLUSTER_LOAD_TIMEOUT_S"] = "60"  # a placement that waits fails within a minute
    import ray

    start_local_ray(3)  # another program's Ray on this machine
    try:
        with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp") as ray_tmp:  # short paths
            env["RAY_TMPDIR"] = ray_tmp
            result = subprocess.run(
                [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                text=True, timeout=300,
            )  # fmt: skip
        assert ray.cluster_resources()["CPU"] == 3  # the other Ray was left alone
    finally:
        ray.shutdown()
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("REPORT "))
    report = json.loads(line.removeprefix("REPORT "))
    assert report["first_cpus"] == 1
    assert report["second_cpus"] == 2  # restarted for the two workers
    assert report["second"] == report["first"]  # TP = 2 on the new Ray equals TP = 1
    # The second engine still runs on it, so the Ray is not restarted under it.
    assert "4 workers need 4 CPU" in report["refusal"]
    assert "restarts it with room only while no engine of the process runs" in report["refusal"]
    assert report["third"] == report["fourth"] == report["first"]


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow
