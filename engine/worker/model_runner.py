"""Runs one step on one worker: applies the ExecuteModelRequest to the persistent per-request
state, prepares the packed inputs, runs the model and (on the sampling rank) samples;
speculative verification and the draft model live in ``engine.spec_decode`` and are called
from here.

Per step, for each scheduled request r with c = num_computed_tokens and n scheduled tokens:

    input_ids   = tokens[c : c+n]            positions = c .. c+n-1
    slot_mapping[t] = block_ids[pos // block_size] * block_size + pos % block_size
    seq_len = c + n                          sampled iff c + n == len(tokens)

KV cache groups (``engine.core.kv_cache_groups``): each layer reads its group's block table and
writes its group's slots; the head's block ids are global, split here into each group's local
ids, so ``block_ids`` holds one table per group and a step builds one metadata per group.
``ModelRunner``'s docstring has what prompt logprobs, LoRA and pooling requests add; the
per-request state and the step's packed inputs are ``engine.worker.step_inputs``; the caches
and the step's block copies and swaps are ``engine.worker.cache_engine``'s; stored KV blocks
(``kv_transfer_config``) are saved and loaded by ``engine.kv_transfer.worker``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from engine.config import EngineConfig
from engine.core.structured_output import apply_grammar_bitmask
from engine.kv_transfer.connector import WorkerKVConnector, make_worker_kv_transfer
from engine.lora import WorkerLoRAManager
from engine.spec_decode.draft import DraftModel
from engine.spec_decode.verify import spec_grammar_rows_of, verify_requests
from engine.timing import StepTimer, device_synchronizer
from engine.worker import step_outputs
from engine.worker.cache_engine import CacheEngine
from engine.worker.cuda_graphs import (
    DecodeBucketRunner,
    DecodeCudaGraphRunner,
    cuda_graphs_disabled_reason,
)
from engine.worker.encoder_cache import EncoderCache
from engine.worker.sampler import sample
from engine.worker.step_inputs import (
    CachedRequestState,
    StepInputs,
    block_tables,
    grammar_bitmask_rows,
    mrope_positions_of,
    pooling_rows,
    prompt_logprobs_rows,
)
from engine.worker.step_messages import (
    ExecuteModelRequest,
    LogprobsLists,
    ModelRunnerOutput,
)
from llm_kernels.attention_metadata import build_group_metadata
from parallel.distributed import recv_intermediate, send_intermediate
from parallel.moe import ParallelExperts
from parallel.state import ParallelContext


class ModelRunner:
    """One step on one worker, from the step message to the sampled tokens: persistent
    per-request state, packed inputs, forward, sampling.

    A request with ``prompt_logprobs`` also gets the logits of every chunk position t with
    t + 1 < num_prompt_tokens: they score prompt token t + 1 (chunked prefill returns them chunk
    by chunk; the head stitches them together by position).

    LoRA: the step's ``lora_slots`` changes are loaded before the forward pass; each token then
    uses its request's adapter slot (-1 for the base model), one mapping shared by every layer.

    A vision-language model: a chunk's image placeholder tokens take their image's embeddings
    in place of the token embeddings; each image is encoded when a chunk first reaches it and
    kept for its request (``engine.worker.encoder_cache``). Decode steps hold no image tokens
    and replay CUDA graphs as before.

    A pooling (embedding) request samples nothing. The driver pools its post-norm hidden
    states: ``last`` takes the row of the last prompt position (in the chunk that ends the
    prompt); ``mean`` adds every chunk's rows to a float32 sum kept in the request's state,
    counting the positions summed so far (``num_pooled``, always a prefix [0, num_pooled): a
    chunk recomputed after a preemption is not summed twice). The vector is returned once the
    prompt is computed.
    """

    def __init__(
        self,
        config: EngineConfig,
        model: nn.Module,
        device: torch.device,
        ctx: ParallelContext | None = None,
        lora_manager: WorkerLoRAManager | None = None,
        draft: DraftModel | None = None,
    ) -> None:
        self.config = config
        # speculative_config method draft_model: the draft, its KV cache beside the target's.
        self.draft = draft
        self.lora_manager = lora_manager
        # This step's adapters that could not be loaded (see ModelRunnerOutput.lora_load_errors).
        self._lora_errors: dict[int, str] = {}
        self.model = model
        self.device = device
        self.ctx = ctx or ParallelContext()
        # kv_transfer_config: this worker's shard of stored blocks (engine.kv_transfer).
        self.kv_transfer: WorkerKVConnector | None = None
        if config.kv_transfer.kv_transfer_config is not None:
            tp = self.ctx.tp
            num_model_caches = len(model.attention_layers())
            self.kv_transfer = make_worker_kv_transfer(
                config, self.ctx.pp.rank, tp.rank, tp.size, num_model_caches
            )
        self.block_size = config.cache.block_size
        self.vocab_size = config.model.vocab_size
        self.step_timer = StepTimer(sync=device_synchronizer(device))
        self.requests: dict[str, CachedRequestState] = {}
        draft_layers = draft.model.attention_layers() if draft is not None else []
        self.cache_engine = CacheEngine(
            config, model.attention_layers(), draft_layers, device, model.kernel_ops
        )
        # Set once the KV cache exists, when decode steps may replay CUDA graphs.
        # (A DecodeBucketRunner runs the same data path without graphs, in CPU tests.)
        self.graph_runner: DecodeBucketRunner | None = None
        # This step's speculative proposals, by request (ExecuteModelRequest's).
        self._proposals: dict[str, list[int]] = {}
        # A vision-language model's image embeddings, encoded once per image and request.
        self.encoder_cache = EncoderCache(device) if hasattr(model, "embed_multimodal") else None
        # Qwen2.5-VL, Qwen3-VL: the rotary reads 3-D positions (StepInputs.mrope_positions).
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        # Data parallelism: the MoE layers' experts that exchange tokens across the DP ranks.
        self._exchanging_experts = [
            m for m in model.modules() if isinstance(m, ParallelExperts) and m.exchanges_tokens
        ]

    # ---- KV cache and decode graphs ------------------------------------------------------

    def initialize_kv_cache(
        self, num_blocks: int | Sequence[int], num_cpu_blocks: int | Sequence[int]
    ) -> None:
        """Allocate the caches (``CacheEngine.allocate``: per KV cache group, that group's
        count, an int: every group the same). Decode graphs, where they apply, are set up over
        the new caches but captured only by ``capture_cuda_graphs``."""
        # Captured graphs hold the old caches' addresses.
        self.release_cuda_graphs()
        cache = self.cache_engine
        cache.allocate(num_blocks, num_cpu_blocks)
        if self.kv_transfer is not None:
            self.kv_transfer.register(cache.group_caches[0])
        if self.draft is not None:
            self.draft.kv_caches = [a.kv_cache for a in self.draft.model.attention_layers()]
        blocks = cache.layout.num_blocks
        if max(blocks) and self.uses_cuda_graphs():
            # A stage after the first replays from static hidden/residual inputs.
            hidden_size = (
                None if self.ctx.pp.is_first else self.config.model.hf_config["hidden_size"]
            )
            self.graph_runner = DecodeCudaGraphRunner(
                self.model,
                self.device,
                block_size=self.block_size,
                max_model_len=self.config.max_model_len,
                max_num_seqs=self.config.scheduler.max_num_seqs,
                num_kv_blocks=blocks[0] if len(blocks) == 1 else blocks,
                hidden_size=hidden_size,
                dtype=self.config.model.torch_dtype,
            )

    def release_kv_cache(self) -> None:
        """Drop the caches (and the graphs over them), for sleep mode: nothing of the
        cache is referenced after this. ``initialize_kv_cache`` allocates it again."""
        self.release_cuda_graphs()
        self.cache_engine.release()
        if self.draft is not None:
            self.draft.kv_caches = []

    def capture_cuda_graphs(self) -> int:
        """Capture every decode bucket now (a collective on TP > 1: every rank of the stage
        calls it together). Returns how many graphs exist (0 where graphs do not apply)."""
        if self.graph_runner is None:
            return 0
        self.graph_runner.capture_all()
        return self.graph_runner.num_graphs

    def release_cuda_graphs(self) -> None:
        """Destroy the captured graphs (before the caches they read go, and before the
        process leaves its process groups)."""
        if self.graph_runner is not None:
            self.graph_runner.release()
            self.graph_runner = None

    def cuda_graphs_disabled_reason(self) -> str | None:
        if self.uses_mrope:
            name = type(self.model).__name__
            return f"M-RoPE ({name}): decode positions are per request, not the graphs' 1-D ones"
        return cuda_graphs_disabled_reason(
            device_type=self.device.type,
            kernel_backend=self.model.kernel_ops.name,
            enforce_eager=self.config.kernel.enforce_eager,
            lora_enabled=self.lora_manager is not None,
            data_parallel=self.config.parallel.data_parallel_size > 1,
        )

    def uses_cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs on this worker (any TP / PP shape)."""
        return self.cuda_graphs_disabled_reason() is None

    # ---- persistent batch ---------------------------------------------------------------

    def update_states(self, req: ExecuteModelRequest) -> None:
        for rid in req.finished_req_ids:
            self.requests.pop(rid, None)
            if self.encoder_cache is not None:
                self.encoder_cache.free_request(rid)
        for new in req.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            num_prompt = new.num_prompt_tokens
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids),
                block_ids=self.cache_engine.layout.split(new.block_ids),
                sampling_params=params,
                generator=generator,
                num_computed_tokens=new.num_computed_tokens,
                num_prompt_tokens=num_prompt if num_prompt >= 0 else len(new.prompt_token_ids),
                eos_token_ids=tuple(new.eos_token_ids),
                pooling_params=new.pooling_params,
                lora_int_id=new.lora_int_id,
                mrope=new.mrope,
            )
            if new.mm_features:
                if self.encoder_cache is None:
                    raise RuntimeError(f"request {new.req_id!r} has images; the model takes none")
                self.encoder_cache.add_request(new.req_id, new.mm_features)
        if req.lora_slots:
            if self.lora_manager is None:
                raise RuntimeError("the head sent LoRA slots but this worker has LoRA off")
            self._lora_errors = self.lora_manager.apply_slot_changes(req.lora_slots)
        for cached in req.scheduled_cached_reqs:
            state = self.requests.get(cached.req_id)
            if state is None:
                raise RuntimeError(f"worker has no state for running request {cached.req_id!r}")
            state.token_ids.extend(cached.new_token_ids)
            new_ids = self.cache_engine.layout.split(cached.new_block_ids)
            if cached.resumed_from_preemption:
                state.block_ids = new_ids
            else:
                for table, ids in zip(state.block_ids, new_ids):
                    table.extend(ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ---- inputs -------------------------------------------------------------------------

    def prepare_inputs(self, req: ExecuteModelRequest) -> StepInputs:
        bs = self.block_size
        mean = self.config.pooler.pooling_type == "mean"
        states = [self.requests[rid] for rid in req.num_scheduled_tokens]
        query_lens = np.fromiter(
            req.num_scheduled_tokens.values(), dtype=np.int32, count=len(states)
        )
        starts = np.array([s.num_computed_tokens for s in states], dtype=np.int32)
        seq_lens = starts + query_lens
        num_tokens = int(query_lens.sum())
        # Positions of every packed token: start of its request + offset inside the chunk.
        cu = np.concatenate(([0], np.cumsum(query_lens)))
        req_index = np.repeat(np.arange(len(states)), query_lens)
        positions = starts[req_index] + (np.arange(num_tokens) - cu[:-1][req_index])
        input_ids = np.empty(num_tokens, dtype=np.int64)
        spec = req.scheduled_spec_decode_tokens
        for i, state in enumerate(states):
            proposals = spec.get(state.req_id, ())
            known_end = seq_lens[i] - len(proposals)
            input_ids[cu[i] : cu[i + 1] - len(proposals)] = state.token_ids[starts[i] : known_end]
            input_ids[cu[i + 1] - len(proposals) : cu[i + 1]] = proposals
        if self.lora_manager is not None:
            lora_ids = [s.lora_int_id for s in states]
            self.lora_manager.set_token_slots(lora_ids, query_lens, self.device)
        sampled = [
            i
            for i, s in enumerate(states)
            if seq_lens[i] == len(s.token_ids) and s.pooling_params is None and s.req_id not in spec
        ]
        sampled_req_ids = [states[i].req_id for i in sampled]
        verified = [i for i, s in enumerate(states) if s.req_id in spec]
        logits_rows = [cu[1:][sampled] - 1] + [
            np.arange(cu[i + 1] - len(spec[states[i].req_id]) - 1, cu[i + 1]) for i in verified
        ]
        grammar_rows, grammar_bitmask = grammar_bitmask_rows(req, sampled_req_ids)
        spec_req_ids = [states[i].req_id for i in verified]
        spec_grammar_rows, spec_grammar_bitmask = spec_grammar_rows_of(req, spec_req_ids)
        sampling_metadata = (
            step_outputs.sampling_metadata(
                [self.requests[r] for r in sampled_req_ids], self.vocab_size, self.device
            )
            if self.is_driver and sampled_req_ids
            else None
        )
        mm_rows, mm_embeds = self._image_embeddings(states, starts, seq_lens, cu)
        # Gemma 3: each image's tokens attend to each other both ways (whole in this chunk).
        bidirectional = (
            [self.encoder_cache.spans(s.req_id, int(starts[i]), int(seq_lens[i]))
             for i, s in enumerate(states)]
            if mm_rows is not None and getattr(self.model, "whole_image_attention", False)
            else None
        )  # fmt: skip
        mrope = (
            mrope_positions_of(states, starts, seq_lens, cu, positions, self.device)
            if self.uses_mrope
            else None
        )
        metadata = build_group_metadata(
            query_lens=query_lens,
            seq_lens=seq_lens.astype(np.int32),
            block_tables=block_tables(states, len(self.cache_engine.layout.specs)),
            windows=self.cache_engine.layout.windows,
            positions=positions,
            req_index=req_index,
            block_size=bs,
            device=self.device,
            bidirectional=bidirectional,
        )
        return StepInputs(
            input_ids=torch.from_numpy(input_ids).to(self.device),
            positions=torch.from_numpy(positions.astype(np.int64)).to(self.device),
            metadata=metadata,
            logits_indices=torch.from_numpy(np.concatenate(logits_rows).astype(np.int64)).to(
                self.device
            ),
            sampled_req_ids=sampled_req_ids,
            spec_req_ids=spec_req_ids,
            spec_grammar_rows=spec_grammar_rows,
            spec_grammar_bitmask=spec_grammar_bitmask,
            prompt_logprobs_rows=prompt_logprobs_rows(states, starts, seq_lens, cu),
            grammar_rows=grammar_rows,
            grammar_bitmask=grammar_bitmask,
            # Only the driver pools (and keeps the running sums): the others hold no output.
            pooling_rows=pooling_rows(states, starts, seq_lens, cu, mean) if self.is_driver else [],
            sampling_metadata=sampling_metadata,
            mm_rows=mm_rows,
            mm_embeds=mm_embeds,
            mrope_positions=mrope,
        )

    @torch.inference_mode()
    def _image_embeddings(
        self,
        states: list[CachedRequestState],
        starts: np.ndarray,
        ends: np.ndarray,
        cu: np.ndarray,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The packed rows of this step's image tokens and their embeddings (the images a
        chunk reaches first are encoded now; see ``engine.worker.encoder_cache``)."""
        if self.encoder_cache is None:
            return None, None
        chunks = [
            (s.req_id, int(starts[i]), int(ends[i]), int(cu[i])) for i, s in enumerate(states)
        ]
        found = self.encoder_cache.gather(
            chunks, self.model.embed_multimodal, self.config.model.torch_dtype
        )
        if found is None:
            return None, None
        rows, embeds = found
        return torch.from_numpy(rows.astype(np.int64)).to(self.device), embeds

    # ---- one step -----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        inputs: StepInputs,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        positions = inputs.positions if inputs.mrope_positions is None else inputs.mrope_positions
        if inputs.mm_embeds is None:
            return self.model(inputs.input_ids, positions, inputs.metadata, hidden, residual)
        # A VLM's chunk that holds image tokens: their rows take the image's embeddings.
        embeds = self.model.embed_input_ids(inputs.input_ids)
        width = embeds.shape[-1]
        embeds[inputs.mm_rows] = inputs.mm_embeds[:, :width].to(embeds.dtype)
        extra = {}
        if inputs.mm_embeds.shape[-1] > width:  # Qwen3-VL: the rest is deepstack features
            extra["deepstack"] = (inputs.mm_rows, inputs.mm_embeds[:, width:])
        return self.model(
            inputs.input_ids, positions, inputs.metadata, hidden, residual, embeds, **extra
        )

    @torch.inference_mode()
    def sample(self, inputs: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput | None:
        """Logits of the rows that end their request's known tokens, then sampling.
        Returns None on TP ranks other than 0 (they hold no logits)."""
        if self.model.lm_head is None:  # a pooling model: its requests sample nothing
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[]) if self.is_driver else None
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        prompt_logprobs = (
            step_outputs.prompt_logprobs(
                self.model, self.requests, inputs.prompt_logprobs_rows, hidden, self.vocab_size
            )
            if inputs.prompt_logprobs_rows
            else {}
        )
        self.step_timer.lap("lm_head")
        if logits is None:
            return None
        if not inputs.sampled_req_ids and not inputs.spec_req_ids:  # all mid-prompt
            return ModelRunnerOutput(
                req_ids=[], sampled_token_ids=[], prompt_logprobs=prompt_logprobs
            )
        num_plain = len(inputs.sampled_req_ids)
        verified, verified_logprobs = self._verify(inputs, logits[num_plain:])
        if not num_plain:
            return ModelRunnerOutput(
                req_ids=inputs.spec_req_ids,
                sampled_token_ids=verified,
                logprobs=verified_logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        logits = logits[:num_plain]
        if inputs.grammar_bitmask is not None:
            # First, so that raw logprobs and every processor see the grammar's mask (vLLM's
            # order); only the driver gets here (other TP ranks hold no logits).
            apply_grammar_bitmask(logits, inputs.grammar_bitmask, inputs.grammar_rows)
        meta = inputs.sampling_metadata
        if meta is None:
            meta = step_outputs.sampling_metadata(
                [self.requests[r] for r in inputs.sampled_req_ids], self.vocab_size, self.device
            )
        out = sample(logits, meta)
        logprobs = None
        if out.logprobs is not None and meta.num_logprobs is not None:
            logprobs = step_outputs.split_logprobs(out.logprobs, meta.num_logprobs)
        if verified_logprobs is not None:
            logprobs = (logprobs or [None] * num_plain) + verified_logprobs
        elif logprobs is not None and verified:
            logprobs = logprobs + [None] * len(verified)
        return ModelRunnerOutput(
            req_ids=inputs.sampled_req_ids + inputs.spec_req_ids,
            sampled_token_ids=[[t] for t in out.token_ids.tolist()] + verified,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _verify(
        self, inputs: StepInputs, logits: torch.Tensor
    ) -> tuple[list[list[int]], list[LogprobsLists | None] | None]:
        """Speculative decoding: each request's accepted proposals and next token (and their
        logprobs where asked) from its k + 1 logits rows (``engine.spec_decode.verify``)."""
        if not inputs.spec_req_ids:
            return [], None
        return verify_requests(
            [self.requests[rid] for rid in inputs.spec_req_ids],
            [self._proposals[rid] for rid in inputs.spec_req_ids],
            logits,
            inputs.spec_grammar_bitmask,
            inputs.spec_grammar_rows,
            self.vocab_size,
        )

    def execute_model(self, req: ExecuteModelRequest) -> ModelRunnerOutput | None:
        """One step on this rank. Stages after the first continue from the previous stage's
        (hidden, residual); stages before the last pass theirs on. Only TP rank 0 of the last
        stage returns the sampler output; every other rank returns None, or an output holding
        only ``lora_load_errors`` / ``kv_load_failures`` when it could not load an adapter or
        stored blocks."""
        clock = self.step_timer
        clock.start()
        self._lora_errors = {}
        self._proposals = req.scheduled_spec_decode_tokens
        self.update_states(req)
        kv_failures: dict[str, int] = {}
        transfer = self.kv_transfer
        cache = self.cache_engine
        if transfer is not None and req.kv_saves:  # before anything writes into the cache
            transfer.save(cache.group_caches[0], req.kv_saves)
        cache.apply_block_ops(req)
        if transfer is not None and req.kv_loads:
            kv_failures = transfer.load(cache.group_caches[0], req.kv_loads, req.kv_load_sources)
        output = self._execute(req)
        if self._lora_errors or kv_failures:
            if output is None:
                output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
            output.lora_load_errors = self._lora_errors
            output.kv_load_failures = kv_failures
        return output

    def _execute(self, req: ExecuteModelRequest) -> ModelRunnerOutput | None:
        clock = self.step_timer
        if req.total_num_scheduled_tokens == 0:
            self._exchange_nothing()
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[]) if self.is_driver else None
        inputs = self.prepare_inputs(req)
        clock.lap("prepare_inputs")
        pp = self.ctx.pp
        hidden = residual = None
        if not pp.is_first:
            hidden, residual = recv_intermediate(
                pp,
                req.total_num_scheduled_tokens,
                self.config.model.hf_config["hidden_size"],
                self.config.model.torch_dtype,
                self.device,
            )
            clock.lap("receive")  # waiting for the previous stage: not this stage's work
        graphs = self.graph_runner
        plain = inputs.mm_embeds is None and inputs.mrope_positions is None
        if graphs is not None and plain and graphs.can_run(inputs.metadata):
            # This stage's layers in one replay; every TP rank of the stage got the same
            # request, so all replay the same bucket's graph (its all-reduces match).
            hidden, residual = graphs.run(
                inputs.input_ids, inputs.positions, inputs.metadata, hidden, residual
            )
        else:
            hidden, residual = self.forward(inputs, hidden, residual)
        if self.draft is not None:
            self.draft.mirror(inputs.input_ids, inputs.positions, inputs.metadata)
        if not pp.is_last:
            clock.lap("forward")
            send_intermediate(pp, hidden, residual)
            clock.lap("send")  # may wait for the next stage to take it
            return None
        clock.lap("forward")
        output = self.sample(inputs, hidden)
        if output is not None and inputs.pooling_rows:
            output.pooled = step_outputs.pool_rows(
                self.model,
                self.requests,
                inputs.pooling_rows,
                hidden,
                self.config.pooler.pooling_type,
            )
        clock.lap("sample")
        if self.draft is not None:
            self._propose_draft(inputs, output)
            clock.lap("draft")
        return output

    def _exchange_nothing(self) -> None:
        """Data parallelism: a core with nothing to run still takes part in every MoE layer's
        token exchange, in layer order, as the cores with tokens do in their forward
        (``ParallelExperts._exchange`` with no tokens: it sends none and receives pairs to
        compute). Nothing else of the forward is collective across the DP ranks."""
        if not self._exchanging_experts:
            return
        hidden = self.config.model.hf_config["hidden_size"]
        x = torch.empty(0, hidden, dtype=self.config.model.torch_dtype, device=self.device)
        ids = torch.empty(0, 1, dtype=torch.long, device=self.device)
        weights = torch.empty(0, 1, dtype=torch.float32, device=self.device)
        for experts in self._exchanging_experts:
            experts(x, ids, weights)

    def _propose_draft(self, inputs: StepInputs, output: ModelRunnerOutput | None) -> None:
        """Every rank runs the draft's passes; the driver knows the emitted tokens and puts
        the proposals into its output. A request's new token sits at position
        num_computed + len(emitted) (a plain row emits one token after its seq_len - 1)."""
        req_ids = inputs.sampled_req_ids + inputs.spec_req_ids
        states = [self.requests[rid] for rid in req_ids]
        tokens = positions = None
        # (A non-driver rank's output, if any, holds only LoRA load errors.)
        if self.is_driver and output is not None:
            emitted = dict(zip(output.req_ids, output.sampled_token_ids))
            tokens = [emitted[rid][-1] for rid in req_ids]
            positions = [s.num_computed_tokens + len(emitted[s.req_id]) for s in states]
            # A plain row computed its whole query, not just one token.
            for i in range(len(inputs.sampled_req_ids)):
                positions[i] = len(states[i].token_ids)
        proposals = self.draft.propose(
            req_ids, [s.block_ids for s in states], tokens, positions, self.cache_engine.layout
        )
        if self.is_driver and output is not None:
            output.draft_token_ids = proposals

    @property
    def is_driver(self) -> bool:
        """The rank that samples: TP rank 0 of the last pipeline stage."""
        return self.ctx.pp.is_last and self.ctx.tp.is_first
