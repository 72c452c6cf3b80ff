"""The Ray Serve application: one ``LLMServer`` deployment per model (the heads) and one ingress
that speaks OpenAI over HTTP (and the ``LLM`` service over gRPC) and routes by ``model``
through streaming deployment handles.

    build_app("configs/tiny.yaml")  ->  serve.Application  (``serve.run`` or ``cluster deploy``)
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import re
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import grpc
import msgspec
import numpy as np
import ray
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle

from cluster.api_errors import APIError, api_error, error_body, error_response
from cluster.api_guard import api_key_matches
from cluster.config import HEAD_BUNDLE_INDEX, DeploymentConfig, ModelDeployment, load_config
from cluster.metrics import PREFIX
from cluster.openai_api import make_openai_app, metrics_response
from cluster.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from cluster.openai_payloads import (
    MAX_PROMPTS_PER_REQUEST,
    chat_messages,
    chat_payload,
    check_extra_fields,
    completion_payloads,
    tool_choice,
)
from cluster.openai_responses import Completion, stream_sse
from cluster.proto import llm_pb2
from cluster.protocol import (
    EmbedRequest,
    GenerateRequest,
    StreamError,
    StreamStart,
    grpc_code_name,
)
from cluster.serve_replica import serve_stop_flag
from cluster.token_channel import TokenChannel

INGRESS_NAME = "OpenAIIngress"
# Which replica served a generation (routing checks, debugging).
REPLICA_HEADER = "x-llm-cluster-replica"
COLD_START_RETRY_AFTER_S = 10
# Every variable engine/envs.py reads (in the replicas' processes; a test keeps the two in step),
# and no other: the API keys' variable, say, must not land in Ray's runtime_env.
_FORWARDED_ENV = ("LLM_CLUSTER_CACHE_DIR", "LLM_CLUSTER_LOG_LEVEL", "LLM_CLUSTER_STEP_TIMEOUT_S",
                  "LLM_CLUSTER_DIST_TIMEOUT_S", "LLM_CLUSTER_LOAD_TIMEOUT_S",
                  "LLM_CLUSTER_CPU_PACKED_GEMM", "LLM_CLUSTER_STEP_PROFILE", "HF_HUB_OFFLINE",
                  "OMP_NUM_THREADS", "TRITON_INTERPRET", "LLM_CLUSTER_RAY_DISPATCH",
                  "LLM_CLUSTER_PP_PIPELINING")  # fmt: skip


def deployment_name(model_id: str) -> str:
    return "LLMServer:" + re.sub(r"[^A-Za-z0-9_.-]", "-", model_id)


async def _response(response: Any) -> Any:
    return await response


def _unwrap(result: Any) -> Any:
    """A tokenizer route's reply as the HTTP body: a ``StreamError`` becomes its error body."""
    if isinstance(result, StreamError):
        body = error_body(result.status, result.message, result.param, result.code)
        return JSONResponse(body, status_code=result.status)
    return msgspec.to_builtins(result)


async def guard_stream(items: Any, model: str) -> Any:
    """The server's items, with a failure of the replica itself (its process killed, its node
    lost: a Ray error from the handle's stream) turned into a final 503 error item, so HTTP
    streams end with an error chunk and ``[DONE]`` and gRPC with UNAVAILABLE."""
    try:
        async for item in items:
            yield item
    except ray.exceptions.RayError:
        yield StreamError(503, f"the replica serving {model!r} failed; retry the request",
                          None, "unavailable")  # fmt: skip


