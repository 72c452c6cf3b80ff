"""The ingress's gRPC service ``llmcluster.LLM`` (through Serve's gRPC proxy): a request as the
server's payload, the API-key check, errors as gRPC statuses, and the ``Generate`` / ``Health``
RPCs, which ``OpenAIIngress`` inherits (the proxy calls the ingress method named as the RPC).

The RPCs keep the HTTP edge's rules: the same API keys (``api_guard.request_api_key``; ``Health``
is open like ``/health``), a request over ``max_body_bytes`` refused before any work
(RESOURCE_EXHAUSTED, as HTTP's 413), ``x-request-timeout`` metadata as the
engine's ``timeout`` (DEADLINE_EXCEEDED, as HTTP's 408), and no internals in a status: any other
failure is INTERNAL "internal server error", its cause in the replica's log."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle

from cluster.api.api_errors import APIError, api_error
from cluster.api.api_guard import api_key_matches, request_api_key
from cluster.api.openai_api import TIMEOUT_HEADER, timeout_seconds
from cluster.api.replica_messages import GenerateRequest, StreamError, StreamStart, grpc_code_name
from cluster.proto import llm_pb2
from cluster.serving.ingress_calls import base_model, guard_stream
from cluster.serving.readiness import unready_models

logger = logging.getLogger("llm_cluster.serve")


def grpc_payload(request: llm_pb2.GenerateRequest, timeout: float | None = None) -> GenerateRequest:
    """The server payload for a gRPC request; unset optional fields take the model's defaults
    (its generation_config), then the engine's.
    ``timeout``: the engine's (``grpc_timeout``)."""
    if not request.model:
        raise APIError(400, "model: required", "model")
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
    if not request.prompt and not request.prompt_token_ids:  # proto3: unset is ""
        raise APIError(400, "prompt: must not be empty (give prompt or prompt_token_ids)",
                       "prompt")  # fmt: skip
    if request.prompt and request.prompt_token_ids:
        raise APIError(400, "prompt: give exactly one of prompt or prompt_token_ids", "prompt")
    if request.prompt_token_ids:
        return GenerateRequest(params=params, prompt_token_ids=list(request.prompt_token_ids),
                               timeout=timeout)  # fmt: skip
    return GenerateRequest(params=params, prompt=request.prompt, timeout=timeout)


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
    An overloaded model (a full waiting queue, Serve's back-pressure) is RESOURCE_EXHAUSTED;
    HTTP's ``Retry-After`` (overloaded, waking, cold start) is trailing ``retry-after``
    metadata (seconds)."""
    context.set_code(getattr(grpc.StatusCode, grpc_code_name(error.status, error.code)))
    context.set_details(error.message)
    if error.retry_after is not None:
        context.set_trailing_metadata((("retry-after", str(error.retry_after)),))
    raise error


def grpc_check_key(context: RayServegRPCContext, key_hashes: list[str]) -> None:
    """UNAUTHENTICATED unless the call's metadata carries a key, by HTTP's rule."""
    if not key_hashes:
        return
    token = request_api_key(_metadata(context, "authorization"), _metadata(context, "x-api-key"))
    if not api_key_matches(token, key_hashes):
        grpc_abort(context, APIError(401, "missing or invalid API key", None, "invalid_api_key"))


def grpc_check_size(request: llm_pb2.GenerateRequest, max_body_bytes: int) -> None:
    """RESOURCE_EXHAUSTED (HTTP's 413) for a request whose serialized size is over the limit."""
    size = request.ByteSize()
    if size > max_body_bytes:
        raise APIError(413, f"the request is {size} bytes; max_body_bytes allows at most "
                       f"{max_body_bytes}", None, "too_large")  # fmt: skip


def grpc_timeout(context: RayServegRPCContext) -> float | None:
    """The engine's ``timeout`` for a call: its ``x-request-timeout`` metadata (seconds, checked
    as HTTP's header); None without it. (Serve's gRPC context, Ray 2.60, does not carry the
    call's deadline, so a deadline alone does not reach the engine.)"""
    raw = _metadata(context, TIMEOUT_HEADER)
    return None if raw is None else timeout_seconds(raw)


def _metadata(context: RayServegRPCContext, key: str) -> str | None:
    """The first value of ``key`` in the call's metadata (gRPC sends keys in lower case)."""
    for name, value in context.invocation_metadata():
        if name == key and isinstance(value, str):
            return value
    return None


class LLMServicer:
    """The RPCs of ``llmcluster.LLM``, on the ingress: they route through its ``open_stream``
    and ``_route`` like the HTTP routes (mixed into ``OpenAIIngress``, which has them)."""

    api_key_hashes: list[str]
    max_body_bytes: int
    servers: dict[str, DeploymentHandle]
    cold_start_timeouts: dict[str, float]
    open_stream: Callable[[str, GenerateRequest], Awaitable[tuple[StreamStart, Any]]]
    _route: Callable[[str], tuple[DeploymentHandle, str | None]]

    async def Generate(  # Serve's gRPC proxy calls the method named as the RPC
        self, request: llm_pb2.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[llm_pb2.GenerateResponse]:
        try:
            grpc_check_key(grpc_context, self.api_key_hashes)
            grpc_check_size(request, self.max_body_bytes)  # before any work on it
            payload = grpc_payload(request, grpc_timeout(grpc_context))
            first, items = await self.open_stream(request.model, payload)
            try:
                async for item in guard_stream(items, request.model):
                    if isinstance(item, StreamError):
                        raise api_error(item)
                    for choice in item.choices:  # one choice: gRPC requests always have n = 1
                        yield llm_pb2.GenerateResponse(
                            text=choice.text,
                            token_ids=choice.token_ids,
                            finish_reason=choice.finish_reason or "",
                            prompt_tokens=first.prompt_tokens,
                            completion_tokens=choice.num_tokens,
                        )
            finally:
                items.cancel()
        except APIError as exc:
            grpc_abort(grpc_context, exc)
        except Exception:
            logger.exception("gRPC Generate failed")
            _abort_internal(grpc_context)

    async def Health(  # Serve's gRPC proxy calls the method named as the RPC
        self, request: llm_pb2.HealthRequest, grpc_context: RayServegRPCContext
    ) -> llm_pb2.HealthResponse:
        """Readiness, as ``GET /health`` (no API key: it is the probe). ``model`` names one
        model, ``<base>:<adapter>`` as for ``Generate`` (its base model's readiness); empty:
        every model."""
        try:
            servers = self._health_servers(request.model)
            problems = await unready_models(servers, self.cold_start_timeouts)
            if problems:
                raise APIError(503, "; ".join(f"{m}: {e}" for m, e in problems.items()))
        except APIError as exc:
            grpc_abort(grpc_context, exc)
        except Exception:
            logger.exception("gRPC Health failed")
            _abort_internal(grpc_context)
        return llm_pb2.HealthResponse(healthy=True, message="ok")

    def _health_servers(self, model: str) -> dict[str, DeploymentHandle]:
        if not model:
            return dict(self.servers)
        _, adapter = self._route(model)  # NOT_FOUND naming it if unknown
        base = base_model(model, adapter)
        return {base: self.servers[base]}


def _abort_internal(context: RayServegRPCContext) -> None:
    """INTERNAL without the cause's text (a path, a traceback), like HTTP's bare 500."""
    context.set_code(grpc.StatusCode.INTERNAL)
    context.set_details("internal server error")
    raise APIError(500, "internal server error") from None


__all__ = [
    "LLMServicer",
    "grpc_abort",
    "grpc_check_key",
    "grpc_check_size",
    "grpc_payload",
    "grpc_structured_outputs",
    "grpc_timeout",
]
