"""Helpers the vision-language model tests share: seeded random images, HF's greedy reference
(model + processor on the same images), the engine's greedy tokens, the workers' encoder cache
counters, the check that a finished run released every block, request state and encoder
output, and TP = 2 against TP = 1 with spawned ranks driving their workers."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoProcessor

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.config import EngineConfig


def image(seed: int, height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


class Reference:
    """HF's ``model_class`` and ``AutoProcessor`` of the built-in ``name``, greedy in fp32."""

    def __init__(self, name: str, model_class: Any, max_tokens: int) -> None:
        self.path = resolve_model_source(f"builtin:{name}")
        self.processor = AutoProcessor.from_pretrained(self.path)
        self.model = model_class.from_pretrained(self.path, dtype=torch.float32).eval()
        self.max_tokens = max_tokens

    def input_ids(self, text: str, images: list[Image.Image]) -> list[int]:
        return self.processor(text=text, images=images, return_tensors="pt")["input_ids"][
            0
        ].tolist()

    def generate(self, text: str, images: list[Image.Image]) -> list[int]:
        inputs = self.processor(text=text, images=images, return_tensors="pt")
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=self.max_tokens, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()


def generate(
    model: str, cases: list[tuple[str, list[Image.Image]]], max_tokens: int, **engine_args: Any
) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in cases]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outputs]


def features(llm: LLM, prompt: dict[str, Any]) -> list[Any]:
    """The ``MultiModalFeature``s the engine's input processing makes of ``prompt``."""
    ids = llm.get_tokenizer().encode(prompt["prompt"])
    return llm.llm_engine.inputs.process_multimodal(prompt, ids)[1]


def encoder_stats(llm: LLM) -> dict[str, int]:
    return llm.llm_engine.executor.collective_rpc("encoder_cache_stats")[0]


def assert_released(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_integrity()
    stats = engine.get_kv_cache_stats()
    assert stats.free == stats.total
    assert engine.executor.collective_rpc("num_request_states") == [0]
    assert encoder_stats(llm)["num_cached"] == 0, "encoder outputs outlived their requests"


def assert_tp2_equals_tp1(
    name: str, prompts: list[str], images: list[list[Image.Image]], steps: int
) -> None:
    """The built-in ``name`` at TP = 2 (CPU, gloo, spawned ranks driving their workers as the
    head would) gives the offline engine's TP = 1 greedy tokens on both ranks."""
    from tests.engine.spawned_ranks import run_ranks

    llm = LLM(f"builtin:{name}", num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    requests = [
        {"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in zip(prompts, images)
    ]
    tp1 = [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]
    results = run_ranks(_tp2_rank_main, 2, name, prompts, images, steps)
    assert results[0] == results[1] == tp1


def _tp2_rank_main(
    rank: int,
    ports: Any,
    results: Any,
    name: str,
    prompts: list[str],
    images: list[list[Image.Image]],
    steps: int,
) -> None:
    """One spawned rank: the prompts processed as the head does, then ``steps`` greedy steps
    of this rank's worker in the TP group."""
    try:
        from transformers import AutoTokenizer

        from engine.multimodal.processor import MultiModalProcessor
        from tests.engine.spawned_ranks import greedy_steps, workers_on_one_group

        config = EngineConfig.from_kwargs(
            model=str(resolve_model_source(f"builtin:{name}")),
            tensor_parallel_size=2,
            num_kv_blocks=64,
            max_model_len=256,
        )
        config = dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, rank=rank)
        )
        model = config.model
        tokenizer = AutoTokenizer.from_pretrained(model.model_path)
        processor = MultiModalProcessor(model.hf_config, model.model_path, {})
        ids, feats = [], []
        for text, imgs in zip(prompts, images):
            prompt_ids, prompt_features = processor.process(tokenizer.encode(text), {"image": imgs})
            ids.append(prompt_ids)
            feats.append(prompt_features)
        for _, worker in workers_on_one_group(rank, 2, ports, {name: config}):
            tokens = greedy_steps(worker, ids, steps, blocks_per_request=8, mm_features=feats)
            results.put((rank, tokens))
    except BaseException as exc:
        results.put((rank, repr(exc)))
