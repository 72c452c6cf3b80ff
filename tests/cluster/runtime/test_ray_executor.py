"""Tensor and pipeline parallelism through the RayExecutor, on CPU with gloo and a local Ray.

Reference: the same engine with TP = PP = 1 in-process (itself checked token-for-token against
HF transformers). Chunked prefill is on with a small token budget, so prompts are split across
steps while other requests decode.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine import LLM, EngineDeadError, SamplingParams
from engine.config import EngineConfig

PROMPTS = [
    "hello",
    "the quick brown fox",
    "once upon a time there was a little dragon who",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "Paris is the capital of",
    "one two three four five six seven eight nine ten eleven twelve thirteen",
    "why",
    "the rain in spain falls mainly on the plain, said the professor again",
]
# Alone, with the 16-token budget below, its first steps compute prompt chunks and sample nothing.
LONG_PROMPT = (
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen"
)
GREEDY = SamplingParams(temperature=0, max_tokens=16)
# 16-token budget: the longer prompts are prefilled in several chunks beside running decodes.
ENGINE_ARGS: dict[str, Any] = {
    "num_kv_blocks": 128,
    "max_num_batched_tokens": 16,
    "enable_chunked_prefill": True,
    "max_model_len": 256,
    "device": "cpu",  # the gloo tier, even on a machine with GPUs
}
SHAPES = [(2, 1), (1, 2), (2, 2), (4, 1)]  # (tensor_parallel_size, pipeline_parallel_size)
MODELS = ["builtin:tiny-llama", "builtin:tiny-qwen2"]  # 4 heads / 2 KV heads; qwen2 ties lm_head


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, Any]]:
    """model -> greedy tokens and parameter bytes of the in-process TP = PP = 1 engine."""
    results = {}
    for model in MODELS:
        llm = LLM(model, distributed_executor_backend="uni", **ENGINE_ARGS)
        (param_bytes,) = llm.llm_engine.executor.collective_rpc("parameter_bytes")
        results[model] = {
            "tokens": _greedy(llm, PROMPTS),
            "long_prompt_tokens": _greedy(llm, [LONG_PROMPT]),
            "param_bytes": param_bytes,
        }
        llm.llm_engine.shutdown()
    return results


def _greedy(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(
    scope="module",
    params=[(m, t, p) for m in MODELS for t, p in SHAPES],
    ids=lambda c: f"{c[0].removeprefix('builtin:')}-tp{c[1]}-pp{c[2]}",
)
def parallel_llm(request: pytest.FixtureRequest) -> Iterator[tuple[LLM, str, int, int]]:
    model, tp, pp = request.param
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE_ARGS)
    yield llm, model, tp, pp
    llm.llm_engine.shutdown()


def test_parallel_engine_runs_on_ray_worker_actors(parallel_llm: tuple[LLM, str, int, int]) -> None:
    llm, _, tp, pp = parallel_llm
    executor = llm.llm_engine.executor
    assert type(executor).__name__ == "RayExecutor"
    assert len(executor.workers) == tp * pp


def test_greedy_tokens_equal_single_worker(
    parallel_llm: tuple[LLM, str, int, int], reference: dict[str, dict[str, Any]]
) -> None:
    llm, model, _, _ = parallel_llm
    assert _greedy(llm, PROMPTS) == reference[model]["tokens"]


def test_lone_long_prompt_in_chunks_equals_single_worker(
    parallel_llm: tuple[LLM, str, int, int], reference: dict[str, dict[str, Any]]
) -> None:
    llm, model, _, _ = parallel_llm
    assert _greedy(llm, [LONG_PROMPT]) == reference[model]["long_prompt_tokens"]


def test_each_worker_holds_its_share_of_the_parameters(
    parallel_llm: tuple[LLM, str, int, int], reference: dict[str, dict[str, Any]]
) -> None:
    llm, model, tp, pp = parallel_llm
    config: EngineConfig = llm.llm_engine.config
    total = reference[model]["param_bytes"]
    hf = config.model.hf_config
    if hf.get("tie_word_embeddings") and pp > 1:
        # Tied LM head: with one stage it is the embedding itself; across stages the last one
        # needs its own copy of the (vocabulary-split) matrix.
        total += hf["vocab_size"] * hf["hidden_size"] * config.model.torch_dtype.itemsize
    per_worker = llm.llm_engine.executor.collective_rpc("parameter_bytes")
    share = total / (tp * pp)
    # Slack for what every TP rank replicates: norms, row-parallel biases, KV heads when
    # TP > num_key_value_heads, and vocabulary padding.
    for rank, nbytes in enumerate(per_worker):
        assert share * 0.97 <= nbytes <= share * 1.12, (rank, nbytes, share)


def test_single_worker_through_ray_equals_in_process_executor(
    reference: dict[str, dict[str, Any]],
) -> None:
    llm = LLM("builtin:tiny-llama", distributed_executor_backend="ray", **ENGINE_ARGS)
    try:
        assert len(llm.llm_engine.executor.workers) == 1
        assert _greedy(llm, PROMPTS) == reference["builtin:tiny-llama"]["tokens"]
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def killed_engine() -> Iterator[dict[str, Any]]:
    """Generate with TP = 2 and kill worker rank 1 after a few steps, mid-generation."""
    llm = LLM("builtin:tiny-llama", tensor_parallel_size=2, **ENGINE_ARGS)
    engine = llm.llm_engine
    executor = engine.executor
    pg = executor._pg
    survivor, victim = executor.workers
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=150))
    # The time the kill was asked for: the engine may see the worker die before ``ray.kill``
    # returns on the killing thread.
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        ray.kill(victim, no_restart=True)

    error: EngineDeadError | None = None
    steps = 0
    killer = threading.Thread(target=kill)
    try:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            if steps == 3:
                killer.start()
    except EngineDeadError as exc:
        error = exc
    failed_at = time.monotonic()
    if killer.is_alive():
        killer.join()
    yield {
        "engine": engine,
        "error": error,
        "seconds_to_fail": failed_at - killed_at[0] if killed_at else None,
        "pg": pg,
        "survivor": survivor,
    }
    engine.shutdown()


def test_killing_a_worker_fails_in_flight_requests_within_30_s(
    killed_engine: dict[str, Any],
) -> None:
    assert isinstance(killed_engine["error"], EngineDeadError)
    assert killed_engine["engine"].has_unfinished_requests()
    assert killed_engine["seconds_to_fail"] < 30


def test_dead_engine_refuses_new_requests(killed_engine: dict[str, Any]) -> None:
    with pytest.raises(EngineDeadError):
        killed_engine["engine"].add_request("late", "hello", GREEDY)


def test_dead_engine_refuses_to_step(killed_engine: dict[str, Any]) -> None:
    with pytest.raises(EngineDeadError):
        killed_engine["engine"].step()


def test_check_health_reports_the_dead_worker(killed_engine: dict[str, Any]) -> None:
    with pytest.raises(EngineDeadError):
        killed_engine["engine"].check_health()


def test_dead_executor_kills_surviving_workers_and_removes_its_placement_group(
    killed_engine: dict[str, Any],
) -> None:
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(killed_engine["survivor"].ping.remote(), timeout=30)
    state = ray.util.placement_group_table(killed_engine["pg"])["state"]
    assert state == "REMOVED"


def _assigned_resources(actor: Any) -> dict[str, float]:
    """Run in a worker actor (``__ray_call__``): the resources Ray gave it."""
    return dict(ray.get_runtime_context().get_assigned_resources())


class ExecutorHost:
    """Stands in for a Serve replica: an actor in bundle 0 of a placement group it did not make."""

    def run(self, config: EngineConfig) -> dict[str, Any]:
        from cluster.runtime.ray_executor import RayExecutor

        executor = RayExecutor(config)
        try:
            return {
                "pg_id": executor._pg.id.hex(),
                "owns_pg": executor._owns_pg,
                "param_bytes": executor.collective_rpc("parameter_bytes"),
                "assigned": ray.get(
                    [w.__ray_call__.remote(_assigned_resources) for w in executor.workers]
                ),
            }
        finally:
            executor.shutdown()


def _executor_host(pg: Any) -> Any:
    """An ``ExecutorHost`` actor in bundle 0 of ``pg``, as a replica is in its group. It imports
    this module (its class) and the project."""
    here = Path(__file__).resolve()
    pythonpath = os.pathsep.join([str(here.parents[3]), str(here.parent)])
    return (
        ray.remote(ExecutorHost)
        .options(
            num_cpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0
            ),
            runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
        )
        .remote()
    )


def test_executor_inside_a_placement_group_uses_its_bundles_and_leaves_it_in_place() -> None:
    config = EngineConfig.from_kwargs(
        model="builtin:tiny-llama", tensor_parallel_size=2, **ENGINE_ARGS
    )
    pg = ray.util.placement_group([{"CPU": 1}] * 3)
    ray.get(pg.ready(), timeout=60)
    host = _executor_host(pg)
    try:
        result = ray.get(host.run.remote(config), timeout=120)
        assert result["pg_id"] == pg.id.hex()
        assert not result["owns_pg"]
        assert len(result["param_bytes"]) == 2
        assert ray.util.placement_group_table(pg)["state"] == "CREATED"
    finally:
        ray.kill(host)
        ray.util.remove_placement_group(pg)


def test_one_worker_takes_the_fraction_its_bundle_holds() -> None:
    # A one-worker replica's placement group with half a device in its worker bundle
    # (placement_group_config.bundles: [{CPU: 0.5}] on a CPU deployment, on the ray backend):
    # the executor finds the fractional slot (not the head's whole one) and its worker asks
    # for exactly 0.5.
    config = EngineConfig.from_kwargs(
        model="builtin:tiny-llama", distributed_executor_backend="ray", **ENGINE_ARGS
    )
    pg = ray.util.placement_group([{"CPU": 1}, {"CPU": 1}, {"CPU": 0.5}])
    ray.get(pg.ready(), timeout=60)
    host = _executor_host(pg)
    try:
        result = ray.get(host.run.remote(config), timeout=120)
        assert result["pg_id"] == pg.id.hex()
        assert len(result["param_bytes"]) == 1
        assert result["assigned"] == [{"CPU": 0.5}]
    finally:
        ray.kill(host)
        ray.util.remove_placement_group(pg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ray_executor_on_cuda_equals_in_process_executor() -> None:
    args = {**ENGINE_ARGS, "device": "cuda"}
    local = LLM("builtin:tiny-llama", distributed_executor_backend="uni", **args)
    expected = [o.outputs[0].token_ids for o in local.generate(PROMPTS, GREEDY, use_tqdm=False)]
    local.llm_engine.shutdown()
    remote = LLM("builtin:tiny-llama", distributed_executor_backend="ray", **args)
    try:
        assert type(remote.llm_engine.executor).__name__ == "RayExecutor"
        outputs = remote.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        remote.llm_engine.shutdown()


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_embeddings_with_tp2_pp2_equal_one_worker(pooling_type: str) -> None:
    # Mean pooling sums chunk by chunk on the driver (TP rank 0 of the last stage) only.
    prompts = [LONG_PROMPT, "Hi"]
    args = {**ENGINE_ARGS, "pooling_type": pooling_type}
    single = LLM("builtin:tiny-llama", distributed_executor_backend="uni", **args)
    expected = [o.outputs.embedding for o in single.embed(prompts, use_tqdm=False)]
    single.llm_engine.shutdown()
    llm = LLM("builtin:tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2, **args)
    try:
        got = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
        for g, e in zip(got, expected, strict=True):
            assert g == pytest.approx(e, abs=1e-5)
        assert llm.llm_engine.executor.collective_rpc("num_request_states") == [0] * 4
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    ("model", "extra"),
    [
        ("builtin:tiny-qwen3-classifier", {}),  # score.weight on the last stage
        # A tied causal LM as a classifier: the score rows come from the embedding (stage 0's
        # tensor) into the last stage's score.
        ("builtin:tiny-qwen2", {"hf_overrides": {"classifier_from_token": ["Ġno", "Ġthe"]}}),
        ("builtin:tiny-qwen3-embedding", {"runner": "pooling"}),  # names without "model."
    ],
)
def test_pooling_models_with_tp2_pp2_equal_one_worker(model: str, extra: dict[str, Any]) -> None:
    prompts = [LONG_PROMPT, "Hi"]
    args = {**ENGINE_ARGS, **extra}
    single = LLM(model, distributed_executor_backend="uni", **args)
    method = "embed" if extra.get("runner") == "pooling" else "classify"
    expected = [o.outputs.data for o in getattr(single, method)(prompts, use_tqdm=False)]
    single.llm_engine.shutdown()
    llm = LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2, **args)
    try:
        got = [o.outputs.data for o in getattr(llm, method)(prompts, use_tqdm=False)]
        for g, e in zip(got, expected, strict=True):
            assert g == pytest.approx(e, abs=1e-5)
    finally:
        llm.llm_engine.shutdown()


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
# 8 logical CPUs: the 4 single-CPU bundles of TP = 4 fit with room to spare.
pytestmark = [pytest.mark.slow, pytest.mark.local_ray(num_cpus=8)]
