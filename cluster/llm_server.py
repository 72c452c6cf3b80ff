"""``LLMServer``: one model's head as a Ray Serve replica — an ``AsyncLLMEngine`` (scheduler,
block manager, executor) behind handle methods the ingress (HTTP or gRPC) calls.

The wire between ingress and server is plain dicts, so neither side needs the other's classes.
``generate`` streams:

    {"type": "start", "prompt_tokens": n, "n": choices}     after validation, before any token
    {"type": "delta", "choices": [choice delta, ...]}         the choices with something new
    {"type": "error", "status": 400 | 408 | 503, "message", "param", "error_type", "code"}
                                                              (+ "retry_after" s when overloaded)

A choice delta is ``{"index", "text", "token_ids", "finish_reason", "stop_reason",
"num_output_tokens", "logprobs"}``: ``finish_reason`` is set in the one delta in which that choice
finishes, ``num_output_tokens`` counts that choice's tokens so far, and ``logprobs`` (None unless
the request asked for them) has one entry per new token: a list of ``[token_id, text, logprob,
rank]``, the sampled token first, then the top-k. Validation errors arrive as the first item, so
a streaming client still gets a clean 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from jinja2 import TemplateError

from cluster.metrics import ModelMetrics
from engine.async_llm_engine import AsyncLLMEngine, ChoiceDelta
from engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

logger = logging.getLogger("llm_cluster.serve")

_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)


def error_item(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    retry_after: int | None = None,
) -> dict[str, Any]:
    error_type = {400: "BadRequestError", 404: "NotFoundError", 408: "RequestTimeoutError",
                  503: "ServiceUnavailableError"}  # fmt: skip
    item = {
        "type": "error",
        "status": status,
        "message": message,
        "param": param,
        "error_type": error_type.get(status, "APIError"),
        "code": code,
    }
    if retry_after is not None:
        item["retry_after"] = retry_after
    return item


class LLMServer:
    """The head of one model replica. Serve calls ``check_health`` periodically: it raises
    once the engine is dead, so Serve replaces the replica."""

    def __init__(self, model_id: str, engine_args: dict[str, Any]) -> None:
        from engine.config import EngineConfig

        self.model_id = model_id
        self.replica_id = _replica_id()
        config = EngineConfig.from_kwargs(**engine_args)
        self.engine = AsyncLLMEngine(LLMEngine(config))
        self.max_model_len = config.max_model_len
        self.metrics = ModelMetrics(model_id, self.replica_id)
        self._stats_task: asyncio.Task[None] | None = None
        logger.info("model %s ready on replica %s", model_id, self.replica_id)

    # ---- generation ---------------------------------------------------------------------

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self._ensure_stats_task()
        timer = self.metrics.request_timer(time.monotonic())
        try:
            prompt = await self._prompt(request)
            params = _sampling_params(request.get("params") or {})
            timeout = request.get("timeout")
            stream = self.engine.generate(
                prompt,
                params,
                request.get("request_id") or uuid.uuid4().hex,
                cache_salt=request.get("cache_salt"),
                timeout_s=timeout,
            )
            first = await stream.__anext__()
        except InvalidRequestError as exc:
            yield error_item(400, str(exc), exc.param)
            return
        except EngineOverloadedError as exc:
            yield error_item(503, f"model {self.model_id!r}: {exc}", None, "overloaded",
                             exc.retry_after_s)  # fmt: skip
            return
        except EngineDeadError:
            # The cause (a worker's traceback, paths) goes to the log, never to the client.
            logger.exception("model %s: request refused, the engine is dead", self.model_id)
            yield error_item(503, f"the engine for {self.model_id!r} is not available")
            return
        prompt_tokens = len(first.output.prompt_token_ids)
        yield {"type": "start", "prompt_tokens": prompt_tokens, "n": len(first.output.outputs)}
        try:
            last = first
            async for item in _chain(first, stream):
                timer.on_tokens(item.time, item.num_new_tokens)
                last = item
                yield {"type": "delta", "choices": [_choice_delta(d) for d in item.deltas]}
            if timeout is not None and _was_aborted(last):
                yield error_item(408, f"the request exceeded its timeout of {timeout} s",
                                 "timeout")  # fmt: skip
        except EngineDeadError:
            logger.exception("model %s: the engine failed mid-request", self.model_id)
            yield error_item(503, f"the engine for {self.model_id!r} failed")
        finally:
            # Closing the engine stream aborts the request if it is still running (the client
            # went away or the ingress cancelled us); its blocks are free within one step.
            await stream.aclose()
            timer.finish(time.monotonic())

    async def _prompt(self, request: dict[str, Any]) -> Any:
        if request.get("messages") is not None:
            messages = request["messages"]
            return {"prompt_token_ids": await self.engine.call(lambda e: _chat_ids(e, messages))}
        if request.get("prompt_token_ids") is not None:
            return {"prompt_token_ids": request["prompt_token_ids"]}
        return request.get("prompt")

    # ---- tokenizer ----------------------------------------------------------------------

    async def tokenize(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            if request.get("messages") is not None:
                messages = request["messages"]
                ids = await self.engine.call(lambda e: _chat_ids(e, messages))
            else:
                text = request.get("prompt")
                if not isinstance(text, str):
                    raise InvalidRequestError("must be a string", param="prompt")
                ids = await self.engine.call(lambda e: e.tokenizer.encode(text))
        except InvalidRequestError as exc:
            return error_item(400, exc.reason, exc.param)
        return {"tokens": list(ids), "count": len(ids), "max_model_len": self.max_model_len}

    async def detokenize(self, request: dict[str, Any]) -> dict[str, Any]:
        tokens = request.get("tokens")
        vocab = self.engine.config.model.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and 0 <= t < vocab for t in tokens
        ):
            return error_item(400, f"must be a list of token ids in [0, {vocab})", "tokens")
        return {"prompt": await self.engine.call(lambda e: e.tokenizer.decode(tokens))}

    # ---- health and stats ---------------------------------------------------------------

    def check_health(self) -> None:
        self.engine.check_health()

    async def health(self) -> dict[str, Any]:
        try:
            self.engine.check_health()
        except EngineDeadError:
            logger.exception("model %s: health check failed", self.model_id)
            return {"healthy": False, "error": "the engine is dead"}
        return {"healthy": True}

    async def stats(self) -> dict[str, Any]:
        stats = await self.engine.get_stats()
        return {
            "model_id": self.model_id,
            "replica_id": self.replica_id,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_total_blocks": stats.kv_total_blocks,
            "kv_free_blocks": stats.kv_free_blocks,
            "kv_usage": stats.kv_usage,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
            "num_preemptions": stats.num_preemptions,
            "prompt_tokens_total": stats.prompt_tokens_total,
            "generation_tokens_total": stats.generation_tokens_total,
        }

    async def request_state(self) -> dict[str, Any]:
        """Per-request state on the head and the workers (all 0 once idle), plus the KV pool."""
        stats = await self.engine.get_stats()
        state = await self.engine.request_state()
        return {
            **state,
            "replica_id": self.replica_id,
            "kv_total_blocks": stats.kv_total_blocks,
            "kv_free_blocks": stats.kv_free_blocks,
        }

    def _ensure_stats_task(self) -> None:
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.get_running_loop().create_task(self._publish_stats())

    async def _publish_stats(self) -> None:
        while not self.engine.is_dead:
            with contextlib.suppress(EngineDeadError):
                self.metrics.publish(await self.engine.get_stats())
            await asyncio.sleep(1.0)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.shutdown()


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


def _was_aborted(item: Any) -> bool:
    return any(c.finish_reason == "abort" for c in item.output.outputs)


def _choice_delta(delta: ChoiceDelta) -> dict[str, Any]:
    stop_reason = delta.stop_reason
    logprobs = None
    if delta.logprobs is not None:
        logprobs = [
            [[token, lp.decoded_token or "", lp.logprob, lp.rank] for token, lp in entry.items()]
            for entry in delta.logprobs
        ]
    return {
        "index": delta.index,
        "text": delta.text,
        "token_ids": delta.token_ids,
        "finish_reason": delta.finish_reason,
        "stop_reason": stop_reason if isinstance(stop_reason, (str, int)) else None,
        "num_output_tokens": delta.num_tokens,
        "logprobs": logprobs,
    }


def _sampling_params(params: dict[str, Any]) -> SamplingParams:
    unknown = sorted(set(params) - _SAMPLING_FIELDS)
    if unknown:
        raise InvalidRequestError("is not a sampling parameter", param=unknown[0])
    return SamplingParams(**params)


def _chat_ids(engine: LLMEngine, messages: list[dict[str, Any]]) -> list[int]:
    tokenizer = engine.tokenizer
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this model has no chat template", param="messages")
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except TemplateError as exc:  # the template's raise_exception: roles, order
        raise InvalidRequestError(f"the chat template rejected them: {exc}", "messages") from exc
    except Exception as exc:  # anything else may quote internals: the log has it
        logger.exception("chat template failed")
        raise InvalidRequestError("the chat template rejected them", "messages") from exc
    return list(ids)


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_tag
    except Exception:  # outside a Serve replica (unit tests)
        return "local"