async def merge_streams(streams: list[Any]) -> Any:
    """``(i, item)`` for the items of every stream i as they come (a batched completions
    request: one server stream per prompt)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: Any) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        finally:
            await queue.put(done)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            entry = await queue.get()
            if entry is done:
                remaining -= 1
                continue
            yield entry
        for task in tasks:
            task.result()  # a stream's own failure surfaces here
    finally:
        for task in tasks:
            task.cancel()


def scrape_cluster_metrics() -> str:
    """Every alive node's Ray metrics agent, filtered to this project's metrics: one scrape
    shows every replica of every model."""
    lines: list[str] = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        url = f"http://{node['NodeManagerAddress']}:{port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            continue
        lines += [line for line in text.splitlines() if PREFIX in line]
    return "\n".join(lines) + "\n"


def grpc_payload(request: llm_pb2.GenerateRequest) -> GenerateRequest:
    """The server payload for a gRPC request; unset optional fields keep the engine default."""
    if request.HasField("n") and request.n != 1:
        raise APIError(400, f"n: gRPC responses carry one choice, so n must be 1, got {request.n}",
                       "n")  # fmt: skip
    params: dict[str, Any] = {"ignore_eos": request.ignore_eos}
    for name in ("temperature", "top_p", "top_k", "max_tokens", "seed", "skip_special_tokens"):
        if request.HasField(name):
            params[name] = getattr(request, name)
    if request.stop:
        params["stop"] = list(request.stop)
    if request.stop_token_ids:
        params["stop_token_ids"] = list(request.stop_token_ids)
    if request.HasField("structured_outputs"):
        params["structured_outputs"] = grpc_structured_outputs(request.structured_outputs)
    if bool(request.prompt) == bool(request.prompt_token_ids):
        raise APIError(400, "prompt: give exactly one of prompt or prompt_token_ids", "prompt")
    if request.prompt_token_ids:
        return GenerateRequest(params=params, prompt_token_ids=list(request.prompt_token_ids))
    return GenerateRequest(params=params, prompt=request.prompt)


def _embedding_inputs(value: Any) -> list[EmbedRequest]:
    """One server request per input: a string, token ids, or a batch of either."""
    if isinstance(value, str):
        return [EmbedRequest(prompt=value)]
    if not value:
        raise APIError(400, "input: must not be empty", "input")
    if isinstance(value[0], int):
        return [EmbedRequest(prompt_token_ids=value)]
    if len(value) > MAX_PROMPTS_PER_REQUEST:
        raise APIError(400, f"input: at most {MAX_PROMPTS_PER_REQUEST} inputs per request, "
                       f"got {len(value)}", "input")  # fmt: skip
    return [
        EmbedRequest(prompt=v) if isinstance(v, str) else EmbedRequest(prompt_token_ids=v)
        for v in value
    ]


def _encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the list; ``base64``: little-endian float32 bytes in base64 (OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def _model_card(model_id: str, parent: str | None = None) -> dict[str, Any]:
    card = {"id": model_id, "object": "model", "created": 0, "owned_by": "llm-cluster"}
    if parent is not None:  # a LoRA adapter of ``parent`` (vLLM's "parent" / "root")
        card.update(parent=parent, root=parent)
    return card


def grpc_structured_outputs(spec: llm_pb2.StructuredOutputs) -> dict[str, Any]:
    """The engine's ``StructuredOutputsParams`` fields of a gRPC request (one kind set)."""
    kinds = {"json": spec.json, "regex": spec.regex, "choice": list(spec.choice),
             "grammar": spec.grammar, "json_object": spec.json_object}  # fmt: skip
    given = {k: v for k, v in kinds.items() if v}
    if len(given) != 1:
        raise APIError(400, "structured_outputs: set exactly one of json, regex, choice, "
                       "grammar, json_object", "structured_outputs")  # fmt: skip
    if spec.disable_any_whitespace:
        given["disable_any_whitespace"] = True
    return given


def grpc_abort(context: RayServegRPCContext, error: APIError) -> None:
    """Set the status for ``error`` and raise: Serve's proxy sends that status to the client.
    An overloaded model (a full waiting queue, Serve's back-pressure) is RESOURCE_EXHAUSTED."""
    context.set_code(getattr(grpc.StatusCode, grpc_code_name(error.status, error.code)))
    context.set_details(error.message)
    raise error


