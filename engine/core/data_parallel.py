"""``DataParallelEngine``: ``data_parallel_size`` engine cores stepping together over one
executor, and ``build_engine``, which picks it or a plain ``LLMEngine`` from the config.

Data-parallel attention (vLLM's ``--data-parallel-size`` with ``--enable-expert-parallel``):
each core is an ``LLMEngine`` with its own scheduler, block manager (KV cache) and requests, and
its own TP group of workers; every MoE layer's experts are split over all DP x TP workers, which
exchange tokens in each layer (``parallel.moe``). So the cores step in lockstep: each step sends
every core's batch at once, an empty one for a core with nothing to run (its workers still take
part in the exchanges, ``ModelRunner._exchange_nothing``), and hands each core its output::

    add_request ──▶ the core with the longest cached prefix, then the fewest unfinished requests
    step ──▶ core 0 … N-1 schedule ──▶ one DataParallelStep to every worker
         ◀── each core's output (its TP group's sampling worker) ──▶ core d updates its requests

A core's executor is a view of the shared one (``_CoreExecutor``): start-up sizing and
allocation run once on every worker (a KV-sizing forward pass exchanges tokens too), control
calls reach the core's own workers, and a core that steps alone (flushing finished requests
after an abort) steps with the others idle.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.core.block_manager import KVCacheStats
from engine.core.engine_stats import EngineCounters
from engine.core.llm_engine import EngineOutput, LLMEngine, PromptType
from engine.core.request import Request
from engine.errors import EngineDeadError, InvalidRequestError, check_request_id_unused
from engine.lora_request import LoRARequest
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.spec_decode.metrics import SpecDecodeStats
from engine.worker.executor import Executor, get_executor_class
from engine.worker.step_messages import ExecuteModelRequest, ModelRunnerOutput, empty_request


def build_engine(
    config: EngineConfig, executor_class: Callable[[EngineConfig], Executor] | None = None
) -> LLMEngine:
    """The engine the config asks for: ``DataParallelEngine`` with ``data_parallel_size`` > 1
    (typed as the ``LLMEngine`` whose methods it has), else ``LLMEngine``."""
    if config.parallel.data_parallel_size > 1:
        return DataParallelEngine(config, executor_class)  # type: ignore[return-value]
    return LLMEngine(config, executor_class=executor_class)


class DataParallelEngine:
    """``LLMEngine``'s interface over ``data_parallel_size`` cores (see the module docstring).
    A request (all its samples) lives on one core from ``add_request`` to its end."""

    def __init__(
        self,
        config: EngineConfig,
        executor_class: Callable[[EngineConfig], Executor] | None = None,
    ) -> None:
        self.config = config
        self.executor = (executor_class or get_executor_class(config))(config)
        try:
            sizing = _SharedStartup(self.executor)
            self.cores = [
                LLMEngine(config, executor_class=functools.partial(_CoreExecutor, sizing, d))
                for d in range(config.parallel.data_parallel_size)
            ]
        except BaseException:
            self.executor.shutdown()
            raise
        first = self.cores[0]
        self.tokenizer = first.tokenizer
        self.eos_token_ids = first.eos_token_ids
        self.inputs = first.inputs
        self.step_timer = first.step_timer
        # Request id -> the core that holds it, while it lives.
        self._owner: dict[str, LLMEngine] = {}

    # ---- requests -----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        **options: Any,
    ) -> Request:
        """``LLMEngine.add_request`` (the same arguments) on the core ``_pick_core`` picks. A
        text prompt is tokenized once, here: the core gets its token ids with the text."""
        check_request_id_unused(request_id, self._owner)
        try:
            text, token_ids = self.inputs.tokenize(prompt)
        except InvalidRequestError:
            token_ids = []  # the core refuses it, with the reason
        else:
            extra = prompt if isinstance(prompt, dict) else {}
            prompt = {**extra, "prompt_token_ids": token_ids}
            if text is not None:
                prompt["prompt"] = text
        core = self._pick_core(token_ids, options.get("cache_salt"), options.get("lora_request"))
        request = core.add_request(request_id, prompt, params, **options)
        self._owner[request_id] = core
        return request

    def _pick_core(
        self, token_ids: list[int], cache_salt: str | None, lora_request: LoRARequest | None
    ) -> LLMEngine:
        """The core holding the longest cached prefix of the prompt, then the one with the
        fewest unfinished requests, then the emptiest KV cache, then the lowest index (as the
        ingress routes across replicas: prefix first, load after)."""
        lora = lora_request.prefix_key if lora_request is not None else None

        def cost(core: LLMEngine) -> tuple[int, int, float]:
            cached = core.block_manager.cached_prefix_tokens(token_ids, cache_salt, lora)
            usage = core.get_kv_cache_stats().usage
            return -cached, core.get_num_unfinished_requests(), usage

        return min(self.cores, key=cost)

    def abort_request(self, request_id: str | Iterable[str]) -> list[EngineOutput]:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outputs: list[EngineOutput] = []
        for core in self.cores:
            mine = [rid for rid in ids if self._owner.get(rid) is core]
            if mine:
                outputs += core.abort_request(mine)
        self._forget(outputs)
        return outputs

    def _forget(self, outputs: Sequence[EngineOutput]) -> None:
        for output in outputs:
            if output.finished:
                self._owner.pop(output.request_id, None)

    # ---- the step -----------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Schedule every core, run their batches in one step on all workers, update each."""
        self._check_alive()
        batches = []
        outputs: list[EngineOutput] = []
        for core in self.cores:
            core.step_timer.start()
            outputs += core.admit_compiled()
            batches.append(core.schedule_batch())
        if all(batch is None for batch in batches):
            for core in self.cores:
                core.wait_when_idle()
            self._forget(outputs)
            return outputs
        requests = [batch[1] if batch is not None else empty_request() for batch in batches]
        step_outputs = self.executor.execute_data_parallel(requests)
        for core, batch, output in zip(self.cores, batches, step_outputs, strict=True):
            if batch is not None:
                core.step_timer.lap("execute")
                outputs += core.finish_batch(batch[0], output)
        self._forget(outputs)
        return outputs

    def _check_alive(self) -> None:
        if self.executor.is_dead:
            raise EngineDeadError("the engine's workers are dead; build a new engine to continue")

    # ---- introspection and lifecycle ----------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return any(core.has_unfinished_requests() for core in self.cores)

    def get_num_unfinished_requests(self) -> int:
        return sum(core.get_num_unfinished_requests() for core in self.cores)

    def get_kv_cache_stats(self) -> KVCacheStats:
        """Every core's blocks together; a group's usage is the cores' mean (their pools are
        the same size)."""
        parts = [core.get_kv_cache_stats() for core in self.cores]
        usage = zip(*(p.group_usage for p in parts), strict=True)
        return KVCacheStats(
            total=sum(p.total for p in parts),
            free=sum(p.free for p in parts),
            cached=sum(p.cached for p in parts),
            used=sum(p.used for p in parts),
            cpu_total=sum(p.cpu_total for p in parts),
            cpu_free=sum(p.cpu_free for p in parts),
            group_usage=tuple(sum(g) / len(parts) for g in usage),
        )

    def core_loads(self) -> list[tuple[EngineCounters, float]]:
        """Each core's counters and KV usage, in core order (per-core ``/metrics``)."""
        return [(core.counters(), core.get_kv_cache_stats().usage) for core in self.cores]

    def counters(self) -> EngineCounters:
        parts = [core.counters() for core in self.cores]
        return EngineCounters(
            **{f: sum(getattr(p, f) for p in parts) for f in EngineCounters.__dataclass_fields__}
        )

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        total = SpecDecodeStats()
        for core in self.cores:
            stats = core.spec_decode_stats
            total.num_drafts += stats.num_drafts
            total.num_draft_tokens += stats.num_draft_tokens
            total.num_accepted_tokens += stats.num_accepted_tokens
            for j, n in enumerate(stats.accepted_per_pos):
                if j == len(total.accepted_per_pos):
                    total.accepted_per_pos.append(0)
                total.accepted_per_pos[j] += n
        return total

    def request_state_sizes(self) -> dict[str, int]:
        sizes = {"data_parallel_owners": len(self._owner)}
        for core in self.cores:
            for key, n in core.request_state_sizes().items():
                sizes[key] = sizes.get(key, 0) + n
        return sizes

    def check_integrity(self) -> None:
        for core in self.cores:
            core.check_integrity()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def sleep(self, level: int = 1) -> None:
        raise ValueError(
            f"sleep: not available with data_parallel_size > 1 "
            f"({self.config.parallel.data_parallel_size} here); run one engine per replica"
        )

    def is_sleeping(self) -> bool:
        return False

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if a worker of any core is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        for core in self.cores:
            core.structured_output.shutdown()
        self.executor.shutdown()


