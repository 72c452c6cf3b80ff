"""``SamplingParams.output_kind`` (vLLM's ``RequestOutputKind``): deltas built by the engine
itself add up to the cumulative result exactly, ``FINAL_ONLY`` emits once, and a long
request's per-step output stays the same size from its first token to its 4,000th.
"""

from __future__ import annotations

import asyncio
import random
import tracemalloc

import msgspec
import pytest

from engine import InvalidRequestError, RequestOutputKind, SamplingParams
from engine.builtin.tiny_models import tiny_variant
from engine.client.async_llm_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.outputs import RequestOutput

MODEL = "builtin:tiny-llama"
CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=MODEL, max_model_len=512))


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _run(engine: LLMEngine, params: SamplingParams, prompt: list[int]) -> list[RequestOutput]:
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == "r"]
    return outputs


def _params(kind: RequestOutputKind, **kwargs: object) -> SamplingParams:
    base = {"temperature": 0.8, "seed": 7, "max_tokens": 40, "n": 2, "logprobs": 2}
    return SamplingParams(output_kind=kind, prompt_logprobs=1, **{**base, **kwargs})


@pytest.mark.parametrize("stop", [None, ["e", "the"]])
def test_deltas_add_up_to_the_cumulative_output(engine: LLMEngine, stop: list[str] | None) -> None:
    prompt = _ids(1, 30)
    final = _run(engine, _params(CUMULATIVE, stop=stop), prompt)[-1]
    deltas = _run(engine, _params(DELTA, stop=stop), prompt)
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert sum(d.prompt_logprobs is not None for d in deltas) == 1
    assert deltas[0].prompt_logprobs == final.prompt_logprobs
    for index, whole in enumerate(final.outputs):
        parts = [c for d in deltas for c in d.outputs if c.index == index]
        assert "".join(c.text for c in parts) == whole.text
        assert [t for c in parts for t in c.token_ids] == whole.token_ids
        assert [lp for c in parts for lp in c.logprobs] == whole.logprobs
        assert [c.finish_reason for c in parts if c.finish_reason] == [whole.finish_reason]
        assert parts[-1].stop_reason == whole.stop_reason
        assert parts[-1].cumulative_logprob == whole.cumulative_logprob
        # Every step with new tokens gave a delta, text or not.
        assert all(c.token_ids or c.finish_reason for c in parts)


def test_final_only_emits_one_output(engine: LLMEngine) -> None:
    prompt = _ids(2, 12)
    cumulative = _run(engine, _params(CUMULATIVE), prompt)
    final = _run(engine, _params(FINAL_ONLY), prompt)
    assert len(cumulative) > 1 and len(final) == 1
    assert final[0] == cumulative[-1]


def test_an_abort_hands_out_the_held_back_text(engine: LLMEngine) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=50, stop=["x" * 30], ignore_eos=True, output_kind=DELTA
    )
    engine.add_request("a", {"prompt_token_ids": _ids(3, 10)}, params)
    parts = [o for _ in range(6) for o in engine.step()]
    [last] = engine.abort_request("a")
    text = "".join(c.text for o in [*parts, last] for c in o.outputs)
    tokens = [t for o in [*parts, last] for c in o.outputs for t in c.token_ids]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_output_kind_is_checked() -> None:
    with pytest.raises(InvalidRequestError, match="output_kind"):
        SamplingParams(output_kind=3)
    assert SamplingParams(output_kind=1).output_kind is DELTA


def test_async_generate_follows_output_kind() -> None:
    async def collect(kind: RequestOutputKind) -> list[RequestOutput]:
        engine = AsyncLLMEngine.from_engine_args(model=MODEL, max_model_len=256)
        try:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=kind)
            items = []
            async for item in engine.generate({"prompt_token_ids": _ids(4, 9)}, params):
                items.append(
                    RequestOutput(**{**item.output.__dict__, "outputs": list(item.output.outputs)})
                )
            return items
        finally:
            engine.shutdown()

    cumulative = asyncio.run(collect(CUMULATIVE))
    deltas = asyncio.run(collect(DELTA))
    final = asyncio.run(collect(FINAL_ONLY))
    whole = cumulative[-1].outputs[0]
    assert len(final) == 1 and final[0].outputs[0].token_ids == whole.token_ids
    assert [t for d in deltas for c in d.outputs for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for d in deltas for c in d.outputs) == whole.text
    # Items that pile up while the consumer is busy are merged, so an item may hold several
    # steps' tokens; each token still comes exactly once (the two checks above).


@pytest.mark.slow
def test_per_step_output_of_a_long_request_does_not_grow_with_its_length() -> None:
    """A streaming (``DELTA``) request's step output, encoded, and the Python memory a step
    allocates, at its ~50th token and its ~3,990th: the same within a few bytes of token text
    and the block table's growth (cumulative outputs would add ~100 KB of token ids, logprobs
    and text per step at the end). Each figure is the least of 5 steps, so a list's occasional
    reallocation does not count."""
    model = tiny_variant("tiny-llama", max_position_embeddings=4096)
    config = EngineConfig.from_kwargs(model=str(model), max_model_len=4096, num_kv_blocks=300)
    return _late_vs_early(config, kind=DELTA, until=3990)


def _late_vs_early(config: EngineConfig, kind: RequestOutputKind, until: int) -> None:
    engine = LLMEngine(config)
    params = SamplingParams(
        temperature=0, max_tokens=until + 10, ignore_eos=True, logprobs=1, output_kind=kind
    )
    engine.add_request("long", {"prompt_token_ids": _ids(5, 16)}, params)
    tokens = 0

    def step() -> list[RequestOutput]:
        nonlocal tokens
        outputs = engine.step()
        tokens += sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return outputs

    def cost() -> tuple[int, int]:
        sizes, allocations = [], []
        for _ in range(5):
            tracemalloc.start()
            start, _ = tracemalloc.get_traced_memory()
            outputs = step()
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            sizes.append(len(msgspec.msgpack.encode(outputs)))
            allocations.append(peak - start)
        return min(sizes), min(allocations)

    while tokens < 50:
        step()
    early_bytes, early_alloc = cost()
    while tokens < until:
        step()
    late_bytes, late_alloc = cost()
    engine.abort_request("long")
    engine.shutdown()
    assert abs(late_bytes - early_bytes) <= 64, (early_bytes, late_bytes)
    assert late_alloc < early_alloc + 16 * 1024, (early_alloc, late_alloc)
