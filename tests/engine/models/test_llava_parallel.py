"""LLaVA at TP = 2 (CPU, gloo, spawned workers): the vision tower replicated on both ranks, the
language model sharded; greedy tokens equal TP = 1's (the offline engine)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from PIL import Image

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.config import EngineConfig
from tests.engine.spawned_ranks import greedy_steps, run_ranks, workers_on_one_group

STEPS = 12
PROMPTS = ["USER: <image>\nWhat is it? ASSISTANT:", "USER: <image> or <image>? ASSISTANT:"]


def _images() -> list[list[Image.Image]]:
    def image(seed: int, h: int, w: int) -> Image.Image:
        rng = np.random.default_rng(seed)
        return Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8))

    return [[image(0, 50, 80)], [image(1, 64, 64), image(2, 30, 90)]]


def _config(rank: int) -> EngineConfig:
    config = EngineConfig.from_kwargs(
        model=str(resolve_model_source("builtin:tiny-llava")),
        tensor_parallel_size=2,
        num_kv_blocks=64,
        max_model_len=256,
    )
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, rank=rank))


def _rank_main(rank: int, ports: Any, results: Any) -> None:
    try:
        from transformers import AutoTokenizer

        from engine.multimodal.processor import MultiModalProcessor

        config = _config(rank)
        model = config.model
        tokenizer = AutoTokenizer.from_pretrained(model.model_path)
        processor = MultiModalProcessor(model.hf_config, model.model_path, {})
        prompts, features = [], []
        for text, images in zip(PROMPTS, _images()):
            ids, feats = processor.process(tokenizer.encode(text), {"image": images})
            prompts.append(ids)
            features.append(feats)
        for _, worker in workers_on_one_group(rank, 2, ports, {"llava": config}):
            tokens = greedy_steps(
                worker, prompts, STEPS, blocks_per_request=8, mm_features=features
            )
            results.put((rank, tokens))
    except BaseException as exc:
        results.put((rank, repr(exc)))


def test_tp2_equals_tp1() -> None:
    llm = LLM("builtin:tiny-llava", num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=STEPS + 1, ignore_eos=True)
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": images}}
        for text, images in zip(PROMPTS, _images())
    ]
    tp1 = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    results = run_ranks(_rank_main, 2)
    assert results[0] == results[1] == tp1
