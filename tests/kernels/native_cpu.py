"""The torch attention path with its decode rows on the native CPU kernel, for the kernel tests:
it skips where the kernel does not run (no AVX-512, no compiler) and fails if the kernel
declines a call, so a test of it never passes on the torch fallback."""

from __future__ import annotations

from typing import Any

import pytest
from torch import Tensor

from kernels import attention, cpu_decode


def native_decode(*args: Any) -> bool:
    """``cpu_decode.attend_decode`` that must handle the call."""
    if not cpu_decode.attend_decode(*args):
        raise AssertionError("the native CPU decode kernel declined a call it should cover")
    return True


def native_paged_attention(*args: Any, **kwargs: Any) -> Tensor:
    """``attention.paged_attention`` with every decode row attended by the native kernel."""
    if not cpu_decode.native_decode_available():
        pytest.skip("the native CPU decode kernel does not run here (no AVX-512 or no compiler)")
    return attention.paged_attention(*args, decode_kernel=native_decode, **kwargs)
