"""A request's ``priority`` (vLLM's) on the real engine: under ``scheduling_policy: priority``
the lower value is served first; ``LLM.generate`` takes one priority for every prompt or a list
aligned with them; a value that is not an int64 is refused naming the field, with nothing
enqueued, and the engine serves on."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError

ARGS = {"model": "builtin:tiny-llama", "num_kv_blocks": 64, "max_model_len": 128, "device": "cpu"}
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    llm = LLM(**ARGS, scheduling_policy="priority", max_num_seqs=1)
    yield llm
    llm.llm_engine.shutdown()


def _finish_order(llm: LLM, priorities: dict[str, int]) -> list[str]:
    engine = llm.llm_engine
    for rid, priority in priorities.items():
        engine.add_request(rid, f"prompt {rid}", PARAMS, priority=priority)
    order: list[str] = []
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step() if out.finished]
    return order


def test_the_lower_priority_value_is_served_first(llm: LLM) -> None:
    # One sequence at a time: each finishes before the next starts, in priority order (the
    # first added runs first only because it is alone when the first step schedules).
    assert _finish_order(llm, {"p5": 5, "p-1": -1, "p2": 2, "p0": 0}) == ["p-1", "p0", "p2", "p5"]


def test_generate_takes_one_priority_or_one_per_prompt(llm: LLM) -> None:
    prompts = ["a b", "c d"]
    plain = [o.outputs[0].text for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    for priority in (3, [1, -1], [np.int64(2), np.int32(0)]):
        outs = llm.generate(prompts, PARAMS, priority=priority, use_tqdm=False)
        assert [o.outputs[0].text for o in outs] == plain
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(prompts, PARAMS, priority=[1], use_tqdm=False)
    assert info.value.param == "priority"


@pytest.mark.parametrize("bad", ["high", None, 1.5, True, 2**63, -(2**63) - 1])
def test_a_priority_that_is_not_an_int64_is_refused_and_the_engine_serves_on(
    llm: LLM, bad: object
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.llm_engine.add_request("bad", "x", PARAMS, priority=bad)  # type: ignore[arg-type]
    assert info.value.param == "priority"
    assert not llm.llm_engine.has_unfinished_requests()
    [out] = llm.generate("x", PARAMS, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
