"""Helpers the vision-language model tests share: seeded random images, the workers' encoder
cache counters, and the check that a finished run released every block, request state and
encoder output."""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from engine import LLM


def image(seed: int, height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


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
