"""The torch attention path with its decode rows on the native CPU kernel, for the kernel tests:
it skips where the kernel does not run (no AVX-512 or AVX2, no compiler) and fails if the kernel
declines a call, so a test of it never passes on the torch fallback."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from torch import Tensor

from llm_kernels import attention, cpu_decode


def native_decode(*args: Any, isa: str | None = None) -> bool:
    """``cpu_decode.attend_decode`` (of build ``isa``) that must handle the call."""
    if not cpu_decode.attend_decode(*args, isa=isa):
        raise AssertionError("the native CPU decode kernel declined a call it should cover")
    return True


def skip_unless_native(isa: str | None = None) -> None:
    if not cpu_decode.native_decode_available(isa):
        what = f"its {isa} build" if isa else "it"
        pytest.skip(f"the native CPU decode kernel does not run here ({what}: CPU or compiler)")


def native_paged_attention(*args: Any, isa: str | None = None, **kwargs: Any) -> Tensor:
    """``attention.paged_attention`` with every decode row attended by the native kernel's build
    ``isa`` (None: the one this CPU uses)."""
    skip_unless_native(isa)
    kernel = functools.partial(native_decode, isa=isa)
    return attention.paged_attention(*args, decode_kernel=kernel, **kwargs)