class _SharedStartup:
    """The shared executor with its start-up calls made once for every core: the first core's
    KV sizing and cache allocation run on all workers at once, the others reuse them."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.num_blocks: tuple[int, int] | None = None
        self.allocated: tuple[Any, Any] | None = None

    def determine_num_available_blocks(self) -> tuple[int, int]:
        if self.num_blocks is None:
            self.num_blocks = self.executor.determine_num_available_blocks()
        return self.num_blocks

    def initialize_cache(self, num_blocks: Any, num_cpu_blocks: Any) -> None:
        sizes = (num_blocks, num_cpu_blocks)
        if self.allocated is None:
            self.executor.initialize_cache(num_blocks, num_cpu_blocks)
            self.allocated = sizes
        elif self.allocated != sizes:
            raise RuntimeError(
                f"data-parallel cores disagree on the KV cache: {self.allocated} and {sizes}"
            )


class _CoreExecutor(Executor):
    """Core ``dp_rank``'s executor: a view of the shared one (see the module docstring)."""

    def __init__(self, shared: _SharedStartup, dp_rank: int, config: EngineConfig) -> None:
        # Not Executor.__init__: the state (liveness, timings, observer) is the shared one's.
        self.shared = shared
        self.dp_rank = dp_rank
        self.config = config

    @property
    def _executor(self) -> Executor:
        return self.shared.executor

    @property
    def is_dead(self) -> bool:  # type: ignore[override]
        return self._executor.is_dead

    @property
    def observer(self) -> Any:  # type: ignore[override]
        return self._executor.observer

    @property
    def startup_timings(self) -> dict[str, float]:  # type: ignore[override]
        return self._executor.startup_timings

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``method`` on every worker; the results of this core's workers."""
        results = self._executor.collective_rpc(method, args, kwargs)
        per_core = len(results) // self.config.parallel.data_parallel_size
        return results[self.dp_rank * per_core : (self.dp_rank + 1) * per_core]

    def determine_num_available_blocks(self) -> tuple[int, int]:
        return self.shared.determine_num_available_blocks()

    def initialize_cache(self, num_blocks: Any, num_cpu_blocks: Any) -> None:
        self.shared.initialize_cache(num_blocks, num_cpu_blocks)

    def execute_model(self, request: ExecuteModelRequest) -> ModelRunnerOutput:
        """This core's step alone: the other cores' workers run an empty one beside it."""
        requests = [empty_request() for _ in range(self.config.parallel.data_parallel_size)]
        requests[self.dp_rank] = request
        return self._executor.execute_data_parallel(requests)[self.dp_rank]

    def expert_load(self) -> dict[int, list[int]]:
        return self._executor.expert_load()

    def check_health(self) -> None:
        self._executor.check_health()
