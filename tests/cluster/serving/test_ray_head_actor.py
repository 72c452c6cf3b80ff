"""The head actor (``cluster.serving.head_actor``): the engine core in a Ray actor of its own,
reached by the front (``AsyncLLMEngine`` over ``HeadCoreClient``) with one message per step for all
requests. Reference: the same engine offline in this process (itself token-exact against HF)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from cluster.serving.head_actor import HEAD_NAME_PREFIX
from cluster.serving.head_client import HeadCoreClient
from engine import LLM, EngineDeadError, InvalidRequestError, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.client.async_llm_engine import AsyncLLMEngine, StreamOutput
from engine.client.core_messages import StepOutputs
from engine.config import EngineConfig
from engine.core.input_processor import load_tokenizer
from engine.pooling_params import PoolingParams
from tests.cluster.conftest import wait_for

ENGINE_ARGS: dict[str, Any] = {"model": "builtin:tiny-llama", "num_kv_blocks": 128, "device": "cpu"}


def remote_engine(core_process: bool | None = None) -> AsyncLLMEngine:
    config = EngineConfig.from_kwargs(**ENGINE_ARGS)
    name = f"{HEAD_NAME_PREFIX}test:{uuid.uuid4().hex[:8]}"
    client = HeadCoreClient(config, ENGINE_ARGS, name=name, bundle_index=0,
                            resources={"CPU": 1}, core_process=core_process)  # fmt: skip
    client.wait_started()
    return AsyncLLMEngine(client, tokenizer=load_tokenizer(config))


def core_children() -> list[int]:
    """The pids of the engine-core child processes on this machine."""
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and (proc / "comm").read_text().strip() == "llm-engine-core":
                found.append(int(proc.name))
    return found


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLMEngine]:
    engine = remote_engine()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(**ENGINE_ARGS)


async def collect(
    engine: AsyncLLMEngine, prompt: str, params: SamplingParams
) -> list[StreamOutput]:
    return [item async for item in engine.generate(prompt, params)]


def test_embedding_through_the_head_equals_offline(engine: AsyncLLMEngine, offline: LLM) -> None:
    output = asyncio.run(engine.encode("Embed me", PoolingParams()))
    expected = offline.embed("Embed me", use_tqdm=False)[0]
    assert output.prompt_token_ids == expected.prompt_token_ids
    assert output.outputs.embedding == pytest.approx(expected.outputs.embedding, abs=1e-6)
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(engine.encode("Embed me", PoolingParams(dimensions=4)))
    assert info.value.param == "dimensions"


def test_n_choices_with_logprobs_equal_offline(engine: AsyncLLMEngine, offline: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, logprobs=2)
    items = asyncio.run(collect(engine, "Fan out", params))
    expected = offline.generate("Fan out", params, use_tqdm=False)[0].outputs
    for ref in expected:
        deltas = [d for item in items for d in item.deltas if d.index == ref.index]
        assert "".join(d.text for d in deltas) == ref.text
        assert [t for d in deltas for t in d.token_ids] == ref.token_ids
        assert [e for d in deltas for e in d.logprobs] == ref.logprobs
        assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
    assert items[-1].output.outputs == expected  # the front's running output, as offline


@contextlib.contextmanager
def step_messages(engine: AsyncLLMEngine) -> Iterator[list[StepOutputs]]:
    """Every ``StepOutputs`` the front receives from the head while the block runs."""
    messages: list[StepOutputs] = []

    def spy(step: StepOutputs) -> None:
        messages.append(step)
        engine._on_step(step)

    engine.client.start(spy, engine._on_dead)
    try:
        yield messages
    finally:
        engine.client.start(engine._on_step, engine._on_dead)


def test_one_message_per_step_carries_every_request(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def run() -> list[list[StreamOutput]]:
        before = await engine.get_stats()
        outs = await asyncio.gather(*(collect(engine, f"request {i}", params) for i in range(4)))
        after = await engine.get_stats()
        assert len(messages) <= after.num_steps - before.num_steps
        return outs

    with step_messages(engine) as messages:
        outputs = asyncio.run(run())
    assert all(len(o[-1].output.outputs[0].token_ids) == 16 for o in outputs)
    # Decode steps of the four requests travel together: one message, four deltas.
    assert max(len(m.deltas) for m in messages) == 4


def test_a_step_whose_tokens_have_no_text_still_sends_a_delta(
    engine: AsyncLLMEngine, offline: LLM
) -> None:
    # One byte of a three-byte UTF-8 character: its text only exists once completed, so the
    # stream's deltas carry the token with empty text, as vLLM's do.
    tokenizer = offline.get_tokenizer()
    lead_byte = tokenizer.convert_tokens_to_ids("â")
    assert tokenizer.decode([lead_byte]) == "\ufffd"  # alone it is no character
    params = SamplingParams(temperature=0, max_tokens=3, logit_bias={lead_byte: 100.0})
    with step_messages(engine) as messages:
        items = asyncio.run(collect(engine, "bytes", params))
    choices = [c for m in messages for d in m.deltas for c in d.choices]
    assert [c.token_ids for c in choices] == [[lead_byte]] * 3  # one delta per step
    assert choices[0].text == ""
    assert [t for i in items for t in i.delta_token_ids] == [lead_byte] * 3


async def kill_head_mid_stream(engine: AsyncLLMEngine, client: HeadCoreClient) -> None:
    """Kill the head actor once a long stream has started: the stream fails."""
    stream = engine.generate("doomed", SamplingParams(max_tokens=2000, ignore_eos=True))
    await stream.__anext__()
    ray.kill(client.actor, no_restart=True)
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass


def test_killed_head_fails_streams_health_and_new_requests() -> None:
    engine = remote_engine()
    client = engine.client
    assert isinstance(client, HeadCoreClient)

    async def run() -> None:
        await kill_head_mid_stream(engine, client)
        with pytest.raises(EngineDeadError):
            await engine.check_engine_health()
        with pytest.raises(EngineDeadError):
            await engine.generate("after", SamplingParams(max_tokens=2)).__anext__()

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        engine.shutdown()


def test_a_head_with_its_core_in_a_child_process_equals_offline_and_its_child_dies_with_it(
    offline: LLM,
) -> None:
    """``core_process=True`` (``LLM_CLUSTER_HEAD_CORE_PROCESS=1``): the same streams; killing
    the head actor ends its child (it reads EOF on its socket) and fails what is in flight."""
    before = set(core_children())
    engine = remote_engine(core_process=True)
    client = engine.client
    assert isinstance(client, HeadCoreClient)
    [child] = set(core_children()) - before
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10, logprobs=1)
    items = asyncio.run(collect(engine, "Through a child", params))
    for ref in offline.generate("Through a child", params, use_tqdm=False)[0].outputs:
        deltas = [d for item in items for d in item.deltas if d.index == ref.index]
        assert [t for d in deltas for t in d.token_ids] == ref.token_ids
        assert "".join(d.text for d in deltas) == ref.text

    try:
        asyncio.run(asyncio.wait_for(kill_head_mid_stream(engine, client), 60))
        wait_for(lambda: child not in core_children(), 30, "the head's core child to exit")
    finally:
        engine.shutdown()


def test_a_child_core_that_cannot_load_fails_its_head_with_the_reason(tmp_path: Path) -> None:
    from cluster.serving.start_errors import EngineStartError

    checkpoint = tmp_path / "no-weights"
    shutil.copytree(resolve_model_source("builtin:tiny-llama"), checkpoint)
    for weights in checkpoint.glob("*.safetensors"):
        weights.unlink()
    args = {**ENGINE_ARGS, "model": str(checkpoint)}
    with pytest.raises(EngineStartError) as info:
        HeadCoreClient(EngineConfig.from_kwargs(**args), args, name=f"{HEAD_NAME_PREFIX}x:y",
                       bundle_index=0, resources={"CPU": 1},
                       core_process=True).wait_started()  # fmt: skip
    assert str(info.value) == f"model: no *.safetensors files in {checkpoint}"


# ---- the ingress's token channel: deltas straight from the head, one message per step ------


class _Served:
    """A replica's generate stream as the ingress holds it (Serve's handle stream): iterable,
    with ``cancel``."""

    def __init__(self, items: Any) -> None:
        self._items = items

    def __aiter__(self) -> _Served:
        return self

    async def __anext__(self) -> Any:
        return await self._items.__anext__()

    def cancel(self) -> None:
        self._closing = asyncio.ensure_future(self._items.aclose())


@pytest.fixture(scope="module")
def channel_server() -> Iterator[Any]:
    from cluster.serving.llm_server import LLMServer

    server = LLMServer("chan", ENGINE_ARGS, head_resources={"CPU": 1})
    assert server.head_name is not None
    yield server
    server.engine.shutdown()


async def _through_channel(
    server: Any, channel: Any, request_id: str, prompt: str, params: dict[str, Any]
) -> tuple[Any, list[Any]]:
    from cluster.api.replica_messages import GenerateRequest

    channel.register(request_id)
    payload = GenerateRequest(prompt=prompt, params=params, request_id=request_id,
                              channel=await channel.sink())  # fmt: skip
    served = _Served(server.generate(payload))
    start = await served.__anext__()
    return start, [item async for item in channel.stream(request_id, start.head, served, "chan")]


def test_token_channel_carries_each_step_for_all_requests_equal_to_offline(
    channel_server: Any, offline: LLM
) -> None:
    from cluster.api.replica_messages import StreamDelta
    from cluster.serving.token_channel import TokenChannel

    channel = TokenChannel()
    per_message: list[int] = []
    dispatch = channel._dispatch

    def spy(deltas: Any) -> None:
        per_message.append(len(deltas))
        dispatch(deltas)

    channel._dispatch = spy  # type: ignore[method-assign]
    # What the replica's front gets from the head, and the latencies it times from that.
    client = channel_server.engine.client
    front: list[Any] = []
    on_step = client._on_step

    def front_spy(step: Any) -> None:
        front.extend(step.deltas)
        on_step(step)

    client._on_step = front_spy
    gaps: list[float] = []
    itl = channel_server.metrics.itl
    observe = itl.observe
    itl.observe = lambda value, tags=None: (gaps.append(value), observe(value, tags))
    params = {"n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 12, "logprobs": 2,
              "ignore_eos": True}  # fmt: skip
    prompts = [f"channel prompt {i}" for i in range(4)]

    async def run() -> list[tuple[Any, list[Any]]]:
        return await asyncio.gather(*(
            _through_channel(channel_server, channel, f"chan-{i}", p, params)
            for i, p in enumerate(prompts)
        ))  # fmt: skip

    try:
        results = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        client._on_step, itl.observe = on_step, observe
    expected = offline.generate(prompts, SamplingParams(**params), use_tqdm=False)
    timed = 0
    for number, ((start, items), ref) in enumerate(zip(results, expected, strict=True)):
        assert start.head == channel_server.head_name and start.n == 2
        assert all(isinstance(i, StreamDelta) for i in items)  # no error, nothing else
        for choice in ref.outputs:
            chunks = [c for i in items for c in i.choices if c.index == choice.index]
            assert "".join(c.text for c in chunks) == choice.text
            assert [t for c in chunks for t in c.token_ids] == choice.token_ids
            # The engine's own logprobs, as decoded off the channel: int keys, Logprobs, in order.
            assert [list(e.items()) for c in chunks for e in c.logprobs] == [
                list(e.items()) for e in choice.logprobs
            ]
            assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
        # The front got tallies of the first delta and the last: no text, tokens or logprobs
        # (the ingress shapes those), each choice's finish, and each step's time and token
        # count for the latency metrics (one wakeup, not twelve).
        first, last = [d for d in front if d.request_id == f"chan-{number}"]
        assert not first.finished and last.finished
        for tally in (first, last):
            assert all(c.text == "" and not c.token_ids and c.logprobs is None
                       for c in tally.choices)  # fmt: skip
        ((_, first_tokens),) = first.steps
        assert first_tokens >= 1  # the first step's tokens (TTFT)
        assert sum(n for _, n in last.steps) == 24 - first_tokens and len(last.steps) >= 11
        assert all(a <= b for (a, _), (b, _) in zip(last.steps, last.steps[1:], strict=False))
        assert [(c.index, c.finish_reason, c.num_tokens) for c in last.choices] == [
            (choice.index, "length", 12) for choice in ref.outputs
        ]
        timed += 24 - first_tokens
    # Per request: its first step's tokens start it (TTFT), every later token observes a gap.
    assert len(gaps) == timed and all(0 < g < 5 for g in gaps)
    # Decode steps of the four requests travel together: one message, eight choices' deltas.
    assert max(per_message) == 4
    assert 2 * len(per_message) <= sum(per_message)  # not one message per request per step
    assert not channel._queues and not channel._head_of  # nothing left registered


def test_token_channel_ends_streams_with_503_when_the_head_dies() -> None:
    from cluster.api.replica_messages import GenerateRequest, StreamDelta, StreamError
    from cluster.serving.llm_server import LLMServer
    from cluster.serving.token_channel import TokenChannel

    server = LLMServer("doomed", ENGINE_ARGS, head_resources={"CPU": 1})
    channel = TokenChannel()

    class Silent(_Served):
        """A replica stream that never says anything after its start: only the channel can
        tell the head is gone."""

        async def __anext__(self) -> Any:
            if self._items is not None:
                items, self._items = self._items, None
                return await items.__anext__()
            await asyncio.Event().wait()

    async def run() -> list[Any]:
        channel.register("doomed-1")
        params = {"max_tokens": 2000, "ignore_eos": True}
        payload = GenerateRequest(prompt="doomed", params=params, request_id="doomed-1",
                                  channel=await channel.sink())  # fmt: skip
        served = Silent(server.generate(payload))
        start = await served.__anext__()
        assert not isinstance(start, StreamError), start
        items = []
        async for item in channel.stream("doomed-1", start.head, served, "doomed"):
            items.append(item)
            if len(items) == 2:
                ray.kill(server.engine.client.actor, no_restart=True)
        return items

    try:
        items = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        server.engine.shutdown()
    assert all(isinstance(i, StreamDelta) for i in items[:-1])
    assert isinstance(items[-1], StreamError) and items[-1].status == 503


def test_a_head_whose_model_cannot_load_fails_its_replica_with_the_reason(tmp_path: Path) -> None:
    """The head builds the model in its own process; its known failure reaches the replica as
    one line (not Ray's text of the head's traceback), and the head actor is gone."""
    from cluster.serving.llm_server import LLMServer
    from cluster.serving.start_errors import ModelStartError

    checkpoint = tmp_path / "no-weights"
    shutil.copytree(resolve_model_source("builtin:tiny-llama"), checkpoint)
    for weights in checkpoint.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ModelStartError) as info:
        LLMServer("broken", {**ENGINE_ARGS, "model": str(checkpoint)}, head_resources={"CPU": 1})
    assert str(info.value) == (
        f"model 'broken' cannot start: model: no *.safetensors files in {checkpoint}"
    )
    wait_for_heads_gone("broken")


def test_a_front_that_cannot_start_stops_the_head_it_launched() -> None:
    """The replica starts its head before loading its own tokenizer (the two overlap); a front
    setting that fails then (a reasoning parser whose tokens the tokenizer lacks) fails the
    replica with its reason, and the head already started is killed."""
    from cluster.serving.llm_server import LLMServer
    from cluster.serving.start_errors import ModelStartError

    args = {**ENGINE_ARGS, "reasoning_parser": "deepseek_r1"}
    with pytest.raises(ModelStartError, match="reasoning_parser: 'deepseek_r1' needs <think>"):
        LLMServer("no-think", args, head_resources={"CPU": 1})
    wait_for_heads_gone("no-think")


def wait_for_heads_gone(model_id: str) -> None:
    """Wait until no head actor of ``model_id`` is alive."""
    prefix = f"{HEAD_NAME_PREFIX}{model_id}:"

    def gone() -> bool:
        return not [a for a in ray.util.list_named_actors() if a.startswith(prefix)]

    wait_for(gone, 30, f"the head actors of {model_id!r} to be killed")


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = [pytest.mark.slow, pytest.mark.local_ray(num_cpus=4, forward_env=True)]
