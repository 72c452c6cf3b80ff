"""``LLMServer``: one model replica as a Ray Serve deployment — the front (chat templates,
tokenizing, per-request streams) over its head, the engine core (scheduler, block manager,
executor), which runs in a Ray actor of its own inside a Serve replica
(``cluster.serving.head_actor``) and on a thread of this process outside one (tests, tools).
Handle methods are what the ingress (HTTP or gRPC) calls.

``generate`` streams ``cluster.api.replica_messages`` messages: a ``StreamStart`` (or a
``StreamError``: a validation error is the first item, so a streaming client still gets a clean
400), then one ``StreamDelta`` per engine step with the choices that have something new, and
possibly a last ``StreamError`` (503: the engine failed; 408: the request's timeout passed). A
request that names the ingress's token ``channel`` gets no ``StreamDelta`` here: its head hands its
deltas to that channel (``cluster.serving.token_channel``), and ``StreamStart.head`` says which
head. Its start goes out as soon as the head has the request (after its first delta only when it
carries the prompt's logprobs); this call still lasts until the request ends, so Serve's routing,
queue limits and drain see it. The pooling calls (``embed``, ``score``) are
``cluster.serving.pooling_server``'s, sleep and wake ``sleep_server``'s, the engine's numbers
(``stats``, Serve's routing and autoscaling hooks, ``/metrics``) ``stats_server``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from cluster.api.reasoning_parsers import reasoning_front
from cluster.api.replica_messages import (
    DetokenizeResult,
    EmbedRequest,
    GenerateRequest,
    StreamDelta,
    StreamError,
    StreamItem,
    StreamStart,
    TokenizeResult,
    logprob_rows,
)
from cluster.api.tool_parsers import TOOL_PARSERS, get_tool_parser
from cluster.config import HEAD_BUNDLE_INDEX
from cluster.serving.lora_adapters import AdapterNotFoundError, ReplicaAdapters
from cluster.serving.metrics import ModelMetrics
from cluster.serving.pooling_server import PoolingServer
from cluster.serving.request_inputs import (
    request_chat_prompt,
    request_prompt,
    sampling_params_from,
    truncated_prompt,
    with_template_defaults,
)
from cluster.serving.serve_replica import gcs_loss_flag, serve_stop_flag
from cluster.serving.sleep_server import SleepServer
from cluster.serving.start_errors import ModelStartError, known_start_failure
from cluster.serving.stats_server import StatsServer
from engine.client.async_llm_engine import AsyncLLMEngine
from engine.client.core_client import InProcessCoreClient
from engine.config import EngineConfig
from engine.core.data_parallel import build_engine
from engine.core.input_processor import load_tokenizer
from engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStateError,
    InvalidRequestError,
    RequestAbortedError,
)
from engine.generation_defaults import generation_defaults, with_generation_defaults
from engine.lora import LoRARequest
from engine.multimodal.chat import image_placeholder
from engine.multimodal.processor import MultiModalProcessor
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.startup_timeline import StartupTimeline
from engine.vlm_config import is_vlm

if TYPE_CHECKING:
    from cluster.serving.head_client import HeadCoreClient

logger = logging.getLogger("llm_cluster.serve")

_SINK_FLUSH_S = 3.0


def error_item(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    retry_after: int | None = None,
) -> StreamError:
    return StreamError(status, message, param, code, retry_after)


class LLMServer(PoolingServer, SleepServer, StatsServer):
    """The front of one model replica. Serve calls ``check_health`` periodically: it raises
    once the engine is dead, so Serve replaces the replica."""

    def __init__(
        self,
        model_id: str,
        engine_args: dict[str, Any],
        drain_timeout_s: float = 20.0,
        head_resources: dict[str, float] | None = None,
        lora_config: dict[str, Any] | None = None,
        sleep_config: dict[str, Any] | None = None,
        start_asleep: bool = False,
    ) -> None:
        """``head_resources`` (the head's placement bundle, ``HEAD_BUNDLE_INDEX`` of this
        replica's group) starts the engine core in a head actor; without it (outside Serve) the
        core runs on a thread of this process. ``lora_config`` (``dynamic_lora_loading_path``,
        ``max_num_adapters_per_replica``) serves the model's LoRA adapters by name;
        ``sleep_config`` (``cluster.serving.sleep_server``) its idle sleep; ``start_asleep``
        leaves the engine unstarted (asleep, holding no memory) until the first wake."""
        self.replica_id = _replica_id()
        self.startup = StartupTimeline(
            f"replica {model_id} {self.replica_id}", from_process_start=True
        )
        self.startup.mark("imports")  # a prestarted worker's wait for this replica, its imports
        self.model_id = model_id
        self.engine: AsyncLLMEngine | None = None
        self.head_name: str | None = None
        self._core_args = (engine_args, head_resources)
        try:
            self.config = EngineConfig.from_kwargs(**engine_args)
            self.startup.mark("config")
            # The head starts in a process of its own while this one loads the tokenizer.
            head = None if start_asleep else self._launch_head()
            try:
                self._configure(lora_config)
                if not start_asleep:
                    self._start_core(head)
            except BaseException:
                if head is not None:
                    head.shutdown()  # once only: a head that failed to start is stopped already
                raise
        except Exception as exc:
            # A cause that starting again would meet again: the deployment fails at once with
            # it (cluster.ops.deploy reads it from Serve's status), rather than after Serve's
            # retries.
            reason = known_start_failure(exc)
            if reason is None:
                raise
            raise ModelStartError(model_id, reason) from exc
        self.metrics = ModelMetrics(model_id, self.replica_id)
        self._init_stats()
        # Graceful drain (scale-down, redeploy, shutdown): see ``_drain``.
        self.drain_timeout_s = drain_timeout_s
        self.draining = False
        # Set once a drain has aborted what was left: a request still on its way to the engine
        # then (waking the model, loading its adapter) is refused instead of started.
        self.drain_aborted = False
        self._active: set[str] = set()
        self._stopping = serve_stop_flag()
        self._drain_task: asyncio.Task[None] | None = None
        self._sink_flushes: dict[str, tuple[int, asyncio.Future[bool]]] = {}
        self._init_sleep(sleep_config, started=self.engine is not None)
        self.startup.mark("ready")
        logger.info("model %s ready on replica %s", model_id, self.replica_id)
        self.startup.log(logger)

    def _configure(self, lora_config: dict[str, Any] | None) -> None:
        """Everything the front needs besides the engine: the LoRA catalog, the tokenizer, the
        image processor and the parsers."""
        self.adapters: ReplicaAdapters | None = None
        if lora_config is not None:
            self.adapters = ReplicaAdapters(lora_config, in_replica=self.replica_id != "local")
        config = self.config
        self.tokenizer = load_tokenizer(config)
        self.startup.mark("tokenizer")
        # A VLM's images are preprocessed here, on the front (engine.multimodal.processor).
        hf, model = config.model.hf_config, config.model
        self.multimodal = (
            MultiModalProcessor(hf, model.model_path, config.sampling.limit_mm_per_prompt)
            if is_vlm(hf)
            else None
        )
        self.image_placeholder = image_placeholder(hf, self.tokenizer)
        self.max_model_len = config.max_model_len
        sampling = config.sampling
        # What a request's unset sampling fields take (vLLM's rule; engine.generation_defaults).
        self.generation_defaults = generation_defaults(
            model.model_path, sampling.generation_config, sampling.override_generation_config
        )
        self.tool_call_parser = config.frontend.tool_call_parser
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # a ValueError naming the valid parsers
        reasoning = config.frontend.reasoning_parser
        self.reasoning = reasoning_front(reasoning, self.tokenizer) if reasoning else None

    def _launch_head(self) -> HeadCoreClient | None:
        """Start the head actor in this replica's placement group, without waiting for it; None
        outside Serve (no head resources: the core runs on a thread of this process)."""
        engine_args, head_resources = self._core_args
        if head_resources is None:
            return None
        from cluster.serving.head_actor import HEAD_NAME_PREFIX
        from cluster.serving.head_client import HeadCoreClient

        return HeadCoreClient(
            self.config,
            engine_args,
            name=f"{HEAD_NAME_PREFIX}{self.model_id}:{self.replica_id}",
            bundle_index=HEAD_BUNDLE_INDEX,
            resources=head_resources,
        )

    def _start_core(self, head: HeadCoreClient | None = None) -> None:
        """Start the engine core: in a head actor (``head`` when one was launched already), or
        on a thread of this process outside Serve. Blocks until its model is loaded."""
        if head is None:
            head = self._launch_head()
        if head is not None:
            head.wait_started()
            self.startup.mark("head")
            self.engine = AsyncLLMEngine(head, tokenizer=self.tokenizer)
            # The head writes an ingress's requests' deltas to its token channel.
            self.head_name = head.name
        else:
            config = self.config
            core = InProcessCoreClient(lambda: build_engine(config))
            self.engine = AsyncLLMEngine(core, tokenizer=self.tokenizer)

    # ---- generation ---------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamItem]:
        self._ensure_stats_task()
        if self.draining:
            yield self._draining_error()
            return
        arrived = time.monotonic()
        timer = self.metrics.request_timer(arrived)
        request = with_template_defaults(request, self.config.frontend.default_chat_template_kwargs)
        request_id = request.request_id
        self._active.add(request_id)
        try:
            self._check_tool_choice(request)
            await self._ensure_awake()
            lora_request = await self._lora_request(request.adapter)
            prompt = self._prompt(request)
            reasoning = self.reasoning if request.messages is not None else None
            raw_params = self._with_defaults(request.params, prompt)
            if (reasoning is not None and reasoning.keeps_special_tokens) or (
                self._reads_tool_calls(request)
                and TOOL_PARSERS[self.tool_call_parser].keeps_special_tokens
            ):
                raw_params = {**raw_params, "skip_special_tokens": False}
            # The replica forwards each item's new pieces; nothing here reads a whole output.
            params = sampling_params_from({**raw_params, "output_kind": RequestOutputKind.DELTA})
            timer.sequences = params.n
            in_reasoning = None  # chat with a reasoning_parser: where the output starts
            if reasoning is not None:
                in_reasoning = reasoning.prepare(
                    prompt["prompt_token_ids"],
                    params.structured_outputs,
                    request.chat_template_kwargs,
                )
            # The request's timeout counts from its arrival here: waking the model, loading
            # its adapter and rendering the prompt are within it (the engine's clock starts
            # when it takes the request).
            timeout = request.timeout
            timeout_s = _remaining(timeout, arrived)
            if self.drain_aborted:  # the drain's abort came before the engine had it
                self._active.discard(request_id)
                yield self._draining_error()
                return
            # With a channel, the deltas go from the head to the ingress, one message per step.
            sink = request.channel if self.head_name is not None else None
            stream = self.engine.generate(
                prompt,
                params,
                request_id,
                cache_salt=request.cache_salt,
                timeout_s=timeout_s,
                lora_request=lora_request,
                sink=sink,
                priority=request.priority,
            )
            # With a sink the first item comes once the head has the request: the start goes
            # out then (its first token may already be on the channel), unless it carries the
            # prompt's logprobs, which come with the first delta.
            first = await stream.__anext__()
            if sink is not None and params.prompt_logprobs is not None:
                first = await stream.__anext__()
        except AdapterNotFoundError:
            self._active.discard(request_id)
            yield self._not_found(str(request.adapter))
            return
        except (InvalidRequestError, EngineOverloadedError, EngineStateError,
                EngineDeadError) as exc:  # fmt: skip
            self._active.discard(request_id)
            if isinstance(exc, EngineDeadError):
                logger.exception("model %s: request refused, the engine is dead", self.model_id)
            yield self._refusal(exc, request.adapter)
            return
        except Exception:  # a bug, or input that broke a check: this request fails alone
            self._active.discard(request_id)
            logger.exception("model %s: request %s failed", self.model_id, request_id)
            yield error_item(500, "internal server error")
            return
        except BaseException:
            self._active.discard(request_id)
            raise
        if request.adapter is not None:  # the engine accepted it
            self.metrics.on_adapter_request(request.adapter)
        start = self._start(request, first.output, params, reasoning is not None, in_reasoning)
        if sink is not None:
            start.head = self.head_name
        yield start
        try:
            last = first
            async for item in _chain(first, stream):
                for at, made in item.steps:  # every step merged into the item (sink: many)
                    timer.on_tokens(at, made)
                if request.adapter is not None:  # (a sink's items have tallies, not tokens)
                    self.metrics.on_adapter_tokens(request.adapter, sum(n for _, n in item.steps))
                last = item
                if sink is None:
                    output = item.output
                    yield StreamDelta(item.deltas, output.kv_transfer_params,
                                      output.num_cached_tokens)  # fmt: skip
            # Aborted past the deadline: the timeout (not a drain's or a shutdown's abort).
            past = timeout is not None and time.monotonic() >= arrived + timeout
            if past and _was_aborted(last):
                yield error_item(408, f"the request exceeded its timeout of {timeout} s",
                                 "timeout")  # fmt: skip
            if sink is not None and self.draining:  # a drain's abort ended it: see _flush_sink
                await self._flush_sink(sink, self.engine.client.acked_steps)  # type: ignore[attr-defined]
        except EngineDeadError:
            logger.exception("model %s: the engine failed mid-request", self.model_id)
            yield error_item(503, f"the engine for {self.model_id!r} failed")
        finally:
            # Closing the engine stream aborts the request if it is still running (the client
            # went away or the ingress cancelled us); its blocks are free within one step.
            self._active.discard(request_id)
            await stream.aclose()
            timer.finish(time.monotonic())

    async def _flush_sink(self, sink: str, seen: int) -> None:
        """A draining replica stops (its head with it) once its requests end; a request's last
        deltas travel on the ingress's token channel, so before its call ends, wait (up to
        ``_SINK_FLUSH_S``) until the ingress has acknowledged everything its head holds for it.
        ``seen``: the last head step this front had received when the request ended; a wait
        asked for after that step arrived covers it (the head had put the deltas in the sink by
        then), so the requests a drain aborts in one step share one call to the head."""
        asked_at, task = self._sink_flushes.get(sink, (-1, None))
        if task is None or asked_at < seen:
            client = self.engine.client
            asked_at = client.acked_steps  # type: ignore[attr-defined]
            task = asyncio.ensure_future(client.wait_sink_acked(sink, _SINK_FLUSH_S))  # type: ignore[attr-defined]
            self._sink_flushes[sink] = (asked_at, task)
        await asyncio.shield(task)

    def _start(
        self,
        request: GenerateRequest,
        output: Any,
        params: SamplingParams,
        reasoning: bool = False,
        in_reasoning: bool | None = None,
    ) -> StreamStart:
        ids = output.prompt_token_ids
        text = None
        if request.echo:
            text = output.prompt if output.prompt is not None else self.tokenizer.decode(ids)
        prompt_logprobs = None
        if output.prompt_logprobs is not None:
            first = [[ids[0], self.tokenizer.decode(ids[:1]), None, None]]
            prompt_logprobs = [first] + [logprob_rows(e) for e in output.prompt_logprobs[1:]]
        parser = self.tool_call_parser if self._reads_tool_calls(request) else None
        start = StreamStart(len(ids), params.n, text, prompt_logprobs, parser, self.replica_id)
        if self.generation_defaults:  # what it samples with, the model's defaults filled in
            start.temperature, start.top_p = params.temperature, params.top_p
        start.prompt_tokens_details = self.config.frontend.enable_prompt_tokens_details
        if reasoning and self.reasoning is not None:  # a chat with the model's reasoning_parser
            start.reasoning_parser = self.reasoning.parser.name
            start.in_reasoning = in_reasoning
        return start

    async def _lora_request(self, adapter: str | None) -> LoRARequest | None:
        """The engine's ``LoRARequest`` for the request's adapter (None: the base model);
        ``AdapterNotFoundError`` when this model has no adapter of that name."""
        if adapter is None:
            return None
        if self.adapters is None:
            raise AdapterNotFoundError(adapter)
        return await self.adapters.request(adapter)

    async def list_adapters(self) -> list[str]:
        """The adapters this model serves by name (those in its adapter directory)."""
        return self.adapters.catalog.available() if self.adapters is not None else []

    def _reads_tool_calls(self, request: GenerateRequest) -> bool:
        """Whether the model's tool_call_parser reads this request's output."""
        return request.tool_choice == "auto" and self.tool_call_parser is not None

    def _check_tool_choice(self, request: GenerateRequest) -> None:
        if request.tool_choice == "auto" and not self.config.frontend.enable_auto_tool_choice:
            raise InvalidRequestError(
                f'"auto" needs a model that reads tool calls out of its text; {self.model_id!r} '
                "has none (set enable_auto_tool_choice and tool_call_parser in its "
                'engine_kwargs), or use tool_choice "required" or a named function',
                param="tool_choice",
            )

    def _with_defaults(self, params: dict[str, Any], prompt: Any) -> dict[str, Any]:
        """The request's sampling dict with the model's defaults for the fields it leaves
        unset; a default ``max_tokens`` fits in what the prompt leaves of the context."""
        if not self.generation_defaults:
            return params
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        room = self.max_model_len - len(ids) if ids is not None else 0
        return with_generation_defaults(params, self.generation_defaults, room)

    def _prompt(self, request: GenerateRequest | EmbedRequest) -> Any:
        """The prompt for the core, tokenized here (the head's process only runs the model), cut
        to the request's ``truncate_prompt_tokens``."""
        prompt = request_prompt(self.tokenizer, request, self.multimodal, self.image_placeholder)
        return truncated_prompt(prompt, request, self.max_model_len)

    def _refusal(self, exc: Exception, adapter: str | None = None) -> StreamError:
        """The error item for a request the engine refused, or aborted before its one output:
        400 naming the field (a refused LoRA adapter: the ``model`` the client sent); 503
        overloaded, draining, or the engine dead (whose cause, a worker's traceback or paths,
        goes to the log, never to the client)."""
        if isinstance(exc, InvalidRequestError):
            if adapter is not None and exc.param == "lora_request":
                name = f"{self.model_id}:{adapter}"
                return error_item(400, f"LoRA adapter `{name}` cannot be served: {exc.reason}",
                                  "model")  # fmt: skip
            return error_item(400, str(exc), exc.param)
        if isinstance(exc, EngineOverloadedError):
            return error_item(503, f"model {self.model_id!r}: {exc}", None, "overloaded",
                              exc.retry_after_s)  # fmt: skip
        if isinstance(exc, RequestAbortedError):
            return self._draining_error()
        if isinstance(exc, EngineStateError):  # asleep meanwhile: the retry wakes it
            return error_item(503, f"model {self.model_id!r}: {exc}; retry", None, "asleep", 1)
        return error_item(503, f"the engine for {self.model_id!r} is not available")

    def _draining_error(self) -> StreamError:
        return error_item(503, f"this replica of {self.model_id!r} is shutting down; retry",
                          None, "draining", 1)  # fmt: skip

    # ---- tokenizer ----------------------------------------------------------------------

    async def tokenize(
        self, request: GenerateRequest, return_token_strs: bool = False
    ) -> TokenizeResult | StreamError:
        """The prompt ids of the request's ``prompt`` or ``messages`` (vLLM's ``/tokenize``),
        with the tokenizer's pieces when ``return_token_strs`` (an adapter's: its base model's)."""
        if (missing := self._missing_adapter(request.adapter)) is not None:
            return missing
        try:
            if request.messages is not None:
                # A VLM's image parts count as their image's tokens, as the engine sees them.
                defaults = self.config.frontend.default_chat_template_kwargs
                prompt = request_chat_prompt(
                    self.tokenizer,
                    with_template_defaults(request, defaults),
                    self.multimodal,
                    self.image_placeholder,
                )
                ids = prompt["prompt_token_ids"]
            else:
                text = request.prompt
                if not isinstance(text, str):
                    raise InvalidRequestError("must be a string", param="prompt")
                special = request.add_special_tokens is not False
                ids = self.tokenizer.encode(text, add_special_tokens=special)
        except InvalidRequestError as exc:
            return error_item(400, exc.reason, exc.param)
        pieces = self.tokenizer.convert_ids_to_tokens(list(ids)) if return_token_strs else None
        return TokenizeResult(list(ids), len(ids), self.max_model_len, pieces)

    async def detokenize(
        self, tokens: list[int], adapter: str | None = None
    ) -> DetokenizeResult | StreamError:
        if (missing := self._missing_adapter(adapter)) is not None:
            return missing
        vocab = self.config.model.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and 0 <= t < vocab for t in tokens
        ):
            return error_item(400, f"must be a list of token ids in [0, {vocab})", "tokens")
        return DetokenizeResult(self.tokenizer.decode(tokens))

    def _missing_adapter(self, adapter: str | None) -> StreamError | None:
        """The 404 of an adapter this model does not have (None: it has it, or none named)."""
        if adapter is None or (self.adapters is not None and self.adapters.catalog.has(adapter)):
            return None
        return self._not_found(adapter)

    def _not_found(self, adapter: str) -> StreamError:
        name = f"{self.model_id}:{adapter}"
        return error_item(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    # ---- health and stats ---------------------------------------------------------------

    async def check_health(self) -> None:
        self._ensure_idle_timer()  # (Serve calls this from the start: the timer runs idle too)
        if self.engine is not None:  # (None: started asleep, nothing to fail yet)
            await self.engine.check_engine_health()

    async def health(self) -> dict[str, Any]:
        try:
            await self.check_health()
        except EngineDeadError:
            logger.exception("model %s: health check failed", self.model_id)
            return {"healthy": False, "error": "the engine is dead"}
        return {"healthy": True}

    def _ensure_stats_task(self) -> None:
        loop = asyncio.get_running_loop()
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = loop.create_task(self._publish_stats())
        if self._stopping is not None and self._drain_task is None:
            self._drain_task = loop.create_task(self._drain_when_stopped())

    # ---- graceful drain -----------------------------------------------------------------

    async def _drain_when_stopped(self) -> None:
        """Serve stops a replica (scale-down, redeploy, ``cluster shutdown``) by routing nothing
        new to it and waiting for its ongoing requests, then kills it at its graceful-shutdown
        deadline. From the moment Serve marks it stopping, this replica refuses new requests
        (503 ``draining``), lets in-flight ones finish for ``drain_timeout_s``, then aborts the
        rest, so they end with finish_reason "abort" instead of a severed connection."""
        stopping = self._stopping
        if stopping is None:  # outside Serve, or its flag is unreadable: Serve's drain only
            return
        gcs_lost = gcs_loss_flag()
        polls = 0
        while not stopping():
            await asyncio.sleep(0.2)
            polls += 1
            if gcs_lost is not None and polls % 3 == 0 and await gcs_lost():
                # Ray itself is stopping (cluster serve's process group got SIGTERM): its
                # raylet ends this process within seconds, so streams end now, with "abort".
                await self.drain(0.0)
                return
        await self.drain(self.drain_timeout_s)

    async def drain(self, timeout_s: float) -> dict[str, int]:
        """Refuse new requests, wait up to ``timeout_s`` for in-flight ones, abort the rest.
        Returns how many finished in time and how many were aborted."""
        self.draining = True
        in_flight = len(self._active)
        logger.info("model %s: draining %d in-flight requests (up to %.0f s)",
                    self.model_id, in_flight, timeout_s)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        leftover = list(self._active)
        self.drain_aborted = True
        for request_id in leftover:
            with contextlib.suppress(EngineDeadError):
                if self.engine is not None:
                    await self.engine.abort(request_id)
        if leftover:
            logger.warning("model %s: drain timeout, aborted %d requests",
                           self.model_id, len(leftover))  # fmt: skip
        return {"finished": in_flight - len(leftover), "aborted": len(leftover)}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (also None's AttributeError: never started)
            self.engine.shutdown()  # type: ignore[union-attr]


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


def _remaining(timeout: Any, arrived: float) -> Any:
    """What is left of a request's ``timeout`` (seconds from ``arrived``), at least a
    millisecond so that the engine still takes it and ends it as timed out; a value that is not
    a positive number goes to the engine as it is, which refuses it naming the field."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        return timeout
    return max(timeout - (time.monotonic() - arrived), 1e-3)


def _was_aborted(item: Any) -> bool:
    return any(d.finish_reason == "abort" for d in item.deltas)


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_tag
    except Exception:  # outside a Serve replica (unit tests)
        return "local"
