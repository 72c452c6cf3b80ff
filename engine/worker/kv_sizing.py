"""How many KV-cache blocks fit a worker's device: the memory budget and what it counts.

``gpu_memory_utilization`` is vLLM v1's per-instance share: the fraction of the device's memory
this worker may use; what other processes (another model's replica on the same GPU) hold does
not count against it, so replicas that share a GPU each size their cache alike. Every figure
comes from a :class:`MemoryProbe` (the CUDA driver and torch's allocator on a GPU; a fake in
tests), so the arithmetic runs anywhere. The worker measures, in order:

    init_device        start snapshot (others' memory and this CUDA context, not counted);
                       refused at once when less than total x utilization is free
    load_model         weights (and LoRA slots): torch memory allocated before profiling
    warm-up, profile   NCCL buffers on first use; activation peak of one full-budget step
    graph capture      the CUDA-graph pool: torch memory reserved by capturing every decode
                       bucket over a throw-away cache (the real capture takes the same room)
    end                non-torch growth since start (communicators, kernel modules, graph
                       executables), read while those graphs exist; then they are dropped

    kv_budget = total * utilization - non_torch - weights - activation_peak - cuda_graph_pool
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = [
    "CudaMemoryProbe",
    "KVBudget",
    "MemoryProbe",
    "MemorySnapshot",
    "check_start_memory",
    "compute_kv_budget",
    "format_bytes",
]

_GiB = 1 << 30


class MemoryProbe(Protocol):
    """What the KV sizing reads from a device. Byte counts are of the whole device
    (``mem_get_info``) or of this process's torch allocator (the rest)."""

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory, as the driver reports them."""
        ...

    def max_memory_allocated(self) -> int:
        """Peak bytes torch allocated since the last ``reset_peak_memory_stats``."""
        ...

    def memory_reserved(self) -> int:
        """Bytes torch's caching allocator holds from the driver now (graph pools included)."""
        ...

    def reset_peak_memory_stats(self) -> None: ...

    def synchronize(self) -> None: ...

    def empty_cache(self) -> None:
        """Return the allocator's cached, unused blocks to the driver."""
        ...


class CudaMemoryProbe:
    """The CUDA driver's and torch's figures for one device."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaMemoryProbe needs a CUDA device, got {device}")
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class MemorySnapshot:
    """Device memory at one moment: what the driver says is in use, and torch's share of it."""

    total: int
    free: int
    torch_reserved: int

    @property
    def used(self) -> int:
        return self.total - self.free

    @property
    def non_torch(self) -> int:
        """In use on the device but not by torch's allocator (contexts, NCCL, other processes)."""
        return self.used - self.torch_reserved

    @classmethod
    def take(cls, probe: MemoryProbe) -> MemorySnapshot:
        probe.synchronize()
        free, total = probe.mem_get_info()
        return cls(total=total, free=free, torch_reserved=probe.memory_reserved())


@dataclass(frozen=True)
class KVBudget:
    """One worker's memory budget, every figure in bytes. ``kv_cache`` may be <= 0: the
    caller decides how to refuse (see :meth:`check`)."""

    total: int
    gpu_memory_utilization: float
    # Outside torch at start: other processes and this process's CUDA context (not counted).
    used_at_start: int
    non_torch: int  # this process's growth outside torch since start: NCCL buffers, modules
    weights: int  # torch memory allocated before profiling (weights, LoRA slots, buffers)
    activation_peak: int  # extra peak of a full-budget profiling step
    cuda_graph_pool: int  # reserved by capturing every decode bucket (0 without graphs)
    kv_cache: int

    @property
    def requested(self) -> int:
        return int(self.total * self.gpu_memory_utilization)

    def num_blocks(self, block_bytes: int) -> int:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes: must be > 0, got {block_bytes}")
        return max(self.kv_cache, 0) // block_bytes

    def check(self, block_bytes: int, blocks_per_sequence: int, max_model_len: int) -> None:
        """Refuse a budget that holds no KV cache, or less than one max_model_len sequence."""
        needed = block_bytes * blocks_per_sequence
        if self.kv_cache <= 0:
            raise RuntimeError(
                f"no device memory left for the KV cache: {self.describe()}; raise "
                "gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, "
                "set enforce_eager (no graph pool), or use more GPUs (tensor_parallel_size)"
            )
        if self.kv_cache < needed:
            raise RuntimeError(
                f"the KV cache budget ({format_bytes(self.kv_cache)}) is smaller than one "
                f"sequence of max_model_len={max_model_len} tokens ({blocks_per_sequence} "
                f"blocks of {format_bytes(block_bytes)} = {format_bytes(needed)}): "
                f"{self.describe()}; lower max_model_len or raise gpu_memory_utilization"
            )

    def describe(self) -> str:
        parts = [
            f"total {format_bytes(self.total)} x utilization {self.gpu_memory_utilization:g}"
            f" = {format_bytes(self.requested)}",
            f"in use at start by others and the CUDA context {format_bytes(self.used_at_start)}"
            " (not counted)",
            f"non-torch (NCCL, modules) {format_bytes(self.non_torch)}",
            f"weights {format_bytes(self.weights)}",
            f"activation peak {format_bytes(self.activation_peak)}",
            f"CUDA-graph pool {format_bytes(self.cuda_graph_pool)}",
            f"KV cache {format_bytes(self.kv_cache)}",
        ]
        return ", ".join(parts)


