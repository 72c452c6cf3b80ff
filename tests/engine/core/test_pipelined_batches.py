"""Batches in flight (pipelined PP): the scheduler's bookkeeping, and the engine's batch queue
on the real tiny model, token-for-token equal to one batch at a time.

The engine tests drive a ``LaterExecutor``: the in-process worker, each step run when its
output is taken rather than when it is sent. That is what a pipeline looks like from the head
(step N + 1 is sent before step N's tokens are back, and every worker runs steps in the order
sent) without Ray; the Ray executor with PP = 2 runs the same engine code in
tests/cluster/runtime/test_ray_pipelined_pp.py.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import pytest

from engine.config import EngineConfig
from engine.config_sections import SchedulerConfig
from engine.core.block_manager import BlockManager
from engine.core.llm_engine import LLMEngine
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.worker.executor import StepFuture, UniProcExecutor
from engine.worker.step_messages import ExecuteModelRequest, ModelRunnerOutput

MODEL = "builtin:tiny-llama"


# ---- scheduler ------------------------------------------------------------------------------


def _scheduler(num_blocks: int = 64, depth: int = 2, **kwargs: int) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=kwargs.pop("max_num_batched_tokens", 256),
        max_num_seqs=kwargs.pop("max_num_seqs", 16),
        max_model_len=512,
    )
    scheduler = Scheduler(config, BlockManager(num_blocks, block_size=4))
    scheduler.pipeline_depth = depth
    return scheduler


def _request(rid: str, num_prompt: int, max_tokens: int = 50) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(
        rid,
        list(range(1, num_prompt + 1)),
        params,
        eos_token_ids=frozenset({0}),
        max_tokens=max_tokens,
    )


def _return(scheduler: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    rids = list(out.num_scheduled_tokens)
    scheduler.update_from_output(out, rids, [[token] for _ in rids])


def test_requests_split_into_one_group_per_batch_in_flight() -> None:
    scheduler = _scheduler()
    for i in range(4):
        scheduler.add_request(_request(f"r{i}", 8))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert list(first.num_scheduled_tokens) == ["r0", "r1"]
    assert list(second.num_scheduled_tokens) == ["r2", "r3"]
    # Every request is in a batch in flight: nothing more to send until one comes back.
    assert scheduler.schedule().total_num_scheduled_tokens == 0
    _return(scheduler, first)
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"r0": 1, "r1": 1}
    assert set(scheduler.in_flight) == {"r0", "r1", "r2", "r3"}
    _return(scheduler, second)
    _return(scheduler, third)
    assert not scheduler.in_flight


def test_a_request_in_flight_is_never_a_preemption_victim() -> None:
    # 6 blocks of 4 tokens: two 8-token prompts fill 4; decoding grows both past the rest.
    scheduler = _scheduler(num_blocks=6)
    late, early = _request("late", 8), _request("early", 8)
    early.arrival_time, late.arrival_time = 1.0, 2.0
    scheduler.add_request(early)
    scheduler.add_request(late)
    first = scheduler.schedule()  # early: its prompt
    second = scheduler.schedule()  # late: its prompt, while early's is in flight
    assert list(first.num_scheduled_tokens) == ["early"]
    assert list(second.num_scheduled_tokens) == ["late"]
    _return(scheduler, first)
    for _ in range(8):  # early decodes while late stays in flight; blocks run out
        out = scheduler.schedule()
        assert "late" not in out.preempted_req_ids
        if not out.num_scheduled_tokens:
            break
        _return(scheduler, out)
    assert scheduler.requests["late"].status is RequestStatus.RUNNING
    _return(scheduler, second)
    out = scheduler.schedule()  # late is back: now it can be the (latest-arrived) victim
    assert "late" in out.preempted_req_ids or "late" in out.num_scheduled_tokens


def test_an_abort_in_flight_frees_the_blocks_and_drops_the_returned_token() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 8))
    out = scheduler.schedule()
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.block_manager.num_free_blocks == 64
    _return(scheduler, out)  # the batch comes back after the abort
    assert not scheduler.in_flight and not scheduler.requests
    assert scheduler.schedule().finished_req_ids == ["a"]


def test_one_batch_at_a_time_counts_nothing_in_flight() -> None:
    scheduler = _scheduler(depth=1)
    for i in range(4):
        scheduler.add_request(_request(f"r{i}", 8))
    assert len(scheduler.schedule().num_scheduled_tokens) == 4
    assert not scheduler.in_flight


# ---- the engine's batch queue ---------------------------------------------------------------


class _Later(StepFuture):
    def __init__(self, run: Callable[[], ModelRunnerOutput]) -> None:
        self._run = run

    def result(self) -> ModelRunnerOutput:
        return self._run()


class LaterExecutor(UniProcExecutor):
    """In-process worker; each step runs when its output is taken, in the order sent."""

    depth = 2

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.sent: list[ExecuteModelRequest] = []
        self.max_seen_in_flight = 0
        self._pending: list[ExecuteModelRequest] = []

    @property
    def max_concurrent_batches(self) -> int:
        return self.depth

    def execute_model(self, request: ExecuteModelRequest) -> ModelRunnerOutput:
        if self._pending:
            raise AssertionError("a synchronous step was sent with batches in flight")
        return super().execute_model(request)

    def execute_model_async(self, request: ExecuteModelRequest) -> StepFuture:
        self.sent.append(request)
        self._pending.append(request)
        self.max_seen_in_flight = max(self.max_seen_in_flight, len(self._pending))

        def run() -> ModelRunnerOutput:
            if self._pending[0] is not request:
                raise AssertionError("outputs taken out of the order sent")
            self._pending.pop(0)
            return UniProcExecutor.execute_model(self, request)

        return _Later(run)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _engine(executor: type | None = None, **kwargs: object) -> LLMEngine:
    args = {"model": MODEL, "max_model_len": 512, **kwargs}
    return LLMEngine(EngineConfig.from_kwargs(**args), executor_class=executor)


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"q{i}", {"prompt_token_ids": prompt}, p)
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    engine.check_integrity()
    assert engine.get_kv_cache_stats().used == 0
    return {rid: [c.token_ids for c in out.outputs] for rid, out in sorted(final.items())}


CASES = {
    "defaults": {},
    "chunked prefill": {"max_num_batched_tokens": 32, "enable_chunked_prefill": True},
    "preemption": {"num_kv_blocks": 24, "block_size": 8, "max_num_seqs": 8},
    "swap": {"num_kv_blocks": 24, "block_size": 8, "preemption_mode": "swap"},
}


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [_ids(i, 12 + 17 * i) for i in range(6)]
    params = [
        SamplingParams(temperature=0, max_tokens=10 + 5 * i, ignore_eos=True) for i in range(6)
    ]
    params[1] = SamplingParams(temperature=0.9, seed=11, max_tokens=20, n=2, ignore_eos=True)
    params[4] = SamplingParams(temperature=0, max_tokens=40, stop=["a"])
    return prompts, params


@functools.cache
def _one_at_a_time(case: str) -> dict:
    return _run(_engine(**CASES[case]), *_workload())


@pytest.mark.parametrize(
    ("case", "depth"),
    [("defaults", 2), ("chunked prefill", 3), ("preemption", 2), ("preemption", 3), ("swap", 2)],
)
def test_batches_in_flight_are_token_equal_to_one_at_a_time(case: str, depth: int) -> None:
    prompts, params = _workload()
    expected = _one_at_a_time(case)
    executor = type("Depth", (LaterExecutor,), {"depth": depth})
    engine = _engine(executor, **CASES[case])
    assert _run(engine, prompts, params) == expected
    assert 2 <= engine.executor.max_seen_in_flight <= depth
    assert not engine.scheduler.in_flight
    assert sum(engine.request_state_sizes().values()) == 0


def test_an_abort_with_batches_in_flight_ends_cleanly() -> None:
    engine = _engine(LaterExecutor)
    for i in range(4):
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        engine.add_request(f"q{i}", {"prompt_token_ids": _ids(i, 20)}, params)
    engine.step()
    engine.step()
    assert engine.scheduler.in_flight
    aborted = engine.abort_request(["q0", "q3"])
    assert [o.outputs[0].finish_reason for o in aborted] == ["abort", "abort"]
    lengths = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                lengths[out.request_id] = len(out.outputs[0].token_ids)
    assert lengths == {"q1": 30, "q2": 30}
    engine.check_integrity()
    assert engine.get_kv_cache_stats().used == 0
    assert sum(engine.request_state_sizes().values()) == 0


def test_an_aborted_ids_reuse_waits_for_its_batch_in_flight() -> None:
    """A new request with the id of one aborted while its batch is in flight is refused until
    that batch is back (its tokens would be the new request's); then it runs as on its own."""
    prompt, params = _ids(7, 20), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = _engine(LaterExecutor)
    engine.add_request("x", {"prompt_token_ids": _ids(1, 30)}, params)
    engine.add_request("y", {"prompt_token_ids": _ids(2, 30)}, params)
    while "x" not in engine.scheduler.in_flight:
        engine.step()
    engine.abort_request("x")
    with pytest.raises(InvalidRequestError, match="still in a batch being computed") as info:
        engine.add_request("x", {"prompt_token_ids": prompt}, params)
    assert info.value.param == "request_id"
    while "x" in engine.scheduler.in_flight:
        engine.step()
    engine.add_request("x", {"prompt_token_ids": prompt}, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    engine.check_integrity()
    assert final["x"] == _run(_engine(), [prompt], [params])["q0"][0]
