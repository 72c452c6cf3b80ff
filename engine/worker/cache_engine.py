"""One worker's paged KV cache (vLLM's ``CacheEngine``): per KV cache group, its layers' device
caches and CPU swap caches, allocated and released as a whole, and the step's block operations
(copy-on-write copies, swaps out to and in from CPU) applied to them.

    group g: device caches [layer][num_blocks_g, ...]   CPU caches [layer][num_cpu_blocks_g, ...]
             local block id = global id - offset_g  (``engine.core.kv_cache_groups``)

The layers are the model's paged attention layers and then a draft model's; each is told its
group here and reads its cache from ``attn.kv_cache``. ``engine.worker.model_runner`` holds one
and sets up the decode CUDA graphs over the caches it allocates.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from engine.config import EngineConfig
from engine.core.kv_cache_groups import KVCacheLayout, group_of_window, kv_cache_group_specs
from engine.worker.step_messages import ExecuteModelRequest
from engine.worker.zeroed_memory import zeroed_tensor
from llm_kernels.backend import KernelOps
from llm_kernels.kv_quant import kv_cache_torch_dtype


class CacheEngine:
    """The KV caches of ``model_layers`` (the target's, in layer order) and ``draft_layers``:
    ``kv_caches`` is the target's per layer, ``group_caches`` / ``group_cpu_caches`` every
    layer's (the draft's included) per KV cache group."""

    def __init__(
        self,
        config: EngineConfig,
        model_layers: Sequence[nn.Module],
        draft_layers: Sequence[nn.Module],
        device: torch.device,
        kernel_ops: KernelOps,
    ) -> None:
        self.config = config
        self.device = device
        self.kernel_ops = kernel_ops
        self.block_size = config.cache.block_size
        self._model_layers = list(model_layers)
        self._layers = [*model_layers, *draft_layers]
        self.group_specs = kv_cache_group_specs(config.model.hf_config, config.max_model_len)
        self.layout = KVCacheLayout.uniform(self.group_specs, 0, 0)
        for attn in self._layers:
            attn.kv_cache_group = group_of_window(
                self.group_specs, attn.sliding_window, config.max_model_len
            )
        # The target's layers' caches, in layer order (the draft's are the draft's).
        self.kv_caches: list[torch.Tensor] = []
        # Per KV cache group: its layers' device caches and swap caches (draft's included).
        self.group_caches: list[list[torch.Tensor]] = []
        self.group_cpu_caches: list[list[torch.Tensor]] = []

    def block_bytes(self) -> int:
        """Bytes of one block across this worker's layers (K and V, or a latent)."""
        return sum(self.group_block_bytes())

    def group_block_bytes(self) -> list[int]:
        """Bytes of one block of each KV cache group's layers on this worker (the draft's
        included; 0 for a group with no layer here)."""
        itemsize = self.cache_dtype().itemsize
        out = [0] * len(self.group_specs)
        for attn in self._layers:
            shape = attn.kv_cache_shape(1, self.block_size)
            out[attn.kv_cache_group] += int(np.prod(shape)) * itemsize
        return out

    def cache_dtype(self) -> torch.dtype:
        """The caches' dtype: the model's, or float8_e4m3fn under kv_cache_dtype fp8."""
        return kv_cache_torch_dtype(self.config.cache.cache_dtype, self.config.model.torch_dtype)

    def allocate(
        self, num_blocks: int | Sequence[int], num_cpu_blocks: int | Sequence[int]
    ) -> None:
        """Allocate the caches (dropping the old ones): per KV cache group, that group's
        count (an int: every group the same). Anything that holds the old caches' addresses
        (captured graphs) must be released first."""
        cache_dtype = self.cache_dtype()
        n = len(self.group_specs)
        blocks = (num_blocks,) * n if isinstance(num_blocks, int) else tuple(num_blocks)
        cpu = (num_cpu_blocks,) * n if isinstance(num_cpu_blocks, int) else tuple(num_cpu_blocks)
        self.layout = KVCacheLayout(self.group_specs, blocks, cpu)
        self.group_caches = [[] for _ in range(n)]
        self.group_cpu_caches = [[] for _ in range(n)]
        pin = self.device.type == "cuda"
        for attn in self._layers:
            g = attn.kv_cache_group
            shape = attn.kv_cache_shape(blocks[g], self.block_size)
            cache = zeroed_tensor(shape, cache_dtype, self.device)  # CPU: committed on write
            attn.kv_cache = cache
            self.group_caches[g].append(cache)
            if cpu[g]:
                # torch.empty: swap space pages are only committed when a block is swapped out.
                cpu_cache = torch.empty(
                    attn.kv_cache_shape(cpu[g], self.block_size), dtype=cache_dtype, pin_memory=pin
                )
                self.group_cpu_caches[g].append(cpu_cache)
        self.kv_caches = [a.kv_cache for a in self._model_layers]

    def release(self) -> None:
        """Drop the caches, for sleep mode: nothing of them is referenced after this (once
        whatever else held them, the graphs and the draft, has let go)."""
        for attn in self._layers:
            attn.kv_cache = None
        self.kv_caches = []
        self.group_caches = []
        self.group_cpu_caches = []

    def apply_block_ops(self, req: ExecuteModelRequest) -> None:
        """Copies and swaps, each in the caches of the KV cache group its block ids are in
        (the draft's layers included: its blocks move with the target's)."""
        layout = self.layout
        # Swap-outs first: a block swapped out may be given, in the same step, to another
        # request as a copy-on-write destination or a swap-in's (the scheduler cancels the
        # copies of a request it preempts, so no copy targets a block swapped out after it).
        # Swap-ins before copies: a copy's source may be a block just swapped in.
        if req.blocks_to_swap_out:
            out = layout.split_pairs(req.blocks_to_swap_out, device_first=True)
            self._swap(out, to_cpu=True)
        if req.blocks_to_swap_in:
            self._swap(layout.split_pairs(req.blocks_to_swap_in, device_first=False), to_cpu=False)
        if req.blocks_to_copy:
            copy_blocks = self.kernel_ops.copy_blocks
            for g, pairs in enumerate(layout.split_copies(req.blocks_to_copy)):
                if pairs:
                    mapping = torch.tensor(pairs, dtype=torch.int64, device=self.device)
                    copy_blocks(self.group_caches[g], mapping)

    def _swap(self, pairs_by_group: list[list[tuple[int, int]]], *, to_cpu: bool) -> None:
        swap_blocks = self.kernel_ops.swap_blocks
        for g, pairs in enumerate(pairs_by_group):
            if not pairs:
                continue
            mapping = torch.tensor(pairs, dtype=torch.int64)
            for device_cache, cpu_cache in zip(self.group_caches[g], self.group_cpu_caches[g]):
                if to_cpu:
                    swap_blocks(device_cache, cpu_cache, mapping)
                else:
                    swap_blocks(cpu_cache, device_cache, mapping)
