"""Which implementation of the kernels a model uses: plain torch, torch with the native CPU
kernels (decode attention, RMSNorm, rotary, cache write), or Triton.

A model asks once, at construction, for a ``KernelOps`` bundle and keeps it; nothing here is
mutable module state, so two models in one process may use different backends. The Triton
modules are imported only when asked for: importing them decorates the kernels, and whether
they are decorated for the GPU or for the interpreter depends on ``TRITON_INTERPRET`` then.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from llm_kernels import attention, cpu_decode, cpu_layer_kernels, ops

__all__ = [
    "ATTENTION_BACKENDS",
    "KernelOps",
    "get_kernel_ops",
    "resolve_attention_backend",
    "triton_available",
]

ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "triton", "cpu", "torch")


@dataclass(frozen=True)
class KernelOps:
    """The kernels one backend provides; every function has the torch reference's contract."""

    name: str
    # (key, value, kv_cache, slot_mapping, k_scale=1.0, v_scale=1.0): scales for an FP8 cache
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., Tensor]
    copy_blocks: Callable[[Sequence[Tensor], Tensor], None]
    swap_blocks: Callable[[Tensor, Tensor, Tensor], None]
    rms_norm: Callable[..., Any]
    rotary_embedding: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]
    gelu_tanh_and_mul: Callable[[Tensor], Tensor]


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_attention_backend(name: str, device_type: str) -> str:
    """``auto`` -> ``triton`` on CUDA; on CPU ``cpu`` (the torch path with the native decode
    kernel, ``llm_kernels.cpu_decode``) where the kernel builds and runs here, ``torch`` otherwise.
    Other names pass through checked; ``cpu`` where the kernel cannot run is refused with the
    reason."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "cpu":
        if device_type != "cpu" or not cpu_decode.native_decode_available():
            raise ValueError(
                "attention_backend 'cpu' needs a CPU device with AVX-512 or AVX2 and a C++ "
                "compiler to build llm_kernels/csrc/cpu_paged_decode.cpp (see the log for why it "
                "did not build); use 'torch' or 'auto'"
            )
        return name
    if name != "auto":
        return name
    if device_type == "cuda":
        return "triton" if triton_available() else "torch"
    if device_type == "cpu":
        return "cpu" if cpu_decode.native_decode_available() else "torch"
    return "torch"


def get_kernel_ops(name: str) -> KernelOps:
    """The kernels of backend ``name`` (``torch``, ``cpu`` or ``triton``; resolve ``auto``
    first). ``cpu`` is ``torch`` with decode rows attended by ``llm_kernels.cpu_decode`` and,
    where it builds, RMSNorm, rotary and the cache write from ``llm_kernels.cpu_layer_kernels``."""
    if name in ("torch", "cpu"):
        native = name == "cpu" and cpu_layer_kernels.available()
        layer_ops = cpu_layer_kernels if native else ops
        return KernelOps(
            name=name,
            reshape_and_cache=(
                functools.partial(
                    attention.reshape_and_cache, row_writer=cpu_layer_kernels.write_cache_rows
                )
                if native
                else attention.reshape_and_cache
            ),
            paged_attention=(
                attention.paged_attention
                if name == "torch"
                else functools.partial(
                    attention.paged_attention, decode_kernel=cpu_decode.attend_decode
                )
            ),
            copy_blocks=attention.copy_blocks,
            swap_blocks=attention.swap_blocks,
            rms_norm=layer_ops.rms_norm,
            rotary_embedding=layer_ops.rotary_embedding,
            silu_and_mul=ops.silu_and_mul,
            gelu_tanh_and_mul=ops.gelu_tanh_and_mul,
        )
    if name == "triton":
        if not triton_available():
            raise ValueError(
                "attention_backend 'triton' needs the triton package (pip install triton)"
            )
        from llm_kernels import triton_attention, triton_cache, triton_ops

        return KernelOps(
            name="triton",
            reshape_and_cache=triton_cache.reshape_and_cache,
            paged_attention=triton_attention.paged_attention,
            copy_blocks=triton_cache.copy_blocks,
            swap_blocks=triton_cache.swap_blocks,
            rms_norm=triton_ops.rms_norm,
            rotary_embedding=triton_ops.rotary_embedding,
            silu_and_mul=triton_ops.silu_and_mul,
            gelu_tanh_and_mul=triton_ops.gelu_tanh_and_mul,
        )
    raise ValueError(f"attention_backend must be 'torch', 'cpu' or 'triton' here, got {name!r}")
