"""CUDA graphs for decode steps: capture each pipeline stage's forward once per batch-size
bucket, then replay it with the step's inputs copied into the captured (static) buffers.

A decode step is bound by kernel launches on a GPU; a replay launches the whole stage at once.
Replay is only valid because the Triton kernels read everything that changes per step out of
device memory, and the grid and split-KV choice depend only on the bucket (captured with
``max_seq_len = max_model_len``); the torch attention path plans on the host and is never
captured:

    static buffer           per step                      padding rows (n .. bucket-1)
    input_ids, positions    copied in                     0
    slot_mapping            copied in                     -1  (reshape_and_cache skips them)
    seq_lens                copied in                     0   (attention reads no keys)
    block_table             first columns copied in       stale, never read (seq_len 0)
    (slot_mapping and block_table: one of each per KV cache group, ``engine.core.kv_cache_groups``)
    query_start_loc         arange(bucket + 1), fixed     one token per request
    hidden, residual        copied in (PP stages > 0)     0

Every op is row-wise except the TP all-reduce (captured: see ``DecodeCudaGraphRunner``), so
padding rows never reach real rows. Sampling (the LM head's gather, the sampler) and the PP
send/recv stay outside the graph, as in vLLM; each stage captures its own layer range.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from llm_kernels.attention_metadata import AttentionMetadata

__all__ = [
    "DecodeBucketRunner",
    "DecodeCudaGraphRunner",
    "DecodeGraphBuffers",
    "cuda_graphs_disabled_reason",
    "decode_batch_buckets",
]

logger = logging.getLogger("llm_cluster.cuda_graphs")


def decode_batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, then every multiple of 8 up to
    ``min(max_num_seqs, 256)`` (rounded up to a multiple of 8); a batch runs in the smallest
    bucket that holds it."""
    largest = min(max_num_seqs, 256)
    buckets = [b for b in (1, 2, 4, 8) if b < largest]
    buckets += range(8, largest + 8, 8) if largest > 8 else [largest]
    return tuple(sorted(set(buckets)))


def cuda_graphs_disabled_reason(
    *,
    device_type: str,
    kernel_backend: str,
    enforce_eager: bool,
    lora_enabled: bool,
    data_parallel: bool = False,
) -> str | None:
    """Why decode steps on this worker run eagerly, or None when they replay CUDA graphs.
    Tensor and pipeline parallelism do not matter: collectives are captured, stage transfers
    stay outside the graph."""
    if device_type != "cuda":
        return f"CUDA graphs need a CUDA device (this worker runs on {device_type})"
    if enforce_eager:
        return "enforce_eager is set"
    if kernel_backend != "triton":
        # The torch attention path plans its work on the host from per-step values.
        return f"the {kernel_backend} kernel backend is not capturable (only triton is)"
    if lora_enabled:
        # Each token's adapter slot changes every step and is not captured.
        return "LoRA is enabled"
    if data_parallel:
        # The MoE token exchange sizes its all-to-alls on the host, step by step.
        return "data_parallel_size > 1 (the MoE layers exchange tokens by all-to-all)"
    return None


