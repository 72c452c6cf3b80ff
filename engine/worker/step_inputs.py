"""A worker's per-request state and the packed inputs of one step: ``CachedRequestState`` (what
a worker keeps of each running request between steps: tokens, block tables, sampling state),
``StepInputs`` (a step's packed token ids, positions, attention metadata and the rows to sample,
score, constrain and pool), and the row selections ``ModelRunner.prepare_inputs`` builds them
with."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.core.structured_output import unpack_bitmask
from engine.multimodal.mrope import MRopePositions
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.worker.sampler import SamplingMetadata
from engine.worker.step_messages import ExecuteModelRequest
from llm_kernels.attention_metadata import AttentionMetadata


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    # One block table per KV cache group, as the group's local ids.
    block_ids: list[list[int]]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    num_computed_tokens: int = 0
    num_prompt_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    # Pooling requests only (driver rank): the float32 sum of the hidden rows of positions
    # [0, num_pooled) for mean pooling.
    pooling_params: PoolingParams | None = None
    pooled_sum: torch.Tensor | None = None
    num_pooled: int = 0
    lora_int_id: int = 0
    # An M-RoPE model's 3-D prompt positions (None: text positions on all three axes).
    mrope: MRopePositions | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    # Rows of the packed batch whose logits are sampled: one per request in sampled_req_ids,
    # then k + 1 per request in spec_req_ids (its last token and its k proposals).
    logits_indices: torch.Tensor
    sampled_req_ids: list[str] = field(default_factory=list)
    spec_req_ids: list[str] = field(default_factory=list)
    # Prompt logprobs wanted this step: (req_id, first prompt token scored, rows in the packed
    # batch whose logits score it and the following ones).
    prompt_logprobs_rows: list[tuple[str, int, np.ndarray]] = field(default_factory=list)
    # Structured outputs: rows of the sampled logits to mask, and their bitmask rows.
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    # The same for the verification rows (offsets within the spec_req_ids' block of rows).
    spec_grammar_rows: list[int] = field(default_factory=list)
    spec_grammar_bitmask: np.ndarray | None = None
    # Pooling requests in this step: (req_id, first position pooled, rows of the packed batch
    # to pool, whether this chunk ends the prompt).
    pooling_rows: list[tuple[str, int, np.ndarray, bool]] = field(default_factory=list)
    # The driver's sampling tensors, built before the forward pass is queued: copying host
    # lists to the device waits for the stream, so after the launch it would wait for the
    # whole forward pass and keep the host idle meanwhile.
    sampling_metadata: SamplingMetadata | None = None
    # A VLM's image tokens in this step: their rows of the packed batch and the embeddings
    # that replace those rows' token embeddings (engine.worker.encoder_cache).
    mm_rows: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None
    # An M-RoPE model's positions ``[3, num_tokens]`` (t, h, w), which its rotary reads in
    # place of ``positions`` (those stay the KV-cache positions).
    mrope_positions: torch.Tensor | None = None


def block_tables(states: list[CachedRequestState], num_groups: int) -> list[np.ndarray]:
    """Each KV cache group's block table of the step, ``[num_seqs, max_blocks]``."""
    tables = []
    for g in range(num_groups):
        table = np.zeros((len(states), max(len(s.block_ids[g]) for s in states)), np.int32)
        for i, state in enumerate(states):
            table[i, : len(state.block_ids[g])] = state.block_ids[g]
        tables.append(table)
    return tables


def grammar_bitmask_rows(
    req: ExecuteModelRequest, sampled_req_ids: list[str]
) -> tuple[list[int], np.ndarray | None]:
    """Which sampled rows the step's grammar bitmask constrains, and its rows in that order.
    The head sends a row exactly for the constrained requests that sample this step (the
    same rule as here); a row for a request that does not sample is skipped, and the
    head's matcher would reject an unconstrained token."""
    if not req.structured_output_req_ids:
        return [], None
    bitmask = unpack_bitmask(req.grammar_bitmask, len(req.structured_output_req_ids))
    position = {rid: i for i, rid in enumerate(sampled_req_ids)}
    pairs = [
        (position[rid], i) for i, rid in enumerate(req.structured_output_req_ids) if rid in position
    ]
    if not pairs:
        return [], None
    return [row for row, _ in pairs], bitmask[[i for _, i in pairs]]


def prompt_logprobs_rows(
    states: list[CachedRequestState], starts: np.ndarray, ends: np.ndarray, cu: np.ndarray
) -> list[tuple[str, int, np.ndarray]]:
    rows = []
    for i, state in enumerate(states):
        if state.sampling_params.prompt_logprobs is None:
            continue
        # Positions t in [start, end) with t + 1 < num_prompt_tokens score prompt token t + 1.
        last = min(int(ends[i]), state.num_prompt_tokens - 1)
        if last > starts[i]:
            rows.append((state.req_id, int(starts[i]) + 1, cu[i] + np.arange(last - starts[i])))
    return rows


def pooling_rows(
    states: list[CachedRequestState],
    starts: np.ndarray,
    ends: np.ndarray,
    cu: np.ndarray,
    mean: bool,
) -> list[tuple[str, int, np.ndarray, bool]]:
    """The rows each pooling request pools this step (``mean``: every computed prompt position,
    once; else the last prompt position, in the chunk that ends the prompt)."""
    rows = []
    for i, state in enumerate(states):
        if state.pooling_params is None:
            continue
        start, end = int(starts[i]), int(ends[i])
        finishes = end == len(state.token_ids)
        if mean:
            if start > state.num_pooled:
                raise RuntimeError(
                    f"mean pooling of {state.req_id!r}: positions [{state.num_pooled}, "
                    f"{start}) were never computed (a prefix-cache hit?)"
                )
            first = max(start, state.num_pooled)
            req_rows = cu[i] + np.arange(first - start, end - start)
            rows.append((state.req_id, first, req_rows, finishes))
        elif finishes:
            rows.append((state.req_id, end - 1, np.array([cu[i + 1] - 1]), True))
    return rows


def mrope_positions_of(
    states: list[CachedRequestState],
    starts: np.ndarray,
    ends: np.ndarray,
    cu: np.ndarray,
    positions: np.ndarray,
    device: torch.device,
) -> torch.Tensor:
    """An M-RoPE model's ``[3, num_tokens]`` positions: each chunk's slice of its request's
    3-D positions (``engine.multimodal.mrope``), the text position on all three axes for a
    request without images."""
    out = np.repeat(positions[None].astype(np.int64), 3, axis=0)
    for i, state in enumerate(states):
        if state.mrope is not None:
            out[:, cu[i] : cu[i + 1]] = state.mrope.for_range(int(starts[i]), int(ends[i]))
    return torch.from_numpy(out).to(device)
