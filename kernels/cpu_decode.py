"""A native paged decode-attention kernel for x86 CPUs with AVX-512 (``csrc/cpu_paged_decode.cpp``).

The torch path (``kernels.attention``) attends decode requests by gathering each group's K/V
blocks into a contiguous buffer and calling SDPA on it: two passes over K/V plus the padding of
the group. The kernel here reads each request's keys and values in place from the paged cache,
once, with float32 scores, softmax and accumulation (bf16/fp16 values are widened exactly), and
writes the output rows directly. On the 2-core AVX-512 VM measured (BENCHMARKS.md, "A native
decode kernel for CPU") it is 4.7-6x faster than gather + SDPA at the batch-64 contexts of the
serving benchmark.

It covers decode rows only (one query token per request), caches in float32, bfloat16 or float16
(not FP8) with the query in the same dtype, head dims this file's C++ instantiates, sliding
windows and soft-capping. Everything else, and every prefill chunk, stays on the torch path:
``attend_decode`` returns False and the caller attends those rows itself.

The C++ is compiled on first use with torch's extension builder (g++ and ninja, ~20 s once; the
result is cached under ``TORCH_EXTENSIONS_DIR``, ``~/.cache/torch_extensions`` by default, in a
folder named by a hash of the source) for
AVX-512F/BW/VL/DQ explicitly, not ``-march=native``, so one cache shared by several machines
holds a binary every AVX-512 machine runs. ``native_decode_available()`` builds it; a build
failure (no compiler, no AVX-512) is logged once and the torch path is used.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

__all__ = ["NATIVE_DTYPES", "attend_decode", "native_decode_available", "native_decode_covers"]

logger = logging.getLogger("llm_cluster.kernels")

NATIVE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_paged_decode.cpp"
_CFLAGS = [
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mfma",
    "-mf16c",
    "-fopenmp",
]
_build_lock = threading.Lock()


def _cpu_has_avx512() -> bool:
    checker = getattr(torch.cpu, "_is_avx512_supported", None)
    return bool(checker is not None and checker())


@functools.cache
def _native_module() -> ModuleType | None:
    """The compiled extension, or None (logged once) where it cannot be built or run here."""
    if not _cpu_has_avx512():
        logger.info("native CPU decode attention: this CPU has no AVX-512; using the torch path")
        return None
    try:
        with _build_lock:
            return _build()
    except Exception as exc:  # any build failure means "use the torch path"
        logger.warning(
            "native CPU decode attention unavailable (%s: %s); using the torch path",
            type(exc).__name__,
            str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
        )
        return None


def _build() -> ModuleType:
    """Compile (or find compiled) and import the extension. Its build folder is named by a hash
    of the source, flags and torch version, and guarded by an ``flock`` that dies with its
    holder: torch's own lock file outlives a process killed mid-build (a worker whose app was
    deleted) and would make every later build wait forever, so it is cleared under the flock."""
    from torch.utils import cpp_extension

    key = hashlib.sha256(
        b"\0".join([_SOURCE.read_bytes(), " ".join(_CFLAGS).encode(), torch.__version__.encode()])
    ).hexdigest()[:16]
    root = Path(
        os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    )
    build_dir = root / f"llm_cluster_cpu_paged_decode_{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # The ninja that `pip install ninja` puts beside this interpreter, even where the process's
    # PATH does not name the venv (a Ray worker started without it).
    path = os.environ.get("PATH", "")
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path
    with open(build_dir.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        return cpp_extension.load(
            name="llm_cluster_cpu_paged_decode",
            sources=[str(_SOURCE)],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )


def native_decode_available() -> bool:
    """Whether the kernel runs here: an AVX-512 CPU and a build that succeeded (it builds on the
    first call, ~20 s, then loads from the cache)."""
    return _native_module() is not None


@functools.cache
def _head_dims() -> frozenset[int]:
    module = _native_module()
    return frozenset(module.supported_head_dims()) if module is not None else frozenset()


def native_decode_covers(query: Tensor, kv_cache: Tensor) -> bool:
    """Whether :func:`attend_decode` handles a call with these tensors (device, dtypes, layout,
    head dim); the caller checked their shapes against each other already."""
    return (
        query.device.type == "cpu"
        and kv_cache.device.type == "cpu"
        and query.dtype in NATIVE_DTYPES
        and kv_cache.dtype == query.dtype
        and kv_cache.is_contiguous()
        and query.stride(2) == 1
        and native_decode_available()
        and query.shape[2] in _head_dims()
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
    out: Tensor,
) -> bool:
    """Attend the decode requests ``decode_seqs`` (int32 indices into the step's requests, each
    with one query row) and write their rows of ``out``; False, with nothing written, when the
    kernel does not cover this call (see :func:`native_decode_covers`).

    ``block_table``/``seq_lens``/``query_start_loc`` are ``AttentionMetadata``'s int32 tensors;
    ``out`` is contiguous ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``. A request
    sees its keys ``seq_len - window <= k < seq_len`` with a window, all of them without.
    """
    if not native_decode_covers(query, kv_cache):
        return False
    if decode_seqs.numel() == 0:
        return True
    module = _native_module()
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
    )
    return True
