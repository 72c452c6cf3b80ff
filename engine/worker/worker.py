"""One worker = one device: its model shard, its paged KV cache and its model runner.

The executor drives every worker through the same calls (``collective_rpc``):
``init_device`` -> ``load_model`` -> ``determine_num_available_blocks`` (the head takes the
minimum over workers) -> ``initialize_cache`` -> ``execute_model`` every step; ``sleep`` /
``wake_up`` when the engine sleeps (``engine.worker.sleep_mode``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.config import EngineConfig
from engine.lora import make_worker_lora_manager
from engine.models.expert_load import ExpertLoadCounter, attach_expert_load
from engine.sampling_params import SamplingParams
from engine.spec_decode.draft import DraftModel
from engine.startup_timeline import StartupTimeline
from engine.worker.kv_sizing import (
    CudaMemoryProbe,
    KVBudget,
    MemoryProbe,
    MemorySnapshot,
    check_start_memory,
    compute_kv_budget,
)
from engine.worker.model_loader import LoadProgressCallback, load_model
from engine.worker.model_runner import ModelRunner
from engine.worker.sampler import SamplingMetadata, sample
from engine.worker.sleep_mode import (
    check_sleep_level,
    check_wake_tags,
    move_weights,
    release_freed_memory,
)
from engine.worker.step_messages import ExecuteModelRequest, ModelRunnerOutput
from llm_kernels.attention_metadata import AttentionMetadata
from parallel.distributed import (
    DEFAULT_TIMEOUT_S,
    RendezvousStore,
    connect_store,
    create_store,
    destroy_distributed,
    init_distributed,
)
from parallel.layers import parameter_bytes
from parallel.state import ParallelContext

logger = logging.getLogger("llm_cluster.worker")

_GiB = 1 << 30
# KV blocks of the throw-away cache the graph-pool measurement captures over.
_GRAPH_PROFILE_BLOCKS = 16


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        ctx: ParallelContext | None = None,
        memory_probe: MemoryProbe | None = None,
    ) -> None:
        """``memory_probe``: where the KV sizing reads device memory; None means the CUDA
        driver's on a CUDA device and none on CPU (which sizes by ``cpu_kv_cache_space``)."""
        self.config = config
        self.ctx = ctx or ParallelContext()
        self.rank = config.parallel.rank
        self.device = torch.device("cpu")
        self.model_runner: ModelRunner | None = None
        self.expert_load_counter: ExpertLoadCounter | None = None
        self._rendezvous: RendezvousStore | None = None
        self.memory_probe = memory_probe
        # Device memory in use before this worker allocated anything (taken in init_device).
        self._start_memory: MemorySnapshot | None = None
        self.kv_budget: KVBudget | None = None
        # Sleep mode: the level slept at (None: awake), what is still asleep, and the cache's
        # block counts to allocate again on wake.
        self.sleep_level: int | None = None
        self._asleep: set[str] = set()
        self._slept_blocks: tuple[list[int], list[int]] = ([], [])
        # Start-up marks, logged once the cache is allocated (engine.startup_timeline).
        self.startup = StartupTimeline(f"worker rank {self.rank}")
        self.startup.mark("created")

    @property
    def runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("worker: load_model() has not run")
        return self.model_runner

    def init_device(self, local_device_index: int = 0) -> None:
        if self.config.device.device_type == "cuda":
            self.device = torch.device("cuda", local_device_index)
            torch.cuda.set_device(self.device)
            if self.memory_probe is None:
                self.memory_probe = CudaMemoryProbe(self.device)
        torch.manual_seed(self.config.model.seed)
        if self.memory_probe is not None:
            self._start_memory = MemorySnapshot.take(self.memory_probe)
            if self.config.cache.num_kv_blocks is None:
                # Before the weights load: this instance's share must be free now.
                check_start_memory(self._start_memory, self.config.cache.gpu_memory_utilization)
        self.startup.mark("device")

    def start_rendezvous(self, host: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
        """Rank 0 only: host the rendezvous store on ``host``; returns its OS-assigned port."""
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank}: only rank 0 hosts the rendezvous store")
        self._rendezvous = create_store(host, self.config.parallel.world_size, timeout_s)
        return self._rendezvous.port

    def init_distributed(self, host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Join the process groups (every rank at once); sets this worker's ParallelContext.
        Call after ``init_device`` (NCCL binds the current device) and before ``load_model``."""
        parallel = self.config.parallel
        if self._rendezvous is not None:
            store = self._rendezvous.store
        else:
            store = connect_store(host, port, parallel.world_size, timeout_s)
        self.ctx = init_distributed(
            store,
            self.rank,
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            self.device,
            timeout_s,
            dp_size=parallel.data_parallel_size,
        )

    def shutdown(self) -> None:
        if self.model_runner is not None:
            # Graphs holding captured NCCL work can hang the group's destruction.
            self.model_runner.release_cuda_graphs()
        destroy_distributed()
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None

    def load_model(self, progress: LoadProgressCallback | None = None) -> None:
        partition = self.config.parallel.pp_layer_partition
        if partition is not None:
            self.ctx = dataclasses.replace(self.ctx, layer_partition=partition)
        if self.config.parallel.enable_expert_parallel:
            self.ctx = dataclasses.replace(self.ctx, expert_parallel=True)
        model = load_model(self.config, self.ctx, self.device, progress, self.startup)
        lora_manager = None
        lora = self.config.lora
        if lora.enable_lora:
            # Allocated before the memory profile, so the KV budget leaves room for the slots.
            backend = self.config.kernel.resolved_backend(self.device.type)
            lora_manager = make_worker_lora_manager(
                model, lora.max_loras, lora.max_lora_rank, backend, self.device
            )
        self.model_runner = ModelRunner(
            self.config,
            model,
            self.device,
            self.ctx,
            lora_manager=lora_manager,
            draft=self._load_draft(),
        )
        # TP rank 0 of each stage counts its sparse layers' expert load (the others route alike).
        self.expert_load_counter = (
            attach_expert_load(model, self.device) if self.ctx.tp.is_first else None
        )
        self.startup.mark("model runner")

    def _load_draft(self) -> DraftModel | None:
        """speculative_config method draft_model: this rank's shard of the draft."""
        spec = self.config.speculative.speculative_config
        draft_config = self.config.draft_model
        if spec is None or draft_config is None:
            return None
        model = load_model(
            dataclasses.replace(self.config, model=draft_config, draft_model=None),
            self.ctx,
            self.device,
        )
        return DraftModel(
            model,
            spec.num_speculative_tokens,
            self.device,
            self.ctx,
            self.config.cache.block_size,
            self.config.max_model_len,
        )

    def kv_block_bytes(self) -> int:
        return self.runner.cache_engine.block_bytes()

    def kv_group_block_bytes(self) -> list[int]:
        """Bytes of one block of each KV cache group's layers here
        (``engine.core.kv_cache_groups``)."""
        return self.runner.cache_engine.group_block_bytes()

    def parameter_bytes(self) -> int:
        draft = self.runner.draft
        return parameter_bytes(self.runner.model) + (parameter_bytes(draft.model) if draft else 0)

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(device KV blocks, CPU swap blocks) that fit this worker's memory budget: an explicit
        ``num_kv_blocks``, else the budget measured through the memory probe (see
        ``engine.worker.kv_sizing``), else, on CPU without a probe, ``cpu_kv_cache_space``."""
        blocks = self._num_available_blocks()
        self.startup.mark("KV sizing")
        return blocks

    def _num_available_blocks(self) -> tuple[int, int]:
        runner = self.runner
        block_bytes = runner.cache_engine.block_bytes()
        sched = self.config.scheduler
        blocks_per_seq = -(-sched.max_model_len // self.config.cache.block_size)
        max_useful = sched.max_num_seqs * blocks_per_seq
        num_cpu_blocks = min(int(self.config.cache.swap_space * _GiB // block_bytes), max_useful)
        if self.config.cache.num_kv_blocks is not None:
            return self.config.cache.num_kv_blocks, num_cpu_blocks
        if self.memory_probe is not None:
            budget = self.profile_kv_budget()
            budget.check(block_bytes, blocks_per_seq, sched.max_model_len)
            num_blocks = budget.num_blocks(block_bytes)
            logger.info(
                "rank %d KV cache sizing: %s -> %d blocks of %d bytes",
                self.rank,
                budget.describe(),
                num_blocks,
                block_bytes,
            )
            return num_blocks, num_cpu_blocks
        if self.device.type == "cuda":
            raise RuntimeError("worker: sizing the KV cache on CUDA needs a memory probe")
        num_blocks = int(self.config.cache.cpu_kv_cache_space * _GiB) // block_bytes
        # On CPU the pool shares RAM with everything else: never take more than the
        # scheduler can fill (max_num_seqs sequences of max_model_len tokens).
        num_blocks = min(num_blocks, max_useful)
        if num_blocks <= 0:
            raise RuntimeError(
                f"no memory left for the KV cache: cpu_kv_cache_space="
                f"{self.config.cache.cpu_kv_cache_space} GiB holds no block of {block_bytes} "
                "bytes; raise cpu_kv_cache_space"
            )
        return int(num_blocks), num_cpu_blocks

    def profile_kv_budget(self) -> KVBudget:
        """Measure this worker's memory budget (every TP/PP rank at once: it runs collectives).

        Order matters: communicators first (NCCL allocates on first use), then the peak of a
        full-budget step, then the graph pool, and last the non-torch memory, which only grows.
        """
        probe = self.memory_probe
        if probe is None or self._start_memory is None:
            raise RuntimeError("worker: init_device() must run (with a memory probe) first")
        probe.empty_cache()
        self.ctx.warm_up(self.device)
        probe.synchronize()
        # Right after a reset the peak is what is allocated now: weights, LoRA slots, buffers.
        probe.reset_peak_memory_stats()
        weights = probe.max_memory_allocated()
        profile_kv_cache = self._profile_run()
        probe.synchronize()
        profile_peak = probe.max_memory_allocated()
        cuda_graph_pool = self._measure_cuda_graph_pool(probe)
        # Taken while the measurement's graphs exist: their executables live outside torch.
        end = MemorySnapshot.take(probe)
        self.runner.initialize_kv_cache(0, 0)
        probe.empty_cache()
        budget = compute_kv_budget(
            start=self._start_memory,
            end=end,
            gpu_memory_utilization=self.config.cache.gpu_memory_utilization,
            weights=weights,
            profile_peak=profile_peak,
            profile_kv_cache=profile_kv_cache,
            cuda_graph_pool=cuda_graph_pool,
        )
        self.kv_budget = budget
        return budget

    def _measure_cuda_graph_pool(self, probe: MemoryProbe) -> int:
        """Bytes the decode graphs reserve: capture every bucket over a small KV cache and read
        the growth of torch's reservation (the caller drops graphs and cache once it has read
        the non-torch memory). The graphs captured after sizing (same buckets, same order) fit
        in the room this leaves."""
        runner = self.runner
        if not runner.uses_cuda_graphs():
            return 0
        # Capture writes no K/V (slot -1) and reads none (seq_len 0): a few blocks will do, where
        # one max_model_len sequence's worth can be gigabytes on a large model.
        runner.initialize_kv_cache(_GRAPH_PROFILE_BLOCKS, 0)
        probe.synchronize()
        probe.empty_cache()
        before = probe.memory_reserved()
        runner.capture_cuda_graphs()
        probe.synchronize()
        # Warm-up activations went back to the cache; only the graphs' pool stays reserved.
        probe.empty_cache()
        return max(probe.memory_reserved() - before, 0)

    @torch.inference_mode()
    def _profile_run(self) -> int:
        """One forward pass over ``max_num_batched_tokens`` tokens (then the LM head and the
        sampler over ``max_num_seqs`` rows on the last stage), for its memory peak. Returns
        the bytes of the small KV cache it wrote into (freed afterwards)."""
        runner = self.runner
        sched = self.config.scheduler
        num_tokens = sched.max_num_batched_tokens
        seq_len = min(num_tokens, sched.max_model_len)
        num_seqs = -(-num_tokens // seq_len)
        bs = self.config.cache.block_size
        blocks_per_seq = -(-seq_len // bs)
        num_blocks = num_seqs * blocks_per_seq
        runner.initialize_kv_cache(num_blocks, 0)
        query_lens = np.array([seq_len] * num_seqs, dtype=np.int32)
        block_table = np.arange(num_blocks, dtype=np.int32).reshape(num_seqs, -1)
        positions = np.tile(np.arange(seq_len), num_seqs)
        rows = np.repeat(np.arange(num_seqs), seq_len)
        slots = block_table[rows, positions // bs].astype(np.int64) * bs + positions % bs
        meta = AttentionMetadata.build(
            query_lens=query_lens,
            seq_lens=query_lens,
            block_table=block_table,
            slot_mapping=slots,
            block_size=bs,
            device=self.device,
        )
        ids = torch.zeros(len(positions), dtype=torch.int64, device=self.device)
        pos = torch.from_numpy(positions).to(self.device)
        hidden = residual = None
        if not self.ctx.pp.is_first:
            # A later stage continues from the previous stage's (hidden, residual); zeros have
            # the same shapes, which is all the memory peak depends on.
            shape = (len(positions), self.config.model.hf_config["hidden_size"])
            dtype = self.config.model.torch_dtype
            hidden = torch.zeros(shape, dtype=dtype, device=self.device)
            residual = torch.zeros(shape, dtype=dtype, device=self.device)
        hidden, _ = runner.model(ids, pos, meta, hidden, residual)
        if runner.draft is not None:
            # The draft runs over the same tokens after the target's pass: its peak too.
            runner.draft.mirror(ids, pos, meta)
        if runner.model.lm_head is not None:
            logits = runner.model.compute_logits(hidden[-min(sched.max_num_seqs, len(positions)) :])
            if logits is not None:
                self._profile_sampler(logits)
        kv_bytes = num_blocks * runner.cache_engine.block_bytes()
        if self.memory_probe is not None:
            self.memory_probe.synchronize()
        runner.initialize_kv_cache(0, 0)
        return kv_bytes

    def _profile_sampler(self, logits: torch.Tensor) -> None:
        """The sampler's float32 copies of the logits: top-k/top-p sampling with logprobs is
        its largest footprint."""
        rows = logits.shape[0]
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=1)
        meta = SamplingMetadata.build(
            [params] * rows, [None] * rows, self.config.model.vocab_size, self.device
        )
        sample(logits, meta)

    def initialize_cache(
        self, num_blocks: int | Sequence[int], num_cpu_blocks: int | Sequence[int]
    ) -> None:
        """Allocate the KV cache (per KV cache group, or an int for every group), then capture
        the decode graphs over it (every rank at once: on TP > 1 the capture records the
        stage's collectives)."""
        self.runner.initialize_kv_cache(num_blocks, num_cpu_blocks)
        self.startup.mark("KV allocation")
        self.runner.capture_cuda_graphs()
        self.startup.mark("graphs")
        if self.expert_load_counter is not None:  # the profile run's dummy tokens routed too
            self.expert_load_counter.reset()
        self.startup.log(logger)

    def kv_transfer_metadata(self) -> dict[str, Any] | None:
        """What another engine needs to reach this worker's KV cache (NixlConnector: its
        agent and cache layout), once the cache is allocated; None for other connectors."""
        transfer = self.runner.kv_transfer
        return transfer.metadata() if transfer is not None else None

    def execute_model(self, request: ExecuteModelRequest) -> ModelRunnerOutput | None:
        return self.runner.execute_model(request)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache, and at level 2 the weights too (``engine.worker.sleep_mode``);
        the engine calls it idle, with no request state on the worker."""
        level = check_sleep_level(level)
        if self.sleep_level is not None:
            raise RuntimeError(f"worker {self.rank}: already asleep (level {self.sleep_level})")
        runner = self.runner
        layout = runner.cache_engine.layout
        self._slept_blocks = (list(layout.num_blocks), list(layout.num_cpu_blocks))
        runner.release_kv_cache()
        if level == 2:
            self.model_runner = None
            self.expert_load_counter = None
            del runner
        elif self.device.type == "cuda":
            move_weights(runner.model, torch.device("cpu"))
            if runner.draft is not None:
                move_weights(runner.draft.model, torch.device("cpu"))
        release_freed_memory(self.device)
        self.sleep_level = level
        self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back what ``tags`` names (default: everything), weights before the cache:
        level 2's weights reloaded from the checkpoint, level 1's moved back to the device."""
        for tag in check_wake_tags(tags):
            if tag not in self._asleep:
                continue
            if tag == "weights":
                if self.sleep_level == 2:
                    self.load_model()
                elif self.device.type == "cuda":
                    move_weights(self.runner.model, self.device)
                    if self.runner.draft is not None:
                        move_weights(self.runner.draft.model, self.device)
            else:
                self.initialize_cache(*self._slept_blocks)
            self._asleep.discard(tag)
        if not self._asleep:
            self.sleep_level = None

    def is_sleeping(self) -> bool:
        return self.sleep_level is not None

    def step_timings(self) -> dict[str, float]:
        """Seconds spent per model-runner phase since startup (or the last reset). On a GPU,
        without device syncs (the default; see ``engine.timing``) a phase counts the host's
        time to launch its work and "sample" absorbs the device time it waits for."""
        return dict(self.runner.step_timer.totals)

    def reset_step_timings(self, device_sync: bool | None = None) -> None:
        """Zero the step timings; ``device_sync`` (when given) turns per-phase device syncs
        on or off from now on."""
        timer = self.runner.step_timer
        timer.reset()
        if device_sync is not None:
            timer.device_sync = device_sync

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since start, per sparse layer this worker counts
        (``{layer: [tokens per expert]}``; ``{}`` on a dense model and on TP ranks > 0)."""
        counter = self.expert_load_counter
        return counter.read() if counter is not None else {}

    def num_request_states(self) -> int:
        """Per-request state held between steps (0 once every request finished)."""
        return len(self.runner.requests)

    def encoder_cache_stats(self) -> dict[str, int]:
        """A VLM's encoder cache: images encoded so far, and outputs held now."""
        cache = self.runner.encoder_cache
        if cache is None:
            return {"num_encoded": 0, "num_cached": 0}
        return {"num_encoded": cache.num_encoded, "num_cached": len(cache)}

    def check_health(self) -> bool:
        return self.model_runner is not None or self.sleep_level == 2
