"""A native paged decode-attention kernel for x86 CPUs (``csrc/cpu_paged_decode.cpp``), built for
AVX-512 or AVX2, whichever this CPU has (AVX-512 first).

The torch path (``llm_kernels.attention``) attends decode requests by gathering each group's K/V
blocks into a contiguous buffer and calling SDPA on it: two passes over K/V plus the padding of
the group. The kernel here reads each request's keys and values in place from the paged cache,
once, with float32 scores, softmax and accumulation (bf16/fp16 values are widened exactly), and
writes the output rows directly (measured: BENCHMARKS.md, "A native decode kernel for CPU").

It covers decode rows only (one query token per request), caches in float32, bfloat16 or float16
(not FP8) with the query in the same dtype, head dims this file's C++ instantiates, sliding
windows, soft-capping and attention sinks, and DeepSeek's one-plane latent cache (MLA: keys of
576, values their first 512, every query head over the one latent head). Everything else, and
every prefill chunk, stays on the torch path: ``attend_decode`` returns False and the caller
attends those rows itself. The C++ is compiled on first use (``_build``);
``native_decode_available()`` builds it, and a build failure (no compiler) or a CPU with
neither instruction set is logged once and the torch path is used.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
from torch import Tensor

from llm_kernels.native_build import build_extension

__all__ = [
    "ISAS",
    "NATIVE_DTYPES",
    "attend_decode",
    "isa_supported",
    "native_decode_available",
    "native_decode_covers",
    "native_isa",
]

logger = logging.getLogger("llm_cluster.kernels")

NATIVE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
# Instruction sets the kernel is built for, in order of preference.
ISAS: tuple[str, ...] = ("avx512", "avx2")

_SOURCE = "cpu_paged_decode.cpp"
_ISA_FLAGS = {
    "avx512": ["-DLLMC_ISA_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx2": ["-DLLMC_ISA_AVX2", "-mavx2"],
}
_COMMON_FLAGS = ["-O3", "-mfma", "-mf16c", "-fopenmp"]


def isa_supported(isa: str) -> bool:
    """Whether this CPU runs code built for ``isa`` (one of ``ISAS``)."""
    if isa not in _ISA_FLAGS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    checker = getattr(torch.cpu, f"_is_{isa}_supported", None)
    return bool(checker is not None and checker())


@functools.cache
def _native_module(isa: str) -> ModuleType | None:
    """The extension built for ``isa``, or None (logged once) where it cannot be built or run."""
    if not isa_supported(isa):
        return None
    try:
        return _build(isa)
    except Exception as exc:  # any build failure means "use the torch path"
        logger.warning(
            "native CPU decode attention (%s) unavailable (%s: %s); using the torch path",
            isa,
            type(exc).__name__,
            str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
        )
        return None


def _build(isa: str) -> ModuleType:
    """Compile (or find compiled) and import the extension for ``isa``
    (``llm_kernels.native_build``: ~10 s once per instruction set, then cached)."""
    return build_extension(
        f"llm_cluster_cpu_paged_decode_{isa}", _SOURCE, _ISA_FLAGS[isa] + _COMMON_FLAGS
    )


@functools.cache
def native_isa() -> str | None:
    """The instruction set the kernel runs with here (built on the first call, ~10 s, then
    loaded from the cache), or None: the torch path."""
    for isa in ISAS:
        if _native_module(isa) is not None:
            return isa
    logger.info("native CPU decode attention: no AVX-512 or AVX2 build here; using torch")
    return None


def native_decode_available(isa: str | None = None) -> bool:
    """Whether the kernel runs here (see :func:`native_isa`); with ``isa``, whether that build
    does (the tests run every build the CPU can)."""
    return native_isa() is not None if isa is None else _native_module(isa) is not None


@functools.cache
def _head_dims(isa: str) -> frozenset[int]:
    module = _native_module(isa)
    return frozenset(module.supported_head_dims()) if module is not None else frozenset()


@functools.cache
def _latent_dims(isa: str) -> frozenset[tuple[int, int]]:
    module = _native_module(isa)
    if module is None:
        return frozenset()
    return frozenset((int(k), int(v)) for k, v in module.supported_latent_dims())


def native_decode_covers(
    query: Tensor, kv_cache: Tensor, value_dim: int | None = None, isa: str | None = None
) -> bool:
    """Whether :func:`attend_decode` handles a call with these tensors (device, dtypes, layout,
    head dim); the caller checked their shapes against each other already. A K/V cache needs a
    head dim the kernel is built for; a one-plane latent cache (MLA), whose values are each
    key's first ``value_dim``, a (head dim, ``value_dim``) pair it is built for (DeepSeek's
    576 / 512)."""
    isa = isa or native_isa()
    if isa is None:
        return False
    head_dim = query.shape[2]
    if kv_cache.shape[0] == 2:
        dims_covered = head_dim in _head_dims(isa) and value_dim in (None, head_dim)
    else:
        dims_covered = (head_dim, value_dim) in _latent_dims(isa)
    return (
        dims_covered
        and query.device.type == "cpu"
        and kv_cache.device.type == "cpu"
        and query.dtype in NATIVE_DTYPES
        and kv_cache.dtype == query.dtype
        and kv_cache.is_contiguous()
        and query.stride(2) == 1
    )


def attend_decode(
    query: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    decode_seqs: Tensor,
    scale: float,
    window: int | None,
    soft_cap: float | None,
    sinks: Tensor | None,
    out: Tensor,
    isa: str | None = None,
) -> bool:
    """Attend the decode requests ``decode_seqs`` (int32 indices into the step's requests, each
    with one query row) and write their rows of ``out``; False, with nothing written, when the
    kernel does not cover this call (see :func:`native_decode_covers`).

    ``block_table``/``seq_lens``/``query_start_loc`` are ``AttentionMetadata``'s int32 tensors;
    ``out`` is contiguous ``[num_tokens, num_heads, value_dim]`` in ``query.dtype`` (value_dim
    the head dim for a K/V cache, fewer over a latent one). A request
    sees its keys ``seq_len - window <= k < seq_len`` with a window, all of them without;
    ``sinks`` (float ``[num_heads]``) join each head's softmax denominator as logits with no value.
    ``isa`` picks a build (tests run each); None is :func:`native_isa`'s.
    """
    isa = isa or native_isa()
    if isa is None or not native_decode_covers(query, kv_cache, out.shape[-1], isa):
        return False
    if decode_seqs.numel() == 0:
        return True
    module = _native_module(isa)
    if module is None:  # covered above; keeps the type checker honest
        return False
    module.paged_decode(
        out,
        query,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        decode_seqs,
        float(scale),
        int(window or 0),
        float(soft_cap or 0.0),
        None if sinks is None else sinks.to(torch.float32).contiguous(),
    )
    return True
