"""Zero-filled KV cache tensors without a zeroing pass on the CPU.

``torch.zeros`` of a multi-GiB KV pool writes every byte before the engine serves (and again on
every wake from sleep): ~1.2 s for 2 GiB on a 2-core VM, and it commits all the memory at once.
On the CPU the pool is instead an anonymous memory mapping, which the kernel hands out zeroed
and commits page by page as blocks are first written: the cache costs nothing until requests
fill it, reads of never-written slots still see zeros (the same values as ``torch.zeros``, so
no kernel sees anything new), and dropping the tensor unmaps it at once (sleep mode's release).
On CUDA the pool comes from the caching allocator, whose memory is not zeroed and where a
memset costs a negligible fraction of a start: ``torch.zeros`` there.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["zeroed_tensor"]


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous zero tensor; on the CPU backed by pages committed on first write."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # MAP_PRIVATE | MAP_ANONYMOUS: zero-filled by the kernel; the tensor keeps the map alive.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
