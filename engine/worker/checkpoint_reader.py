"""Read a safetensors checkpoint at storage speed: parallel, large reads ahead of the loader.

A plain safetensors load maps the file and copies each tensor out of the mapping: one page
fault per 4 KiB, on the loader's thread, which also casts. Here the tensors a rank reads whole
are read with ``preadv`` (it releases the GIL) by a few threads, in 16 MiB pieces, into a fresh
buffer per run of neighbouring tensors, up to ``_AHEAD_BYTES`` ahead of the loader; so the disk
stays busy while the loader casts and copies earlier tensors into their parameters, and the
tensors it gets are plain CPU tensors (views of their run's buffer). A tensor a rank reads only
part of (a tensor-parallel shard) stays a lazy safetensors slice, so no rank reads more than
its share.

    file   [8-byte len][header JSON][t0][t1][t2 ...........][t3][t4] ...
    runs                            [ run 0 ][ run 1        ][ run 2 ]  ~64 MiB, or one tensor
    reads                           16 MiB preadv pieces of each run, on the pool's threads

Tensors come out in file order, file by file (sorted names), like ``safe_open``'s.
"""

from __future__ import annotations

import collections
import json
import os
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

_PIECE_BYTES = 16 << 20  # one preadv
_RUN_BYTES = 64 << 20  # neighbouring tensors read into one buffer up to this size
_AHEAD_BYTES = 512 << 20  # read ahead of the loader at most this much
_THREADS = 4


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int


@dataclass
class _Run:
    entries: list[_Entry]
    start: int
    end: int
    buffer: torch.Tensor | None = None
    reads: list[Future[None]] | None = None


def _entries(file: Path) -> list[_Entry]:
    with file.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    entries = [
        _Entry(name, info["dtype"], tuple(info["shape"]), base + start, base + end)
        for name, info in header.items()
        if name != "__metadata__"
        for start, end in [info["data_offsets"]]
    ]
    end = max((e.end for e in entries), default=base)
    size = file.stat().st_size
    if end > size:
        raise ValueError(f"{file.name}: the header says {end} bytes, the file has {size}")
    return sorted(entries, key=lambda e: e.start)


def _plan(entries: list[_Entry], read_whole: Callable[[str], bool]) -> list[_Entry | _Run]:
    """The file's tensors in order: a lazy entry where the rank reads part, else runs."""
    plan: list[_Entry | _Run] = []
    run: _Run | None = None
    for entry in entries:
        if not read_whole(entry.name) or entry.dtype not in SAFETENSORS_DTYPES:
            plan.append(entry)
            run = None
            continue
        if run is None or run.end != entry.start or run.end - run.start >= _RUN_BYTES:
            run = _Run([], entry.start, entry.start)
            plan.append(run)
        run.entries.append(entry)
        run.end = entry.end
    return plan


def _read_piece(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise OSError(f"checkpoint: unexpected end of file at byte {offset + done}")
        done += got


def _submit(run: _Run, fd: int, pool: ThreadPoolExecutor) -> None:
    run.buffer = torch.empty(run.end - run.start, dtype=torch.uint8)
    view = memoryview(run.buffer.numpy())
    run.reads = [
        pool.submit(_read_piece, fd, view[at : at + _PIECE_BYTES], run.start + at)
        for at in range(0, run.end - run.start, _PIECE_BYTES)
    ]


def _tensors(run: _Run) -> Iterator[tuple[str, torch.Tensor]]:
    assert run.buffer is not None and run.reads is not None  # submitted before it is taken
    for read in run.reads:
        read.result()
    for entry in run.entries:
        dtype = SAFETENSORS_DTYPES[entry.dtype]
        raw = run.buffer[entry.start - run.start : entry.end - run.start]
        if (entry.start - run.start) % dtype.itemsize:
            raw = raw.clone()  # not aligned to its element size inside the run's buffer
        yield entry.name, raw.view(dtype).view(entry.shape)


def read_checkpoint_file(
    file: str | Path, read_whole: Callable[[str], bool] = lambda name: True
) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every tensor of one ``.safetensors`` file in file order: a CPU
    tensor for those ``read_whole`` names (read in parallel, ahead), a lazy safetensors slice
    for the others (and for a dtype torch cannot view)."""
    file = Path(file)
    plan = _plan(_entries(file), read_whole)
    runs = [item for item in plan if isinstance(item, _Run)]
    fd = os.open(file, os.O_RDONLY)
    pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="checkpoint-read")
    try:
        with safe_open(str(file), framework="pt") as lazy:
            submitted: collections.deque[_Run] = collections.deque()
            next_run = 0
            for item in plan:
                while next_run < len(runs) and (
                    not submitted
                    or sum(r.end - r.start for r in submitted)
                    + runs[next_run].end
                    - runs[next_run].start
                    <= _AHEAD_BYTES
                ):
                    _submit(runs[next_run], fd, pool)
                    submitted.append(runs[next_run])
                    next_run += 1
                if isinstance(item, _Entry):
                    yield item.name, lazy.get_slice(item.name)
                    continue
                yield from _tensors(item)
                submitted.popleft()
                item.buffer = None  # its tensors live on only where the loader kept them
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        os.close(fd)


__all__ = ["SAFETENSORS_DTYPES", "read_checkpoint_file"]
