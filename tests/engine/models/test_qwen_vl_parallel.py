"""Qwen2.5-VL and Qwen3-VL at TP = 2 (CPU, gloo, spawned workers): the vision tower
replicated on both ranks, the language model sharded, the M-RoPE positions sent with each new
request (Qwen3-VL: the deepstack features added on every rank); greedy tokens equal TP = 1's
(the offline engine, which test_qwen2_5_vl / test_qwen3_vl check against HF)."""

from __future__ import annotations

import pytest

from engine.builtin.tiny_qwen_vl_models import IMAGE_PLACEHOLDER as P
from tests.engine.vlm_checks import assert_tp2_equals_tp1, image

PROMPTS = [
    f"<|im_start|>user\n{P}What is it?<|im_end|>\n<|im_start|>assistant\n",
    f"<|im_start|>user\n{P} or {P}?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_tp2_equals_tp1(name: str) -> None:
    images = [[image(0, 90, 150)], [image(1, 112, 60), image(2, 56, 84)]]
    assert_tp2_equals_tp1(name, PROMPTS, images, steps=12)
