"""LLaVA at TP = 2 (CPU, gloo, spawned workers): the vision tower replicated on both ranks, the
language model sharded; greedy tokens equal TP = 1's (the offline engine)."""

from __future__ import annotations

import pytest

from tests.engine.vlm_checks import assert_tp2_equals_tp1, image

PROMPTS = ["USER: <image>\nWhat is it? ASSISTANT:", "USER: <image> or <image>? ASSISTANT:"]


@pytest.mark.slow
def test_tp2_equals_tp1() -> None:
    images = [[image(0, 50, 80)], [image(1, 64, 64), image(2, 30, 90)]]
    assert_tp2_equals_tp1("tiny-llava", PROMPTS, images, steps=12)
