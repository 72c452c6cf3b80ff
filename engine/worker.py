"""One worker = one device: its model shard, its paged KV cache and its model runner.

The executor drives every worker through the same calls (``collective_rpc``):
``init_device`` -> ``load_model`` -> ``determine_num_available_blocks`` (the head takes the
minimum over workers) -> ``initialize_cache`` -> ``execute_model`` every step.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from engine.config import EngineConfig
from engine.lora import make_worker_lora_manager
from engine.model_loader import LoadProgressCallback, load_model
from engine.model_runner import ModelRunner
from engine.protocol import ExecuteModelRequest, ModelRunnerOutput
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


class Worker:
    def __init__(self, config: EngineConfig, ctx: ParallelContext | None = None) -> None:
        self.config = config
        self.ctx = ctx or ParallelContext()
        self.rank = config.parallel.rank
        self.device = torch.device("cpu")
        self.model_runner: ModelRunner | None = None
        self._rendezvous: RendezvousStore | None = None

    @property
    def runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("worker: load_model() has not run")
        return self.model_runner

    def init_device(self, local_device_index: int = 0) -> None:
        if self.config.device.device_type == "cuda":
            self.device = torch.device("cuda", local_device_index)
            torch.cuda.set_device(self.device)
        torch.manual_seed(self.config.model.seed)

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
        )

    def shutdown(self) -> None:
        destroy_distributed()
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None

    def load_model(self, progress: LoadProgressCallback | None = None) -> None:
        partition = self.config.parallel.pp_layer_partition
        if partition is not None:
            self.ctx = dataclasses.replace(self.ctx, layer_partition=partition)
        model = load_model(self.config, self.ctx, self.device, progress)
        lora_manager = None
        lora = self.config.lora
        if lora.enable_lora:
            # Allocated before the memory profile, so the KV budget leaves room for the slots.
            backend = self.config.kernel.resolved_backend(self.device.type)
            lora_manager = make_worker_lora_manager(
                model, lora.max_loras, lora.max_lora_rank, backend, self.device
            )
        self.model_runner = ModelRunner(
            self.config, model, self.device, self.ctx, lora_manager=lora_manager
        )

    def kv_block_bytes(self) -> int:
        return self.runner.kv_block_bytes()

    def parameter_bytes(self) -> int:
        return parameter_bytes(self.runner.model)

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(device KV blocks, CPU swap blocks) that fit this worker's memory budget."""
        runner = self.runner
        block_bytes = runner.kv_block_bytes()
        sched = self.config.scheduler
        max_useful = sched.max_num_seqs * -(-sched.max_model_len // self.config.cache.block_size)
        num_cpu_blocks = min(int(self.config.cache.swap_space * _GiB // block_bytes), max_useful)
        if self.config.cache.num_kv_blocks is not None:
            return self.config.cache.num_kv_blocks, num_cpu_blocks
        if self.device.type == "cuda":
            num_blocks = self._cuda_kv_budget_bytes() // block_bytes
        else:
            num_blocks = int(self.config.cache.cpu_kv_cache_space * _GiB) // block_bytes
            # On CPU the pool shares RAM with everything else: never take more than the
            # scheduler can fill (max_num_seqs sequences of max_model_len tokens).
            num_blocks = min(num_blocks, max_useful)
        if num_blocks <= 0:
            raise RuntimeError(
                "no memory left for the KV cache; raise "
                "gpu_memory_utilization / cpu_kv_cache_space or lower max_num_batched_tokens"
            )
        return int(num_blocks), num_cpu_blocks

    def _cuda_kv_budget_bytes(self) -> int:
        """free device memory x utilization, minus the weights and the activation peak of a
        full-budget step, measured by a profiling forward pass."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        peak = torch.cuda.max_memory_allocated(self.device)
        _, total = torch.cuda.mem_get_info(self.device)
        return int(total * self.config.cache.gpu_memory_utilization) - peak

    @torch.inference_mode()
    def _profile_run(self) -> None:
        runner = self.runner
        sched = self.config.scheduler
        num_tokens = sched.max_num_batched_tokens
        seq_len = min(num_tokens, sched.max_model_len)
        num_seqs = -(-num_tokens // seq_len)
        bs = self.config.cache.block_size
        blocks_per_seq = -(-seq_len // bs)
        runner.initialize_kv_cache(num_seqs * blocks_per_seq, 0)
        query_lens = np.array([seq_len] * num_seqs, dtype=np.int32)
        block_table = np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(num_seqs, -1)
        positions = np.tile(np.arange(seq_len), num_seqs)
        rows = np.repeat(np.arange(num_seqs), seq_len)
        slots = block_table[rows, positions // bs].astype(np.int64) * bs + positions % bs
        from kernels.attention import AttentionMetadata

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
        if runner.model.lm_head is not None:
            runner.model.compute_logits(hidden[-min(sched.max_num_seqs, len(positions)) :])
        torch.cuda.synchronize(self.device)
        runner.initialize_kv_cache(0, 0)

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks, num_cpu_blocks)

    def execute_model(self, request: ExecuteModelRequest) -> ModelRunnerOutput | None:
        return self.runner.execute_model(request)

    def step_timings(self) -> dict[str, float]:
        """Seconds spent per model-runner phase since startup (or the last reset)."""
        return dict(self.runner.step_timer.totals)

    def reset_step_timings(self) -> None:
        self.runner.step_timer.reset()

    def num_request_states(self) -> int:
        """Per-request state held between steps (0 once every request finished)."""
        return len(self.runner.requests)

    def check_health(self) -> bool:
        return self.model_runner is not None
