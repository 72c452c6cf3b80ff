"""The Ray executor's two step dispatches: a Ray Compiled Graph (GPU workers' ``compiled``, forced
here) and one actor call per worker (CPU workers' ``tasks``), on CPU with TP = 2 and a local Ray.

Outputs are equal under both, steps may be in flight together, a message of several MB goes
through the compiled channels, and a worker killed mid-step ends the step at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from cluster.runtime.ray_executor import RayExecutor
from engine import LLM, EngineDeadError, SamplingParams
from engine.config import EngineConfig
from engine.worker.step_messages import (
    CachedRequestData,
    ExecuteModelRequest,
    ModelRunnerOutput,
    NewRequestData,
    empty_request,
    encode,
)
from tests.cluster.runtime.compiled_dispatch import forced

pytestmark = [pytest.mark.slow, pytest.mark.local_ray(num_cpus=4)]

MODEL = "builtin:tiny-llama"
NUM_BLOCKS = 64
ENGINE_ARGS: dict[str, Any] = {
    "num_kv_blocks": 128,
    "max_num_batched_tokens": 16,
    "enable_chunked_prefill": True,
    "max_model_len": 256,
    "device": "cpu",
}
PROMPTS = ["hello", "the quick brown fox", "once upon a time there was a little dragon who"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _executor(tp: int = 2, pp: int = 1) -> RayExecutor:
    config = EngineConfig.from_kwargs(
        model=MODEL,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="ray",
        num_kv_blocks=NUM_BLOCKS,
        device="cpu",
    )
    executor = RayExecutor(config)
    executor.initialize_cache(NUM_BLOCKS, 0)
    return executor


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["tp2", "pp2"])
def compiled_executor(request: pytest.FixtureRequest) -> Iterator[RayExecutor]:
    """TP = 2, and PP = 2, whose two stages each hold a step when two are in flight."""
    tp, pp = request.param
    executor = _executor(tp, pp)
    assert executor.max_concurrent_batches == pp  # LLM_CLUSTER_PP_PIPELINING on by default
    try:
        with forced("compiled"):  # the module's first step builds the dispatch
            yield executor
    finally:
        executor.shutdown()


def _first_step(req_id: str, prompt: list[int], blocks: list[int]) -> ExecuteModelRequest:
    """A new request; its whole prompt is scheduled when it is short, one token when long."""
    scheduled = len(prompt) if len(prompt) <= 16 else 1
    new = NewRequestData(
        req_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(temperature=0, max_tokens=None),
        block_ids=blocks,
        num_computed_tokens=0,
    )
    return ExecuteModelRequest(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={req_id: scheduled},
        total_num_scheduled_tokens=scheduled,
        finished_req_ids=[],
    )


def _decode_step(req_id: str, token: int, num_computed: int) -> ExecuteModelRequest:
    cached = CachedRequestData(
        req_id=req_id, new_token_ids=[token], new_block_ids=[], num_computed_tokens=num_computed
    )
    return ExecuteModelRequest(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[cached],
        num_scheduled_tokens={req_id: 1},
        total_num_scheduled_tokens=1,
        finished_req_ids=[],
    )


def _tokens(output: ModelRunnerOutput) -> list[list[int]]:
    return [list(t) for t in output.sampled_token_ids]


@pytest.mark.parametrize("dispatch", ["tasks", "compiled"])
def test_tp2_greedy_tokens_equal_single_worker_under_each_dispatch(dispatch: str) -> None:
    reference = LLM(MODEL, distributed_executor_backend="uni", **ENGINE_ARGS)
    expected = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, GREEDY)]
    reference.llm_engine.shutdown()
    llm = LLM(MODEL, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        with forced(dispatch):
            tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert llm.llm_engine.executor.dispatch_mode == dispatch
    finally:
        llm.llm_engine.shutdown()
    assert tokens == expected


def test_two_steps_in_flight_equal_the_same_steps_one_at_a_time(
    compiled_executor: RayExecutor,
) -> None:
    executor = compiled_executor
    assert executor.dispatch_mode in ("", "compiled")
    prompt = [1, 5, 9]
    sequential = [
        executor.execute_model(empty_request()),
        executor.execute_model(_first_step("seq", prompt, [0])),
    ]
    token = sequential[1].sampled_token_ids[0][0]
    sequential.append(executor.execute_model(_decode_step("seq", token, len(prompt))))

    first = executor.execute_model_async(empty_request(["seq"]))
    second = executor.execute_model_async(_first_step("pipe", prompt, [1]))
    in_flight = [first.result(), second.result()]
    assert executor.dispatch_mode == "compiled"
    third = executor.execute_model_async(_decode_step("pipe", token, len(prompt)))
    fourth = executor.execute_model_async(empty_request())
    in_flight += [third.result()]
    assert fourth.result().req_ids == []
    assert [_tokens(o) for o in in_flight] == [_tokens(o) for o in sequential]
    assert in_flight[1].req_ids == ["pipe"] and in_flight[2].req_ids == ["pipe"]
    executor.execute_model(empty_request(["pipe"]))


def test_a_step_message_over_2_mb_goes_through_the_compiled_graph(
    compiled_executor: RayExecutor,
) -> None:
    executor = compiled_executor
    # A 800k-token prompt, of which this step computes the first token (chunked prefill).
    long_prompt = [100 + i % 900 for i in range(800_000)]
    request = _first_step("long", long_prompt, [2])
    assert len(encode(request)) > 2 * 1024 * 1024
    output = executor.execute_model(request)
    assert output.sampled_token_ids in ([], [[]])  # a partial prefill samples nothing
    executor.execute_model(empty_request(["long"]))
    # Small messages still go through the (now larger) channels.
    small = executor.execute_model(_first_step("after", [1, 5, 9], [3]))
    assert small.req_ids == ["after"] and len(small.sampled_token_ids[0]) == 1
    assert executor.dispatch_mode == "compiled"
    executor.execute_model(empty_request(["after"]))


def test_a_worker_killed_mid_step_fails_the_step_within_seconds_and_then_every_step() -> None:
    executor = _executor()
    try:
        with forced("compiled"):
            executor.execute_model(empty_request())  # compiles the graph
        assert executor.dispatch_mode == "compiled"
        victim = 1 - executor.driver_rank  # the rank whose reply is not the output
        pid = ray.get(executor.workers[victim].__ray_call__.remote(lambda _: os.getpid()))
        killed_at: list[float] = []

        def kill() -> None:
            time.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

        threading.Thread(target=kill).start()
        prompt = [1, 5, 9]
        with pytest.raises(EngineDeadError, match=f"rank.*{victim}"):
            output = executor.execute_model(_first_step("r", prompt, [0]))
            token, computed = output.sampled_token_ids[0][0], len(prompt)
            for _ in range(10_000):
                output = executor.execute_model(_decode_step("r", token, computed))
                token, computed = output.sampled_token_ids[0][0], computed + 1
                if computed >= 15:  # one block of 16 tokens
                    executor.execute_model(empty_request(["r"]))
                    output = executor.execute_model(_first_step("r", prompt, [0]))
                    computed = len(prompt)
        assert time.monotonic() - killed_at[0] < 5
        with pytest.raises(EngineDeadError):
            executor.execute_model(empty_request())
        with pytest.raises(EngineDeadError):
            executor.check_health()
    finally:
        executor.shutdown()