def check_start_memory(start: MemorySnapshot, gpu_memory_utilization: float) -> None:
    """Refuse to start when the device has less free memory than this instance's share
    (``total x gpu_memory_utilization``): other processes on it hold the rest."""
    requested = int(start.total * gpu_memory_utilization)
    if start.free < requested:
        raise RuntimeError(
            f"gpu_memory_utilization={gpu_memory_utilization:g} asks for "
            f"{format_bytes(requested)} of the device's {format_bytes(start.total)}, but only "
            f"{format_bytes(start.free)} is free at start ({format_bytes(start.used)} in use by "
            "other processes and this one's CUDA context): lower gpu_memory_utilization to at "
            f"most {math.floor(start.free / start.total * 100) / 100:g}, or free the device "
            "(replicas that share a GPU need utilizations that sum to at most 1)"
        )


def compute_kv_budget(
    *,
    start: MemorySnapshot,
    end: MemorySnapshot,
    gpu_memory_utilization: float,
    weights: int,
    profile_peak: int,
    profile_kv_cache: int,
    cuda_graph_pool: int,
) -> KVBudget:
    """The budget from the measurements (a pure function): this instance's share of the
    device less what this worker itself took; memory in use at ``start`` (other processes,
    the CUDA context) is not subtracted.

    ``start``: snapshot at ``init_device``; ``end``: snapshot after the warm-up collectives,
    the profiling step and the graph capture (non-torch memory only grows). ``weights``: torch
    memory allocated when profiling began; ``profile_peak``: torch's peak allocation during the
    profiling step, which includes ``weights`` and the small ``profile_kv_cache`` the step
    wrote into (freed afterwards; the real cache is what this budget sizes)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(
            f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization!r}"
        )
    if start.total != end.total:
        raise ValueError(f"device total changed from {start.total} to {end.total} bytes")
    for name, value in (
        ("weights", weights),
        ("profile_peak", profile_peak),
        ("profile_kv_cache", profile_kv_cache),
        ("cuda_graph_pool", cuda_graph_pool),
    ):
        if value < 0:
            raise ValueError(f"{name}: must be >= 0 bytes, got {value}")
    # Outside torch at start (others, the CUDA context): not this instance's to count; torch's
    # own memory at start is allocated memory, inside ``weights``.
    used_at_start = start.non_torch
    non_torch = max(end.non_torch - start.non_torch, 0)
    activation_peak = max(profile_peak - weights - profile_kv_cache, 0)
    requested = int(start.total * gpu_memory_utilization)
    kv_cache = requested - non_torch - weights - activation_peak - cuda_graph_pool
    return KVBudget(
        total=start.total,
        gpu_memory_utilization=gpu_memory_utilization,
        used_at_start=used_at_start,
        non_torch=non_torch,
        weights=weights,
        activation_peak=activation_peak,
        cuda_graph_pool=cuda_graph_pool,
        kv_cache=kv_cache,
    )


def format_bytes(n: int) -> str:
    """GiB with two decimals from 1 GiB up, MiB below (so a small figure is not "0.00")."""
    if abs(n) >= _GiB:
        return f"{n / _GiB:.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"
