"""The head -> worker message survives the msgpack codec exactly; nothing is pickled (the
source scan for unsafe deserialization is tests/test_unsafe_deserialization.py)."""

from __future__ import annotations

import numpy as np

from engine.multimodal.inputs import image_feature
from engine.sampling_params import SamplingParams
from engine.worker.step_messages import (
    CachedRequestData,
    ExecuteModelRequest,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    decode_output,
    decode_request,
    encode,
)


def test_execute_model_request_round_trips() -> None:
    msg = ExecuteModelRequest(
        scheduled_new_reqs=[
            NewRequestData(
                req_id="a",
                prompt_token_ids=[1, 2, 3],
                sampling_params=SamplingParams(temperature=0.5, stop=["x"], seed=3),
                block_ids=[4, 9],
                num_computed_tokens=0,
            )
        ],
        scheduled_cached_reqs=[
            CachedRequestData(
                req_id="b",
                new_token_ids=[7],
                new_block_ids=[],
                num_computed_tokens=40,
                resumed_from_preemption=True,
            )
        ],
        num_scheduled_tokens={"a": 3, "b": 1},
        total_num_scheduled_tokens=4,
        finished_req_ids=["c"],
        blocks_to_swap_out=[(1, 2)],
        blocks_to_copy=[(3, 4)],
    )
    assert decode_request(encode(msg)) == msg


def test_a_new_request_with_an_image_round_trips_with_its_pixels() -> None:
    pixels = np.arange(3 * 4 * 4, dtype=np.float32).reshape(3, 4, 4) / 7
    feature = image_feature(pixels, offset=2, length=5)
    new = NewRequestData(
        req_id="a",
        prompt_token_ids=[1, 2, 9, 9, 9, 9, 9, 3],
        sampling_params=SamplingParams(),
        block_ids=[0],
        num_computed_tokens=0,
        mm_features=[feature],
    )
    msg = ExecuteModelRequest(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={"a": 8},
        total_num_scheduled_tokens=8,
        finished_req_ids=[],
    )
    (got,) = decode_request(encode(msg)).scheduled_new_reqs[0].mm_features
    assert got == feature
    assert np.array_equal(got.pixels(), pixels)


def test_model_runner_output_round_trips() -> None:
    out = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[5], [6]])
    assert decode_output(encode(out)) == out


def test_model_runner_output_with_logprobs_round_trips() -> None:
    lists = LogprobsLists(token_ids=[[5, 5, 9]], logprobs=[[-0.25, -0.25, -2.5]], ranks=[1])
    out = ModelRunnerOutput(
        req_ids=["a", "b"],
        sampled_token_ids=[[5], [6]],
        logprobs=[lists, None],
        prompt_logprobs={"a": PromptLogprobs(start=1, lists=lists)},
    )
    assert decode_output(encode(out)) == out
