"""Gemma 3 vision at TP = 2 (CPU, gloo, spawned workers): the SigLIP tower and the projector
replicated on both ranks, the language model (sliding-window layers whose window is shorter
than an image) sharded, each image's tokens attended both ways on both ranks; greedy tokens
equal TP = 1's (the offline engine), which equal HF's (test_gemma3_vision)."""

from __future__ import annotations

import pytest

from tests.engine.vlm_checks import assert_tp2_equals_tp1, image

PROMPTS = [
    "USER: <start_of_image>\nWhat is it? ASSISTANT:",
    "USER: <start_of_image> or <start_of_image>? ASSISTANT:",
]


@pytest.mark.slow
def test_tp2_equals_tp1() -> None:
    images = [[image(0, 50, 80)], [image(1, 64, 64), image(2, 30, 90)]]
    assert_tp2_equals_tp1("tiny-gemma3-vision", PROMPTS, images, steps=12)