def grpc_check_key(context: RayServegRPCContext, key_hashes: list[str]) -> None:
    if not key_hashes:
        return
    metadata = dict(context.invocation_metadata())
    token = metadata.get("authorization", "").removeprefix("Bearer ").strip()
    if not api_key_matches(token or metadata.get("x-api-key", ""), key_hashes):
        grpc_abort(context, APIError(401, "missing or invalid API key"))


# Serve pickles the ingress class by value with the globals it sees when decorated: every
# helper it calls is defined above it. The FastAPI app is built per replica, after __init__
# (``__serve_build_asgi_app__``), so the API keys and body limit live on the app that serves.
@serve.ingress()
class OpenAIIngress:
    def __init__(
        self,
        servers: dict[str, DeploymentHandle],
        api_key_hashes: list[str],
        max_body_bytes: int,
        lora_models: list[str] | None = None,
        cold_start_timeouts: dict[str, float] | None = None,
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
        # Token deltas from the models' heads, one message per step for all our requests.
        self.channel = TokenChannel()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return make_openai_app(self, self.api_key_hashes, self.max_body_bytes)

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
        request_id = uuid.uuid4().hex
        payload = msgspec.structs.replace(
            payload, adapter=adapter, request_id=request_id, channel=self.channel.sink
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

    async def _first_item(
        self, handle: DeploymentHandle, payload: GenerateRequest, model: str, adapter: str | None
    ) -> tuple[StreamStart, Any]:
        stream = handle.options(stream=True).generate.remote(payload)
        base = model if adapter is None else model[: -len(adapter) - 1]
        timeout_s = self.cold_start_timeouts.get(base)
        try:
            first = await asyncio.wait_for(stream.__anext__(), timeout_s)
        except TimeoutError as exc:
            stream.cancel()
            raise APIError(503, f"model {model!r} is starting (it was scaled to zero) and did "
                           f"not answer within {timeout_s:.0f} s; retry later", None,
                           "cold_start", retry_after=COLD_START_RETRY_AFTER_S) from exc  # fmt: skip
        except BackPressureError as exc:
            raise APIError(503, f"model {model!r} is overloaded, retry later", None,
                           "overloaded", retry_after=1) from exc  # fmt: skip
        except (ray.exceptions.RayError, StopAsyncIteration) as exc:
            raise APIError(503, f"model {model!r} is not available", None, "unavailable") from exc
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
        results = await asyncio.gather(
            *(self.open_stream(model, p) for p in payloads), return_exceptions=True
        )
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
        opened = await self.open_streams(req.model, payloads)
        first_chunks = []
        for i, (first, _) in enumerate(opened):
            first_chunks += completion.absorb(first, i)
        streams = [stream for _, stream in opened]

        def cancel() -> None:
            for stream in streams:
                stream.cancel()

        merged = merge_streams([guard_stream(s, req.model) for s in streams])
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
        usage = bool(req.stream_options and req.stream_options.include_usage)
        completion = Completion(req.model, False, usage, req.logprobs, echo=req.echo,
                                echo_only=req.echo and req.max_tokens == 0)  # fmt: skip
        return await self._generate(req, payloads, completion)

    async def chat_completions(self, req: ChatCompletionRequest) -> Any:
        payload = chat_payload(req)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        completion = Completion(req.model, True, usage, top_logprobs, tools=tool_choice(req),
                                stream=req.stream)  # fmt: skip
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
        for base in sorted(self.lora_models):
            data += [_model_card(f"{base}:{a}", base) for a in await self._adapters(base)]
        return {"object": "list", "data": data}

    async def model(self, model_id: str) -> dict[str, Any]:
        _, adapter = self._route(model_id)  # 404 naming it if unknown
        if adapter is None:
            return _model_card(model_id)
        base = model_id[: -len(adapter) - 1]
        if adapter not in await self._adapters(base):
            raise APIError(404, f"The model `{model_id}` does not exist.", "model",
                           "model_not_found")  # fmt: skip
        return _model_card(model_id, base)

    async def _adapters(self, base: str) -> list[str]:
        try:
            return await self.servers[base].list_adapters.remote()
        except ray.exceptions.RayError:
            return []  # its replicas are down (or scaled to zero): list the base model only

    async def embeddings(self, req: EmbeddingRequest) -> Any:
        check_extra_fields(req)
        if req.dimensions is not None:
            raise APIError(400, f"dimensions: {req.model} does not support reducing the "
                           "embedding's dimensions", "dimensions", "unsupported")  # fmt: skip
        inputs = _embedding_inputs(req.input)
        handle = self._server(req.model)
        try:
            results = await asyncio.gather(*(handle.embed.remote(p) for p in inputs))
        except ray.exceptions.RayError as exc:
            raise APIError(503, f"model {req.model!r} is not available", None,
                           "unavailable") from exc  # fmt: skip
        error = next((r for r in results if isinstance(r, StreamError)), None)
        if error is not None:
            raise api_error(error)
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode_embedding(r.embedding, req.encoding_format)}
                for i, r in enumerate(results)]  # fmt: skip
        tokens = sum(r.prompt_tokens for r in results)
        return {"object": "list", "data": data, "model": req.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip

    async def tokenize(self, req: TokenizeRequest) -> Any:
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt or messages", "prompt")
        payload = GenerateRequest(prompt=req.prompt)
        if req.messages is not None:
            payload = GenerateRequest(messages=chat_messages(req.messages))
        return _unwrap(await self._server(req.model).tokenize.remote(payload))

    async def detokenize(self, req: DetokenizeRequest) -> Any:
        return _unwrap(await self._server(req.model).detokenize.remote(req.tokens))

    async def health(self) -> Any:
        problems = {}
        idle = await asyncio.to_thread(self._scaled_to_zero)
        for model, handle in self.servers.items():
            if model in idle:  # a health call would start a replica; nothing there can be dead
                continue
            try:
                status = await asyncio.wait_for(_response(handle.health.remote()), 10)
            except Exception as exc:  # unreachable replica: unhealthy, whatever the cause
                status = {"healthy": False, "error": type(exc).__name__}
            if not status["healthy"]:
                problems[model] = status.get("error", "unhealthy")
        if problems:
            message = "; ".join(f"{m}: {e}" for m, e in problems.items())
            return error_response(APIError(503, message, None, "engine_dead"))
        return JSONResponse({"status": "ok"})

    def _scaled_to_zero(self) -> set[str]:
        """The models that scale to zero and have no running replica now (Serve's status)."""
        if not self.cold_start_timeouts:
            return set()
        try:
            app = serve.status().applications[serve.get_replica_context().app_name]
        except Exception:  # status unreachable: check every model
            return set()
        idle = set()
        for model in self.cold_start_timeouts:
            deployment = app.deployments.get(deployment_name(model))
            states = deployment.replica_states if deployment is not None else {}
            if not any(getattr(s, "value", s) == "RUNNING" and n for s, n in states.items()):
                idle.add(model)
        return idle

    async def metrics(self) -> Any:
        return metrics_response(await asyncio.to_thread(scrape_cluster_metrics))

    # ---- gRPC (service ``llmcluster.LLM``, through Serve's gRPC proxy) -----------------------

    async def Generate(  # Serve's gRPC proxy calls the method named as the RPC
        self, request: llm_pb2.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> Any:
        grpc_check_key(grpc_context, self.api_key_hashes)
        try:
            first, items = await self.open_stream(request.model, grpc_payload(request))
        except APIError as exc:
            grpc_abort(grpc_context, exc)
        try:
            async for item in guard_stream(items, request.model):
                if isinstance(item, StreamError):
                    grpc_abort(grpc_context, api_error(item))
                for choice in item.choices:  # one choice: gRPC requests always have n = 1
                    yield llm_pb2.GenerateResponse(
                        text=choice.text,
                        token_ids=choice.token_ids,
                        finish_reason=choice.finish_reason or "",
                        prompt_tokens=first.prompt_tokens,
                        completion_tokens=choice.num_output_tokens,
                    )
        finally:
            items.cancel()

    async def Health(  # Serve's gRPC proxy calls the method named as the RPC
        self, request: llm_pb2.HealthRequest, grpc_context: RayServegRPCContext
    ) -> llm_pb2.HealthResponse:
        grpc_check_key(grpc_context, self.api_key_hashes)
        models = [request.model] if request.model else list(self.servers)
        for model in models:
            try:
                status = await _response(self._server(model).health.remote())
            except APIError as exc:
                grpc_abort(grpc_context, exc)
            except Exception as exc:  # unreachable replica
                status = {"healthy": False, "error": type(exc).__name__}
            if not status["healthy"]:
                message = f"{model}: {status.get('error', 'unhealthy')}"
                grpc_abort(grpc_context, APIError(503, message))
        return llm_pb2.HealthResponse(healthy=True, message="ok")

    # ---- handle methods for tools (``cluster status``, tests) -------------------------------

    async def model_stats(self, model: str) -> dict[str, Any]:
        return await self._server(model).stats.remote()


# ---- building the application ------------------------------------------------------------


def build_app(config: str | os.PathLike[str] | dict[str, Any] | DeploymentConfig) -> Any:
    """The Serve application for a deployment config (validated first; raises ``ConfigError``)."""
    if not isinstance(config, DeploymentConfig):
        config = load_config(config)
    servers = {m.model_id: _server_deployment(m) for m in config.models}
    hashes = config.api_keys.load_key_hashes() if config.api_keys else []
    # The ingress outlives every model's drain, so aborted streams still reach their clients.
    drain_s = max(m.serve_options()["graceful_shutdown_timeout_s"] for m in config.models)
    ingress = serve.deployment(OpenAIIngress).options(
        name=INGRESS_NAME,
        num_replicas=1,
        max_ongoing_requests=1024,
        graceful_shutdown_timeout_s=drain_s + 5,
        ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env()},
    )
    lora_models = [m.model_id for m in config.models if m.lora_config is not None]
    cold_start = {
        m.model_id: m.deployment_config.cold_start_timeout_s
        for m in config.models
        if m.deployment_config.scales_to_zero
    }
    return ingress.bind(
        servers, hashes, config.http_options.max_body_bytes, lora_models, cold_start
    )


def _server_deployment(model: ModelDeployment) -> Any:
    options = model.serve_options()
    bundles = options["placement_group_bundles"]
    # The replica (the front) takes bundle 0; its head actor takes bundle 1 (the device too
    # with TP = PP = 1); worker actors take the rest.
    actor: dict[str, Any] = {"num_cpus": bundles[0].get("CPU", 0), "runtime_env": runtime_env()}
    # Imported here: the front pulls in the engine (torch, transformers); the ingress replica,
    # which imports this module, never runs one.
    from cluster.llm_server import LLMServer

    deployment = serve.deployment(LLMServer).options(
        name=deployment_name(model.model_id), ray_actor_options=actor, **options
    )
    drain_timeout_s = model.deployment_config.graceful_shutdown_timeout_s
    head = bundles[HEAD_BUNDLE_INDEX]
    head_resources = {k: v for k, v in head.items() if k in ("CPU", "GPU")}
    lora = dataclasses.asdict(model.lora_config) if model.lora_config is not None else None
    return deployment.bind(
        model.model_id, model.engine_args(), drain_timeout_s, head_resources, lora
    )


def runtime_env() -> dict[str, Any]:
    """Forward this project's environment settings, and its source tree when it runs from a
    checkout rather than an installed package (replicas must import ``cluster``)."""
    env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p
        )
    return {"env_vars": env} if env else {}
