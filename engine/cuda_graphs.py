"""CUDA graphs for decode steps: capture the model's forward once per batch-size bucket,
then replay it with the step's inputs copied into the captured (static) buffers.

A decode step launches a few kernels per layer on tiny tensors, so on a GPU it is bound by
launch overhead; a replay launches the whole step at once. Replay is only valid because the
Triton kernels read everything that changes from step to step out of device memory:

    static buffer           per step                      padding rows (n .. bucket-1)
    input_ids, positions    copied in                     0
    slot_mapping            copied in                     -1  (reshape_and_cache skips them)
    seq_lens                copied in                     0   (attention reads no keys)
    block_table             first columns copied in       stale, never read (seq_len 0)
    query_start_loc         arange(bucket + 1), fixed     one token per request

and the grid and split-KV choice depend only on the bucket (captured with
``max_seq_len = max_model_len``). The torch attention path plans its work on the host per step
and is never captured. Used with TP = PP = 1 only: no collective is captured.
"""

from __future__ import annotations

import bisect

import torch
from torch import Tensor, nn

from kernels.attention import AttentionMetadata

__all__ = ["DecodeCudaGraphRunner", "decode_batch_buckets"]


def decode_batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, then every multiple of 8 up to
    ``min(max_num_seqs, 256)`` (rounded up to a multiple of 8); a batch runs in the smallest
    bucket that holds it."""
    largest = min(max_num_seqs, 256)
    buckets = [b for b in (1, 2, 4, 8) if b < largest]
    buckets += range(8, largest + 8, 8) if largest > 8 else [largest]
    return tuple(sorted(set(buckets)))


class DecodeCudaGraphRunner:
    """Owns the static input buffers and one captured graph per bucket (captured lazily, on
    the first batch that needs it). Invalidated by dropping it when the KV cache changes."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        num_kv_blocks: int,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device for CUDA graphs, got {device}")
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.buckets = decode_batch_buckets(max_num_seqs)
        size = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((size, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """A pure decode batch (one new token per request) that fits the largest bucket."""
        return (
            metadata.max_query_len == 1
            and metadata.num_tokens == metadata.num_seqs
            and 0 < metadata.num_seqs <= self.buckets[-1]
        )

    @torch.inference_mode()
    def run(self, input_ids: Tensor, positions: Tensor, metadata: AttentionMetadata) -> Tensor:
        """The model's final hidden states for this decode batch, ``[num_seqs, hidden]``."""
        if not self.can_run(metadata):
            raise ValueError(
                f"not a decode batch of at most {self.buckets[-1]} requests: num_seqs="
                f"{metadata.num_seqs} num_tokens={metadata.num_tokens} "
                f"max_query_len={metadata.max_query_len}"
            )
        if metadata.max_block_id >= self.num_kv_blocks:
            raise ValueError(
                f"metadata.block_table references block {metadata.max_block_id} but the KV "
                f"cache has {self.num_kv_blocks} blocks"
            )
        n = metadata.num_seqs
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        self._load_inputs(input_ids, positions, metadata, bucket)
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, hidden = self.graphs[bucket]
        graph.replay()
        return hidden[:n]

    def _load_inputs(
        self, input_ids: Tensor, positions: Tensor, metadata: AttentionMetadata, bucket: int
    ) -> None:
        n = metadata.num_seqs
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        # Columns past max_model_len's blocks can only be padding (seq_len <= max_model_len).
        width = min(metadata.block_table.shape[1], self.block_table.shape[1])
        self.block_table[:n, :width].copy_(metadata.block_table[:, :width], non_blocking=True)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(-1)
        self.seq_lens[n:bucket].zero_()

    def _static_metadata(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_seqs=bucket,
            num_tokens=bucket,
            block_size=self.block_size,
            max_query_len=1,
            # Kernel choices made from this host value must hold for every later length.
            max_seq_len=self.max_model_len,
            max_block_id=0,
            slot_mapping=self.slot_mapping[:bucket],
            block_table=self.block_table[:bucket],
            seq_lens=self.seq_lens[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            decode_groups=(),
            prefill_chunks=(),
        )

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        metadata = self._static_metadata(bucket)
        ids, pos = self.input_ids[:bucket], self.positions[:bucket]
        # Warm-up on a side stream, outside the graph: Triton compiles each kernel on its
        # first launch, and the caching allocator settles. Padding rows write no K/V.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model(ids, pos, metadata)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, _ = self.model(ids, pos, metadata)
        return graph, hidden
