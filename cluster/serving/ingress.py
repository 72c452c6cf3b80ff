"""The ingress deployment: one ``OpenAIIngress`` replica speaks OpenAI over HTTP (Anthropic's
Messages API too: ``cluster.serving.ingress_messages``) and the ``LLM`` service over gRPC
(``cluster.serving.grpc_ingress``), routes each request by ``model`` to its ``LLMServer``
deployment through streaming handles, and serves the model cards, ``/health`` and ``/metrics``."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.api.api_errors import APIError, api_error, error_body, error_response
from cluster.api.media import MediaError, MediaSettings, chat_images_as_data
from cluster.api.openai_api import make_openai_app, metrics_response
from cluster.api.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from cluster.api.openai_payloads import (
    chat_echo,
    chat_payload,
    completion_payloads,
    grammar_param,
    stream_usage,
    tokenize_payload,
    tool_choice,
)
from cluster.api.openai_responses import Completion, stream_sse
from cluster.api.replica_messages import GenerateRequest, StreamError, StreamStart, unavailable
from cluster.serving.grpc_ingress import LLMServicer
from cluster.serving.ingress_calls import (
    REPLICA_ERRORS,
    ResponsesInFlight,
    base_model,
    call_replica,
    guard_stream,
    merge_streams,
    replica_unavailable,
    wait_until_written,
)
from cluster.serving.ingress_messages import MessagesServicer
from cluster.serving.ingress_pooling import PoolingServicer
from cluster.serving.ingress_prefill import run_prefill
from cluster.serving.ingress_responses import ResponsesServicer, responses_store
from cluster.serving.ingress_sleep import SleepServicer
from cluster.serving.metrics import scrape_cluster_metrics
from cluster.serving.readiness import replica_states, unready_models
from cluster.serving.scale_to_zero import cold_start_error
from cluster.serving.serve_replica import (
    on_sigterm,
    reuse_address_on_direct_ingress,
    serve_stop_flag,
)
from cluster.serving.token_channel import TokenChannel

# Which replica served a generation (routing checks, debugging).
REPLICA_HEADER = "x-llm-cluster-replica"
# On SIGTERM: how long the ended streams' last bytes get to be written before the process exits.
_SIGTERM_FLUSH_S = 1.0


def _unwrap(result: Any) -> Any:
    """A tokenizer route's reply as the HTTP body: a ``StreamError`` becomes its error body."""
    if isinstance(result, StreamError):
        body = error_body(result.status, result.message, result.param, result.code)
        return JSONResponse(body, status_code=result.status)
    return msgspec.to_builtins(result)


def _model_card(model_id: str, parent: str | None = None) -> dict[str, Any]:
    card = {"id": model_id, "object": "model", "created": 0, "owned_by": "llm-cluster"}
    if parent is not None:  # a LoRA adapter of ``parent`` (vLLM's "parent" / "root")
        card.update(parent=parent, root=parent)
    return card


