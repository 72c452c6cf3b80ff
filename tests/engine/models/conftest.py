"""Fixtures the model tests share: ``expected``, HF's greedy tokens for each of a
vision-language test module's ``CASES`` (text, images) from that module's ``ref`` fixture."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def expected(request: pytest.FixtureRequest, ref: Any) -> list[list[int]]:
    return [ref.generate(text, images) for text, images in request.module.CASES]
