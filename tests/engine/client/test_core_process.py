"""``EngineCoreProcess``: the engine core in a plain child process gives the same tokens as
``LLM.generate``, answers its calls, reports bad requests and start-up failures, and a core
process that dies fails what is in flight instead of hanging it."""

from __future__ import annotations

import os
import signal
import threading
from collections import defaultdict

import pytest

from engine import SamplingParams
from engine.client.core_messages import AddRequest, CoreError, StepOutputs
from engine.client.core_process import EngineCoreProcess, EngineStartFailed
from engine.client.llm import LLM
from engine.errors import (
    EngineDeadError,
    EngineStateError,
    InvalidRequestError,
    RequestFailedError,
)

MODEL = "builtin:tiny-llama"
ARGS = {"model": MODEL, "max_model_len": 2048, "dtype": "float32"}


class Sink:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finished: dict[str, str | None] = {}
        self.dead: list[EngineDeadError] = []
        self.done = threading.Condition()

    def on_step(self, step: StepOutputs) -> None:
        with self.done:
            for delta in step.deltas:
                for choice in delta.choices:
                    self.tokens[delta.request_id] += choice.token_ids
                    if choice.finish_reason is not None:
                        self.finished[delta.request_id] = choice.finish_reason
            self.done.notify_all()

    def on_dead(self, error: EngineDeadError) -> None:
        with self.done:
            self.dead.append(error)
            self.done.notify_all()

    def wait(self, ids: list[str], timeout_s: float = 60) -> None:
        with self.done:
            assert self.done.wait_for(lambda: all(i in self.finished for i in ids), timeout_s)


@pytest.fixture(scope="module")
def core() -> tuple[EngineCoreProcess, Sink]:
    sink = Sink()
    proc = EngineCoreProcess(ARGS, sink.on_step, sink.on_dead)
    yield proc, sink
    proc.shutdown()
    assert proc.is_dead


def test_child_core_generates_what_llm_generate_does(core: tuple[EngineCoreProcess, Sink]) -> None:
    proc, sink = core
    prompts = [[1, 5, 9, 200, 31], [7, 7, 7], list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = [f"same-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        result = proc.add(AddRequest(request_id=rid, params=params, prompt_token_ids=prompt))
        assert result.result(30).prompt_token_ids == prompt
    sink.wait(ids)
    expected = LLM(**ARGS).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    for rid, out in zip(ids, expected, strict=True):
        assert sink.tokens[rid] == out.outputs[0].token_ids
        assert sink.finished[rid] == "length"
    stats = proc.stats().result(30)
    assert stats.num_running == 0 and stats.num_waiting == 0
    state = proc.request_state().result(30)
    assert set(state) == {"head", "workers"}
    proc.check_health()


def test_a_bad_request_is_refused_by_name_and_an_abort_ends_a_request(
    core: tuple[EngineCoreProcess, Sink],
) -> None:
    proc, sink = core
    bad = AddRequest(request_id="bad", prompt_token_ids=[7] * 3000)
    with pytest.raises(InvalidRequestError) as info:
        proc.add(bad).result(30)
    assert "max_model_len" in str(info.value)
    long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    proc.add(AddRequest(request_id="long", params=long, prompt_token_ids=[1, 2])).result(30)
    with sink.done:  # aborted once it has streamed: 2,000 tokens take seconds, an abort a step
        assert sink.done.wait_for(lambda: sink.tokens["long"], 30)
    proc.abort(["long"])
    sink.wait(["long"])
    assert sink.finished["long"] == "abort"
    assert len(sink.tokens["long"]) < 2000


def test_the_child_sleeps_and_wakes_through_its_control_calls(
    core: tuple[EngineCoreProcess, Sink],
) -> None:
    proc, sink = core
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(rid: str) -> list[int]:
        proc.add(AddRequest(request_id=rid, params=params, prompt_token_ids=[4, 8, 15])).result(30)
        sink.wait([rid])
        return sink.tokens[rid]

    before = run("before-sleep")
    assert proc.control("sleep", (2,)).result(30) is None
    assert proc.control("is_sleeping", ()).result(30) is True
    with pytest.raises(EngineStateError, match="asleep"):
        proc.add(AddRequest(request_id="asleep", prompt_token_ids=[1])).result(30)
    with pytest.raises(InvalidRequestError, match="tags"):
        proc.control("wake_up", (["kv_cache"],)).result(30)
    proc.control("wake_up", (None,)).result(60)
    assert proc.control("is_sleeping", ()).result(30) is False
    assert run("after-wake") == before
    with pytest.raises(InvalidRequestError, match="level"):
        proc.control("sleep", (5,)).result(30)


def test_a_start_failure_is_raised_with_the_childs_traceback() -> None:
    with pytest.raises(EngineStartFailed) as info:
        EngineCoreProcess({**ARGS, "max_model_len": -3}, lambda s: None, lambda e: None)
    assert info.value.known is None  # no classifier given
    assert "max_model_len" in str(info.value)


def test_a_killed_core_process_fails_its_requests_and_health() -> None:
    sink = Sink()
    proc = EngineCoreProcess(ARGS, sink.on_step, sink.on_dead)
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    proc.add(AddRequest(request_id="r", params=params, prompt_token_ids=[1, 2, 3])).result(30)
    os.kill(proc.pid, signal.SIGKILL)
    with sink.done:
        assert sink.done.wait_for(lambda: sink.dead, 30)
    assert "exited" in str(sink.dead[0])
    assert proc.is_dead
    with pytest.raises(EngineDeadError):
        proc.check_health()
    with pytest.raises(EngineDeadError):
        proc.stats().result(5)
    proc.shutdown()


class Recorder:
    model_id = "m"

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[object, ...]]] = []

    def phase(self, rank: int, phase: str) -> None:
        self.calls.append(("phase", (rank, phase)))

    def weights(self, rank: int, read_bytes: int, total_bytes: int) -> None:
        self.calls.append(("weights", (rank, read_bytes, total_bytes)))


@pytest.mark.slow
def test_the_childs_start_up_phases_and_weight_bytes_reach_the_parents_observer() -> None:
    from engine.worker.executor import PHASE_LOADING, PHASE_READY

    recorder = Recorder()
    proc = EngineCoreProcess(ARGS, lambda s: None, lambda e: None, observer=recorder)
    try:
        phases = [args[1] for kind, args in recorder.calls if kind == "phase"]
        assert phases[0] != PHASE_READY and PHASE_LOADING in phases
        assert phases[-1] == PHASE_READY
        weights = [args for kind, args in recorder.calls if kind == "weights"]
        assert weights and weights[-1][1] == weights[-1][2] > 0  # all bytes read, in the end
        assert "load" in proc.startup_summary and proc.startup_busy_s > 0
    finally:
        proc.shutdown()


def test_an_unexpected_error_taking_a_request_fails_that_request_not_the_engine() -> None:
    """What the child (and the head actor) reply for an error the engine does not expect: the
    request fails (a 500 at the API), naming no internals; only EngineDeadError reads as dead."""
    error = CoreError.of(RecursionError("maximum recursion depth exceeded in /srv/x.py"))
    assert (error.kind, error.message) == (
        "failed",
        "the engine could not take the request: RecursionError",
    )
    assert isinstance(error.exception(), RequestFailedError)
    assert isinstance(CoreError.of(EngineDeadError("gone")).exception(), EngineDeadError)