class DecodeGraphBuffers:
    """The static inputs a decode graph reads, on any device (so their handling is tested on
    CPU): one row per request up to the largest bucket, plus hidden/residual on a pipeline
    stage after the first."""

    def __init__(
        self,
        device: torch.device,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        hidden_size: int | None = None,
        dtype: torch.dtype = torch.float32,
        num_kv_cache_groups: int = 1,
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = decode_batch_buckets(max_num_seqs)
        size = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mappings = [
            torch.full((size,), -1, dtype=torch.int64, device=device)
            for _ in range(num_kv_cache_groups)
        ]
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.block_tables = [
            torch.zeros((size, max_blocks), dtype=torch.int32, device=device)
            for _ in range(num_kv_cache_groups)
        ]
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        # A later pipeline stage continues from the previous stage's (hidden, residual).
        self.hidden: Tensor | None = None
        self.residual: Tensor | None = None
        if hidden_size is not None:
            self.hidden = torch.zeros((size, hidden_size), dtype=dtype, device=device)
            self.residual = torch.zeros((size, hidden_size), dtype=dtype, device=device)

    @property
    def slot_mapping(self) -> Tensor:
        """KV cache group 0's (the only one of most models)."""
        return self.slot_mappings[0]

    @property
    def block_table(self) -> Tensor:
        return self.block_tables[0]

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_seqs: int) -> int:
        """The smallest bucket holding ``num_seqs`` requests."""
        if not 0 < num_seqs <= self.max_batch:
            raise ValueError(f"num_seqs: must be in [1, {self.max_batch}], got {num_seqs}")
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """A pure decode batch (one new token per request) that fits the largest bucket."""
        return (
            metadata.max_query_len == 1
            and metadata.num_tokens == metadata.num_seqs
            and 0 < metadata.num_seqs <= self.max_batch
        )

    def load(
        self,
        input_ids: Tensor,
        positions: Tensor,
        metadata: AttentionMetadata,
        hidden: Tensor | None = None,
        residual: Tensor | None = None,
    ) -> int:
        """Copy one decode step into the buffers, pad up to its bucket; returns the bucket."""
        takes_hidden = self.hidden is not None
        if (hidden is not None) != takes_hidden or (residual is not None) != takes_hidden:
            raise ValueError(
                "hidden, residual: a pipeline stage after the first takes both, the first "
                f"stage neither; these buffers are for a stage that takes "
                f"{'both' if takes_hidden else 'neither'}"
            )
        n = metadata.num_seqs
        bucket = self.bucket_for(n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        for g, (slots, table) in enumerate(zip(self.slot_mappings, self.block_tables)):
            group = metadata.for_group(g)
            slots[:n].copy_(group.slot_mapping, non_blocking=True)
            slots[n:bucket].fill_(-1)
            # Columns past max_model_len's blocks can only be padding (seq_len <= max_model_len).
            width = min(group.block_table.shape[1], table.shape[1])
            table[:n, :width].copy_(group.block_table[:, :width], non_blocking=True)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.seq_lens[n:bucket].zero_()
        if self.hidden is not None and self.residual is not None:
            self.hidden[:n].copy_(hidden, non_blocking=True)
            self.residual[:n].copy_(residual, non_blocking=True)
            self.hidden[n:bucket].zero_()
            self.residual[n:bucket].zero_()
        return bucket

    def metadata(self, bucket: int) -> AttentionMetadata:
        """Attention metadata over the first ``bucket`` rows of the buffers (one per KV cache
        group, group 0's carrying them all, when there are several)."""
        groups = tuple(
            AttentionMetadata(
                num_seqs=bucket,
                num_tokens=bucket,
                block_size=self.block_size,
                max_query_len=1,
                # Kernel choices made from this host value must hold for every later length.
                max_seq_len=self.max_model_len,
                max_block_id=0,
                slot_mapping=slots[:bucket],
                block_table=table[:bucket],
                seq_lens=self.seq_lens[:bucket],
                query_start_loc=self.query_start_loc[: bucket + 1],
                decode_groups=(),
                prefill_chunks=(),
            )
            for slots, table in zip(self.slot_mappings, self.block_tables)
        )
        if len(groups) == 1:
            return groups[0]
        return dataclasses.replace(groups[0], groups=groups)

    def forward(self, model: nn.Module, bucket: int) -> tuple[Tensor, Tensor | None]:
        """The stage's forward over the first ``bucket`` rows: what a graph captures."""
        hidden = self.hidden[:bucket] if self.hidden is not None else None
        residual = self.residual[:bucket] if self.residual is not None else None
        ids, pos = self.input_ids[:bucket], self.positions[:bucket]
        return model(ids, pos, self.metadata(bucket), hidden, residual)


class DecodeBucketRunner:
    """A decode step run the way its graph runs: loaded into the static buffers, padded to its
    bucket, and computed over the bucket, eagerly. This is the whole data path of a replay
    without the capture, on any device: the CPU tests run the model runner through it (with
    TP and PP on gloo), and :class:`DecodeCudaGraphRunner` replays a graph in its place."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        num_kv_blocks: int | Sequence[int],
        hidden_size: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """``hidden_size``: set on a pipeline stage after the first (it takes hidden and
        residual inputs); None on the first stage, which embeds the input ids.
        ``num_kv_blocks``: the cache's blocks, or each KV cache group's."""
        self.model = model
        self.device = device
        self.num_kv_blocks = (
            (num_kv_blocks,) if isinstance(num_kv_blocks, int) else tuple(num_kv_blocks)
        )
        self.buffers = DecodeGraphBuffers(
            device,
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            hidden_size=hidden_size,
            dtype=dtype,
            num_kv_cache_groups=len(self.num_kv_blocks),
        )
        self.buckets = self.buffers.buckets

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return self.buffers.can_run(metadata)

    @torch.inference_mode()
    def run(
        self,
        input_ids: Tensor,
        positions: Tensor,
        metadata: AttentionMetadata,
        hidden: Tensor | None = None,
        residual: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """This stage's outputs for the decode batch, ``[num_seqs, hidden]`` each: (normed
        hidden, None) on the last stage, (hidden, residual) before it."""
        if not self.can_run(metadata):
            raise ValueError(
                f"not a decode batch of at most {self.buckets[-1]} requests: num_seqs="
                f"{metadata.num_seqs} num_tokens={metadata.num_tokens} "
                f"max_query_len={metadata.max_query_len}"
            )
        for g, num_blocks in enumerate(self.num_kv_blocks):
            max_block_id = metadata.for_group(g).max_block_id
            if max_block_id >= num_blocks:
                raise ValueError(
                    f"metadata.block_table references block {max_block_id} but the KV "
                    f"cache has {num_blocks} blocks"
                )
        n = metadata.num_seqs
        bucket = self.buffers.load(input_ids, positions, metadata, hidden, residual)
        out_hidden, out_residual = self._run_bucket(bucket)
        return out_hidden[:n], (out_residual[:n] if out_residual is not None else None)

    def _run_bucket(self, bucket: int) -> tuple[Tensor, Tensor | None]:
        return self.buffers.forward(self.model, bucket)

    @property
    def num_graphs(self) -> int:
        return 0

    def capture_all(self) -> None:
        """Nothing to capture without graphs."""

    def release(self) -> None:
        """Nothing to release without graphs."""


class DecodeCudaGraphRunner(DecodeBucketRunner):
    """One captured graph per bucket over the static buffers (``capture_all`` at startup; a
    bucket still missing is captured on first use). Invalidated by dropping it when the KV
    cache changes: the graphs hold the caches' addresses.

    Tensor parallelism: the all-reduces of the row-parallel layers and of the vocab-parallel
    embedding are captured in the graph. NCCL supports capturing its collectives since 2.9 with
    CUDA >= 11.3, on the condition that capture, and every replay, is collective: all ranks of
    the communicator capture the same operations together and replay the graph made from that
    capture (NCCL user guide, "Using NCCL with CUDA Graphs"). Here every TP rank of a stage
    receives the same ``ExecuteModelRequest``, so each picks the same bucket on the same step;
    graphs are captured at startup, on every rank, largest bucket first. PyTorch's
    ProcessGroupNCCL keeps a captured collective off its watchdog's work queue
    (pytorch/pytorch#103503) and flushes pending work before a capture starts (#104487), which
    the warm-up relies on: a communicator must have run an eager collective before one is
    captured (NCCL sets itself up on first use). Prefill steps run the same TP communicator's
    collectives eagerly between replays, which NCCL supports (captured and uncaptured
    operations may mix); its one caveat, graphs of several communicators launched from one
    thread, does not arise: a worker's graphs hold only its TP group's collectives (stage
    transfers and the logits gather stay eager). A process group whose graphs still exist can
    hang in ``destroy_process_group`` (pytorch/pytorch#115388): the model runner drops its
    graphs before the worker leaves the group.

    Pipeline parallelism: a stage after the first reads static hidden/residual buffers that the
    step fills from the previous stage's message.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        num_kv_blocks: int | Sequence[int],
        hidden_size: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device for CUDA graphs, got {device}")
        super().__init__(
            model,
            device,
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            num_kv_blocks=num_kv_blocks,
            hidden_size=hidden_size,
            dtype=dtype,
        )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor, Tensor | None]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its pool memory.
        On TP > 1 every rank of the stage must call this at the same time (collective)."""
        for bucket in sorted(self.buckets, reverse=True):
            if bucket not in self.graphs:
                self.graphs[bucket] = self._capture(bucket)
        logger.debug("captured %d decode graphs on %s", len(self.graphs), self.device)

    def _run_bucket(self, bucket: int) -> tuple[Tensor, Tensor | None]:
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, hidden, residual = self.graphs[bucket]
        graph.replay()
        return hidden, residual

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, Tensor, Tensor | None]:
        # Warm-up on a side stream, outside the graph: Triton compiles each kernel on its
        # first launch, the caching allocator settles, and NCCL has run each collective eagerly
        # before it is captured. Padding rows write no K/V.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.buffers.forward(self.model, bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, residual = self.buffers.forward(self.model, bucket)
        return graph, hidden, residual

    def release(self) -> None:
        """Destroy the graphs (their pool memory returns to the allocator's cache)."""
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