# The FastAPI app is built per replica, after __init__ (``__serve_build_asgi_app__``), so the
# API keys and body limit live on the app that serves. The gRPC RPCs come from ``LLMServicer``.
@serve.ingress()
class OpenAIIngress(
    LLMServicer, ResponsesServicer, MessagesServicer, PoolingServicer, SleepServicer
):
    def __init__(
        self,
        servers: dict[str, DeploymentHandle],
        api_key_hashes: list[str],
        max_body_bytes: int,
        lora_models: list[str] | None = None,
        cold_start_timeouts: dict[str, float] | None = None,
        responses_store_spec: tuple[str, dict[str, Any]] | None = None,
        prefill: dict[str, tuple[DeploymentHandle, float, str]] | None = None,
        awake_spec: tuple[dict[str, int], int, float] | None = None,
        media: MediaSettings | None = None,
    ) -> None:
        self.servers = servers
        self.api_key_hashes = api_key_hashes
        self.max_body_bytes = max_body_bytes
        # Models whose LoRA adapters are served as "<model>:<adapter>".
        self.lora_models = set(lora_models or ())
        # Models that scale to zero: how long a request waits for its first item (a replica
        # starting, then its prefill) before a 503 with Retry-After.
        self.cold_start_timeouts = cold_start_timeouts or {}
        # Serve stopping this replica (cluster shutdown, redeploy): new generations get 503.
        self._stopping = serve_stop_flag()
        # A worker's SIGTERM (its raylet stopping): every stream gets its ending first.
        on_sigterm(self._end_streams_before_exit)
        # Its own HTTP port (direct ingress) bound so that a restart can bind it at once.
        reuse_address_on_direct_ingress()
        # Token deltas from the models' heads, one message per step for all our requests.
        self.channel = TokenChannel()
        # /v1/responses results: the application's store (an actor every replica sees).
        self.responses_store = responses_store(responses_store_spec)
        # Disaggregated models: their prefill pool, how long a prompt waits for it, and the
        # KV connector between the pools.
        self.prefill = prefill or {}
        # sleep_mode.max_awake_models: the models that take turns being awake.
        self._init_awake(awake_spec)
        # Image parts: where their URLs may be fetched from, and the caps (cluster.api.media).
        self.media = media or MediaSettings()

    def _end_streams_before_exit(self) -> None:
        """The SIGTERM hook. A worker gets SIGTERM from its raylet as the raylet stops (``ray
        stop`` on its node, a signal to every process of a cgroup), and the raylet exits
        within ~50 ms, this process with it: no model will end these streams in time. So each
        open stream ends now with a 503 and ``[DONE]``, and the process exits once their
        responses are written (``_SIGTERM_FLUSH_S`` at most)."""
        self.channel.end_all_threadsafe(unavailable("the server is stopping; retry"))
        wait_until_written(_SIGTERM_FLUSH_S)

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = make_openai_app(self, self.api_key_hashes, self.max_body_bytes)
        app.add_middleware(ResponsesInFlight)  # outermost: counts a response to its last byte
        return app

    # ---- routing -------------------------------------------------------------------------

    def _server(self, model: str) -> DeploymentHandle:
        if model not in self.servers:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        return self.servers[model]

    def _route(self, model: str) -> tuple[DeploymentHandle, str | None]:
        """The handle serving ``model`` and its LoRA adapter: ``<base>:<adapter>`` goes to the
        base model's replicas through Serve's model multiplexing (to a replica that already
        loaded the adapter when there is one)."""
        if model in self.servers:
            return self.servers[model], None
        base, _, adapter = model.rpartition(":")
        if base not in self.lora_models or not adapter:
            return self._server(model), None  # the 404
        return self.servers[base].options(multiplexed_model_id=adapter), adapter

    async def open_stream(self, model: str, payload: GenerateRequest) -> tuple[StreamStart, Any]:
        """Start a generation; returns its "start" item and the handle's stream, or raises
        ``APIError`` (the server's validation error, 404, 503) before any byte is sent."""
        if self._stopping is not None and self._stopping():
            raise APIError(503, "the server is shutting down, retry later", None, "draining",
                           retry_after=1)  # fmt: skip
        handle, adapter = self._route(model)
        base = base_model(model, adapter)
        payload = await self._with_image_data(payload)
        await self._admit(base)
        if base in self.prefill:
            prefill, timeout_s, connector = self.prefill[base]
            payload = await run_prefill(prefill, adapter, payload, timeout_s, model, connector)
        request_id = payload.request_id
        payload = msgspec.structs.replace(
            payload, adapter=adapter, channel=await self.channel.sink()
        )
        self.channel.register(request_id)
        try:
            first, stream = await self._first_item(handle, payload, model, adapter)
        except BaseException:
            self.channel.release(request_id)
            raise
        if first.head is None:  # a replica without a head actor: deltas on its stream
            self.channel.release(request_id)
            return first, stream
        return first, self.channel.stream(request_id, first.head, stream, model)

    async def _with_image_data(self, payload: GenerateRequest) -> GenerateRequest:
        """The payload with its chat image parts as checked data URLs (fetched where
        ``media`` allows); a refused image is a 400 naming its part."""
        if payload.messages is None:
            return payload
        try:
            messages = await chat_images_as_data(payload.messages, self.media)
        except MediaError as exc:
            raise APIError(400, str(exc), exc.param, "invalid_image") from None
        return msgspec.structs.replace(payload, messages=messages)

    async def _first_item(
        self, handle: DeploymentHandle, payload: GenerateRequest, model: str, adapter: str | None
    ) -> tuple[StreamStart, Any]:
        stream = handle.options(stream=True).generate.remote(payload)
        timeout_s = self.cold_start_timeouts.get(base_model(model, adapter))
        try:
            first = await asyncio.wait_for(stream.__anext__(), timeout_s)
        except TimeoutError as exc:
            stream.cancel()
            raise cold_start_error(model, timeout_s) from exc
        except (*REPLICA_ERRORS, StopAsyncIteration) as exc:
            raise replica_unavailable(model, exc) from exc
        if isinstance(first, StreamError):
            raise api_error(first)
        return first, stream

    async def open_streams(
        self, model: str, payloads: list[GenerateRequest]
    ) -> list[tuple[StreamStart, Any]]:
        """``open_stream`` for each payload, concurrently; if any fails, the others are
        cancelled and its error raised."""
        if len(payloads) == 1:
            return [await self.open_stream(model, payloads[0])]
        tasks = [asyncio.ensure_future(self.open_stream(model, p)) for p in payloads]
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:  # the client left: gather cancels the ones opening
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result()[1].cancel()  # the ones open: their requests end too
            raise
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is None:
            return list(results)  # type: ignore[arg-type]
        for result in results:
            if not isinstance(result, BaseException):
                result[1].cancel()
        raise error

    async def _generate(
        self, req: Any, payloads: list[GenerateRequest], completion: Completion
    ) -> Any:
        try:
            opened = await self.open_streams(req.model, payloads)
        except APIError as exc:
            raise _in_request_terms(exc, req) from None
        first_chunks = []
        for i, (first, _) in enumerate(opened):
            first_chunks += completion.absorb(first, i)
        streams = [stream for _, stream in opened]

        def cancel() -> None:
            for stream in streams:
                stream.cancel()

        merged = merge_streams([guard_stream(s, req.model) for s in streams])
        if tuple(grammar_param(p, req) for p in _GRAMMAR_PARAMS) != _GRAMMAR_PARAMS:
            merged = _errors_in_request_terms(merged, req)
        replica = opened[0][0].replica_id
        headers = {REPLICA_HEADER: replica} if replica else None
        if req.stream:
            body = stream_sse(completion, merged, cancel, first_chunks)
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)
        try:
            async for i, item in merged:
                if isinstance(item, StreamError):
                    raise api_error(item)
                completion.absorb(item, i)
        finally:
            await merged.aclose()
            cancel()
        return JSONResponse(completion.whole(), headers=headers)

    # ---- OpenAI routes -------------------------------------------------------------------

    async def completions(self, req: CompletionRequest) -> Any:
        payloads = completion_payloads(req)
        usage, continuous = stream_usage(req)
        completion = Completion(req.model, False, usage, req.logprobs, echo=req.echo,
                                echo_only=req.echo and req.max_tokens == 0,
                                continuous_usage=continuous)  # fmt: skip
        return await self._generate(req, payloads, completion)

    async def chat_completions(self, req: ChatCompletionRequest) -> Any:
        payload = chat_payload(req)
        usage, continuous = stream_usage(req)
        top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        completion = Completion(req.model, True, usage, top_logprobs, tools=tool_choice(req),
                                stream=req.stream, continuous_usage=continuous,
                                include_reasoning=req.include_reasoning,
                                chat_echo=chat_echo(req))  # fmt: skip
        try:
            return await self._generate(req, [payload], completion)
        except APIError as exc:
            if exc.param != "logprobs":
                raise
            # The engine's logprobs is what a chat request calls top_logprobs.
            raise APIError(exc.status, exc.message.replace("logprobs", "top_logprobs", 1),
                           "top_logprobs", exc.code) from exc  # fmt: skip

    async def models(self) -> dict[str, Any]:
        data = [_model_card(m) for m in self.servers]
        if not self.lora_models:
            return {"object": "list", "data": data}
        states = await asyncio.to_thread(replica_states, self.lora_models)
        for base in sorted(self.lora_models):
            replicas = states.get(base) if states is not None else None
            if replicas is not None and not replicas.get("RUNNING"):
                continue  # none running (scaled to zero, or loading): asking would start one
            data += [_model_card(f"{base}:{a}", base) for a in await self._adapters(base)]
        return {"object": "list", "data": data}

    async def model(self, model_id: str) -> dict[str, Any]:
        _, adapter = await self._known_route(model_id)
        return _model_card(model_id, None if adapter is None else base_model(model_id, adapter))

    async def _known_route(self, model: str) -> tuple[DeploymentHandle, str | None]:
        """``_route``, and a 404 naming ``model`` for an adapter its base model's directory
        does not hold (asked of the base model's server)."""
        handle, adapter = self._route(model)  # 404 naming it if unknown
        if adapter is not None and adapter not in await self._adapters(base_model(model, adapter)):
            raise APIError(404, f"The model `{model}` does not exist.", "model",
                           "model_not_found")  # fmt: skip
        return handle, adapter

    async def _adapters(self, base: str) -> list[str]:
        try:
            return await self.servers[base].list_adapters.remote()
        except REPLICA_ERRORS:
            return []  # its replicas are down, or their queue full: list the base model only

    async def tokenize(self, req: TokenizeRequest) -> Any:
        # A LoRA adapter tokenizes as its base model (its server 404s an adapter it lacks).
        server, adapter = self._route(self._tokenizer_model(req.model))
        payload = msgspec.structs.replace(tokenize_payload(req), adapter=adapter)
        if payload.messages is not None:
            payload = await self._with_image_data(payload)
        model = self._tokenizer_model(req.model)
        call = server.tokenize.remote(payload, bool(req.return_token_strs))
        return _unwrap(await call_replica(model, call))

    async def detokenize(self, req: DetokenizeRequest) -> Any:
        model = self._tokenizer_model(req.model)
        server, adapter = self._route(model)
        return _unwrap(await call_replica(model, server.detokenize.remote(req.tokens, adapter)))

    def _tokenizer_model(self, model: str | None) -> str:
        """The model a tokenizer route names; as in vLLM it may name none when one is served."""
        if model is not None:
            return model
        if len(self.servers) != 1:
            raise APIError(400, f"model: required when several models are served (one of "
                           f"{', '.join(sorted(self.servers))})", "model")  # fmt: skip
        return next(iter(self.servers))

    async def health(self) -> Any:
        """Readiness (``cluster.serving.readiness``): 200 once every model serves, else 503
        naming each model that does not and why."""
        problems = await unready_models(self.servers, self.cold_start_timeouts)
        if problems:
            message = "; ".join(f"{m}: {e}" for m, e in problems.items())
            starting = all(e.startswith("not ready") for e in problems.values())
            code = "not_ready" if starting else "engine_dead"
            return error_response(APIError(503, message, None, code))
        return JSONResponse({"status": "ok"})

    async def metrics(self) -> Any:
        return metrics_response(await asyncio.to_thread(scrape_cluster_metrics))

    # ---- handle methods for tools (``cluster status``, tests) -------------------------------

    async def model_stats(self, model: str) -> dict[str, Any]:
        return await self._server(model).stats.remote()


def _in_request_terms(error: Any, req: Any) -> Any:
    """The server's error (``APIError`` or ``StreamError``) naming the request's own grammar
    field where it names the engine's (``grammar_param``), in its param and its message."""
    param = grammar_param(error.param, req)
    if param == error.param:
        return error
    message = error.message
    if message.startswith(f"{error.param}:"):
        message = param + message[len(error.param) :]
    if isinstance(error, StreamError):
        return msgspec.structs.replace(error, param=param, message=message)
    return APIError(error.status, message, param, error.code, error.retry_after)


_GRAMMAR_PARAMS = tuple(f"structured_outputs.{k}" for k in ("json", "regex", "choice", "grammar"))


async def _errors_in_request_terms(items: Any, req: Any) -> Any:
    try:
        async for i, item in items:
            yield i, _in_request_terms(item, req) if isinstance(item, StreamError) else item
    finally:
        await items.aclose()


__all__ = ["REPLICA_HEADER", "OpenAIIngress"]
