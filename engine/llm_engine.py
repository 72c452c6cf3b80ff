"""``LLMEngine``: the head's synchronous core — tokenize and validate, schedule, run a step on
the executor, update requests, detokenize, produce ``RequestOutput``s."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, GenerationConfig

from engine.block_manager import BlockManager, KVCacheStats
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.executor import Executor, get_executor_class
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, make_execute_model_request

logger = logging.getLogger("llm_cluster.engine")

PromptType = str | dict[str, Any] | list[int]


def load_tokenizer(config: EngineConfig) -> Any:
    path = config.model.tokenizer or config.model.model_path
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def eos_token_ids(model_path: str, tokenizer: Any) -> frozenset[int]:
    """EOS ids as HF ``generate`` uses them: generation_config.json's, else the tokenizer's."""
    ids: set[int] = set()
    if (Path(model_path) / "generation_config.json").exists():
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.eos_token_ids = eos_token_ids(config.model.model_path, self.tokenizer)
        self.executor = (executor_class or get_executor_class(config))(config)
        num_blocks, num_cpu_blocks = self.executor.determine_num_available_blocks()
        if config.scheduler.preemption_mode != "swap":
            num_cpu_blocks = 0
        self.executor.initialize_cache(num_blocks, num_cpu_blocks)
        self.block_manager = BlockManager(
            num_blocks,
            config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._prompts: dict[str, str | None] = {}
        self._log_cache_size(num_blocks, num_cpu_blocks)

    @classmethod
    def from_engine_args(cls, **engine_args: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**engine_args))

    def _log_cache_size(self, num_blocks: int, num_cpu_blocks: int) -> None:
        block_bytes = sum(self.executor.collective_rpc("kv_block_bytes"))
        bs = self.config.cache.block_size
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1fx max_model_len %d), %.2f GiB "
            "across workers; swap space: %d blocks",
            num_blocks, bs, num_blocks * bs, num_blocks * bs / self.config.max_model_len,
            self.config.max_model_len, num_blocks * block_bytes / (1 << 30), num_cpu_blocks,
        )

    # ---- requests -----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and enqueue; raises ``InvalidRequestError`` (naming the field) and enqueues
        nothing if the request is invalid."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("must be a SamplingParams", param="sampling_params")
        text, token_ids = self._tokenize(prompt)
        max_tokens = self._check_lengths(token_ids, params)
        request = Request(
            request_id, token_ids, params,
            eos_token_ids=self.eos_token_ids, max_tokens=max_tokens,
            arrival_time=arrival_time or time.monotonic(), priority=priority, cache_salt=cache_salt,
        )
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"{request_id!r} is already in use", param="request_id")
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop
        )
        self._prompts[request_id] = text
        self.scheduler.add_request(request)
        return request

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise InvalidRequestError("must be a string", param="prompt")
            token_ids = self.tokenizer.encode(text)
        elif isinstance(prompt, list):
            text, token_ids = None, prompt
        else:
            raise InvalidRequestError(
                "must be a string, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'",
                param="prompt",
            )
        if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise InvalidRequestError("must be a list of integers", param="prompt_token_ids")
        if not token_ids:
            raise InvalidRequestError("must not be empty", param="prompt")
        vocab = self.config.model.vocab_size
        bad = next((i for i, t in enumerate(token_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {token_ids[bad]} at index {bad} is outside the vocabulary [0, {vocab})",
                param="prompt_token_ids",
            )
        return text, list(token_ids)

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        max_len = self.config.max_model_len
        n = len(token_ids)
        if n >= max_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens; it must be shorter than max_model_len ({max_len})",
                param="prompt",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - n
        if n + max_tokens > max_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"max_model_len ({max_len}); max_tokens must be <= {max_len - n}",
                param="max_tokens",
            )
        bs, total = self.config.cache.block_size, self.block_manager.num_blocks
        needed = -(-(n + max_tokens) // bs)
        if needed > total:
            raise InvalidRequestError(
                f"prompt + max_tokens needs {needed} KV blocks but the cache holds {total}; "
                f"max_tokens must be <= {total * bs - n}",
                param="max_tokens",
            )
        return max_tokens

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Abort live requests (unknown or finished ids are ignored) and free their blocks now;
        returns the aborted requests' final outputs (finish_reason "abort")."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outputs = []
        for request in self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED):
            outputs.append(self.make_output(request))
            self._forget(request.request_id)
        return outputs

    def _forget(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self._prompts.pop(request_id, None)

    # ---- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, execute one step on the workers, and return outputs of updated requests."""
        sched = self.scheduler.schedule()
        if sched.total_num_scheduled_tokens == 0 and not sched.finished_req_ids:
            return []
        output = self.executor.execute_model(make_execute_model_request(sched))
        updated = self.scheduler.update_from_output(sched, output.req_ids, output.sampled_token_ids)
        outputs = [self._process(request, num_new) for request, num_new in self._new_tokens(updated, output)]
        if not self.scheduler.has_unfinished_requests() and self.scheduler._finished_req_ids:
            self._flush_finished()
        return outputs

    @staticmethod
    def _new_tokens(updated: list[Request], output: Any) -> list[tuple[Request, int]]:
        counts = dict(zip(output.req_ids, (len(t) for t in output.sampled_token_ids)))
        return [(r, counts[r.request_id]) for r in updated]

    def _process(self, request: Request, num_new: int) -> RequestOutput:
        detok = self._detokenizers[request.request_id]
        if detok.update(request.output_token_ids[-num_new:]):
            request.stop_reason = detok.stop_string
            if request.is_finished:
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        if request.is_finished:
            detok.finish()
        output = self.make_output(request)
        if request.is_finished:
            self._forget(request.request_id)
        return output

    def make_output(self, request: Request) -> RequestOutput:
        detok = self._detokenizers[request.request_id]
        completion = CompletionOutput(
            index=0,
            text=detok.output_text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=self._prompts.get(request.request_id),
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def _flush_finished(self) -> None:
        """Tell the workers to drop finished requests' state now rather than at the next step."""
        sched = self.scheduler.schedule()
        self.executor.execute_model(make_execute_model_request(sched))

    # ---- introspection ------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    def get_kv_cache_stats(self) -> KVCacheStats:
        return self.block_manager.stats()

    def check_integrity(self) -> None:
        """Block manager invariants, plus: every live request is in exactly one queue."""
        self.block_manager.check_integrity()
        sched = self.scheduler
        queued = list(sched.waiting) + sched.running + sched.swapped
        if sorted(r.request_id for r in queued) != sorted(sched.requests):
            raise RuntimeError("scheduler queues disagree with the set of live requests")
        for request in sched.running:
            if request.num_computed_tokens > request.num_tokens:
                raise RuntimeError(f"{request}: more tokens computed than known")

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        self.executor.shutdown()
