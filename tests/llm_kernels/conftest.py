"""Fixtures of the kernel tests: the ahead-of-time Triton compiler
(tests/llm_kernels/triton_aot.py), one child process per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.llm_kernels.triton_aot import AotCompiler


@pytest.fixture(scope="module")
def aot_compiler() -> Iterator[AotCompiler]:
    compiler = AotCompiler()
    yield compiler
    compiler.close()
