"""Runs one step on one worker: applies the ExecuteModelRequest to the persistent per-request
state, prepares the packed inputs, runs the model and (on the sampling rank) samples.

Per step, for each scheduled request r with c = num_computed_tokens and n scheduled tokens:

    input_ids   = tokens[c : c+n]            positions = c .. c+n-1
    slot_mapping[t] = block_ids[pos // block_size] * block_size + pos % block_size
    seq_len = c + n                          sampled iff c + n == len(tokens)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from engine.config import EngineConfig
from engine.protocol import ExecuteModelRequest, ModelRunnerOutput
from engine.sampler import SamplingMetadata, sample
from engine.sampling_params import SamplingParams
from kernels.attention import AttentionMetadata, copy_blocks, swap_blocks
from parallel.distributed import recv_intermediate, send_intermediate
from parallel.state import ParallelContext


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    num_computed_tokens: int = 0


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the packed batch whose logits are sampled
    sampled_req_ids: list[str] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model: nn.Module, device: torch.device,
        ctx: ParallelContext | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.ctx = ctx or ParallelContext()
        self.block_size = config.cache.block_size
        self.vocab_size = config.model.vocab_size
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.cpu_kv_caches: list[torch.Tensor] = []

    # ---- KV cache -----------------------------------------------------------------------

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        attn = self.model.attention_layers()[0]
        return (2, num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)

    def kv_block_bytes(self) -> int:
        """Bytes of one block across this worker's layers (K and V)."""
        layers = self.model.attention_layers()
        if not layers:
            return 0
        per_layer = int(np.prod(self.kv_cache_shape(1))) * self.config.model.torch_dtype.itemsize
        return per_layer * len(layers)

    def initialize_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        dtype = self.config.model.torch_dtype
        self.kv_caches = []
        self.cpu_kv_caches = []
        for attn in self.model.attention_layers():
            cache = torch.zeros(self.kv_cache_shape(num_blocks), dtype=dtype, device=self.device)
            attn.kv_cache = cache
            self.kv_caches.append(cache)
            if num_cpu_blocks:
                # torch.empty: swap space pages are only committed when a block is swapped out.
                pin = self.device.type == "cuda"
                self.cpu_kv_caches.append(
                    torch.empty(self.kv_cache_shape(num_cpu_blocks), dtype=dtype, pin_memory=pin)
                )

    # ---- persistent batch ---------------------------------------------------------------

    def update_states(self, req: ExecuteModelRequest) -> None:
        for rid in req.finished_req_ids:
            self.requests.pop(rid, None)
        for new in req.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                sampling_params=params,
                generator=generator,
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in req.scheduled_cached_reqs:
            state = self.requests.get(cached.req_id)
            if state is None:
                raise RuntimeError(f"worker has no state for running request {cached.req_id!r}")
            state.token_ids.extend(cached.new_token_ids)
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def apply_block_ops(self, req: ExecuteModelRequest) -> None:
        if req.blocks_to_swap_out:
            mapping = torch.tensor(req.blocks_to_swap_out, dtype=torch.int64)
            for device_cache, cpu_cache in zip(self.kv_caches, self.cpu_kv_caches):
                swap_blocks(device_cache, cpu_cache, mapping)
        if req.blocks_to_swap_in:
            mapping = torch.tensor(req.blocks_to_swap_in, dtype=torch.int64)
            for device_cache, cpu_cache in zip(self.kv_caches, self.cpu_kv_caches):
                swap_blocks(cpu_cache, device_cache, mapping)
        if req.blocks_to_copy:
            mapping = torch.tensor(req.blocks_to_copy, dtype=torch.int64, device=self.device)
            copy_blocks(self.kv_caches, mapping)

    # ---- inputs -------------------------------------------------------------------------

    def prepare_inputs(self, req: ExecuteModelRequest) -> StepInputs:
        bs = self.block_size
        states = [self.requests[rid] for rid in req.num_scheduled_tokens]
        query_lens = np.fromiter(req.num_scheduled_tokens.values(), dtype=np.int32, count=len(states))
        starts = np.array([s.num_computed_tokens for s in states], dtype=np.int32)
        seq_lens = starts + query_lens
        num_tokens = int(query_lens.sum())
        # Positions of every packed token: start of its request + offset inside the chunk.
        cu = np.concatenate(([0], np.cumsum(query_lens)))
        req_index = np.repeat(np.arange(len(states)), query_lens)
        positions = starts[req_index] + (np.arange(num_tokens) - cu[:-1][req_index])
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = np.zeros((len(states), max_blocks), dtype=np.int32)
        input_ids = np.empty(num_tokens, dtype=np.int64)
        for i, state in enumerate(states):
            block_table[i, : len(state.block_ids)] = state.block_ids
            input_ids[cu[i] : cu[i + 1]] = state.token_ids[starts[i] : seq_lens[i]]
        slot_mapping = (
            block_table[req_index, positions // bs].astype(np.int64) * bs + positions % bs
        )
        sampled = [i for i, s in enumerate(states) if seq_lens[i] == len(s.token_ids)]
        metadata = AttentionMetadata.build(
            query_lens=query_lens,
            seq_lens=seq_lens.astype(np.int32),
            block_table=block_table,
            slot_mapping=slot_mapping,
            block_size=bs,
            device=self.device,
        )
        return StepInputs(
            input_ids=torch.from_numpy(input_ids).to(self.device),
            positions=torch.from_numpy(positions.astype(np.int64)).to(self.device),
            metadata=metadata,
            logits_indices=torch.tensor(cu[1:][sampled] - 1, dtype=torch.int64, device=self.device),
            sampled_req_ids=[states[i].req_id for i in sampled],
        )

    # ---- one step -----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self, inputs: StepInputs, hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model(inputs.input_ids, inputs.positions, inputs.metadata, hidden, residual)

    @torch.inference_mode()
    def sample(self, inputs: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput | None:
        """Logits of the rows that end their request's known tokens, then sampling.
        Returns None on TP ranks other than 0 (they hold no logits)."""
        if not inputs.sampled_req_ids:
            # Every scheduled request is mid-prompt (a long prompt's chunk): nothing to sample.
            # All TP ranks see the same batch, so they all skip the logits gather together.
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[]) if self.is_driver else None
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        if logits is None:
            return None
        states = [self.requests[rid] for rid in inputs.sampled_req_ids]
        meta = SamplingMetadata.build(
            [s.sampling_params for s in states],
            [s.generator for s in states],
            self.vocab_size,
            self.device,
        )
        token_ids = sample(logits, meta).tolist()
        return ModelRunnerOutput(
            req_ids=inputs.sampled_req_ids, sampled_token_ids=[[t] for t in token_ids]
        )

    def execute_model(self, req: ExecuteModelRequest) -> ModelRunnerOutput | None:
        """One step on this rank. Stages after the first continue from the previous stage's
        (hidden, residual); stages before the last pass theirs on. Only TP rank 0 of the last
        stage returns the sampler output; every other rank returns None."""
        self.update_states(req)
        self.apply_block_ops(req)
        if req.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[]) if self.is_driver else None
        inputs = self.prepare_inputs(req)
        pp = self.ctx.pp
        hidden = residual = None
        if not pp.is_first:
            hidden, residual = recv_intermediate(
                pp, req.total_num_scheduled_tokens, self.config.model.hf_config["hidden_size"],
                self.config.model.torch_dtype, self.device,
            )
        hidden, residual = self.forward(inputs, hidden, residual)
        if not pp.is_last:
            send_intermediate(pp, hidden, residual)
            return None
        return self.sample(inputs, hidden)

    @property
    def is_driver(self) -> bool:
        """The rank that samples: TP rank 0 of the last pipeline stage."""
        return self.ctx.pp.is_last and self.ctx.tp.is_first
