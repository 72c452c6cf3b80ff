"""Qwen2.5-VL and Qwen3-VL at TP = 2 (CPU, gloo, spawned workers): the vision tower
replicated on both ranks, the language model sharded, the M-RoPE positions sent with each new
request (Qwen3-VL: the deepstack features added on every rank); greedy tokens equal TP = 1's
(the offline engine, which test_qwen2_5_vl / test_qwen3_vl check against HF)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_qwen_vl_models import IMAGE_PLACEHOLDER as P
from engine.config import EngineConfig
from tests.engine.spawned_ranks import greedy_steps, run_ranks, workers_on_one_group
from tests.engine.vlm_checks import image

STEPS = 12
PROMPTS = [
    f"<|im_start|>user\n{P}What is it?<|im_end|>\n<|im_start|>assistant\n",
    f"<|im_start|>user\n{P} or {P}?<|im_end|>\n<|im_start|>assistant\n",
]


def _images() -> list[list[Any]]:
    return [[image(0, 90, 150)], [image(1, 112, 60), image(2, 56, 84)]]


def _config(rank: int, model: str) -> EngineConfig:
    config = EngineConfig.from_kwargs(
        model=str(resolve_model_source(model)),
        tensor_parallel_size=2,
        num_kv_blocks=64,
        max_model_len=256,
    )
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, rank=rank))


def _rank_main(rank: int, ports: Any, results: Any, model_name: str) -> None:
    try:
        from transformers import AutoTokenizer

        from engine.multimodal.mrope import mrope_positions
        from engine.multimodal.processor import MultiModalProcessor

        config = _config(rank, model_name)
        model = config.model
        tokenizer = AutoTokenizer.from_pretrained(model.model_path)
        processor = MultiModalProcessor(model.hf_config, model.model_path, {})
        merge = model.hf_config["vision_config"]["spatial_merge_size"]
        prompts, features, positions = [], [], []
        for text, images in zip(PROMPTS, _images()):
            ids, feats = processor.process(tokenizer.encode(text), {"image": images})
            prompts.append(ids)
            features.append(feats)
            positions.append(mrope_positions(len(ids), feats, merge))
        for _, worker in workers_on_one_group(rank, 2, ports, {"vlm": config}):
            tokens = greedy_steps(
                worker, prompts, STEPS, blocks_per_request=8, mm_features=features,
                mrope=positions,
            )  # fmt: skip
            results.put((rank, tokens))
    except BaseException as exc:
        results.put((rank, repr(exc)))


@pytest.mark.parametrize("model", ["builtin:tiny-qwen2.5-vl", "builtin:tiny-qwen3-vl"])
def test_tp2_equals_tp1(model: str) -> None:
    llm = LLM(model, num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=STEPS + 1, ignore_eos=True)
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": images}}
        for text, images in zip(PROMPTS, _images())
    ]
    tp1 = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    results = run_ranks(_rank_main, 2, model)
    assert results[0] == results[1] == tp1
