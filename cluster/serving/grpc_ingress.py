"""The ingress's gRPC service ``llmcluster.LLM`` (through Serve's gRPC proxy): a request as the
server's payload, the API-key check, errors as gRPC statuses, and the ``Generate`` / ``Health``
RPCs, which ``OpenAIIngress`` inherits (the proxy calls the ingress method named as the RPC)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle

from cluster.api.api_errors import APIError, api_error
from cluster.api.api_guard import api_key_matches
from cluster.api.replica_messages import GenerateRequest, StreamError, StreamStart, grpc_code_name
from cluster.proto import llm_pb2
from cluster.serving.ingress_calls import guard_stream
from cluster.serving.readiness import unready_models


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


class LLMServicer:
    """The RPCs of ``llmcluster.LLM``, on the ingress: they route through its ``open_stream``
    and ``_server`` like the HTTP routes (mixed into ``OpenAIIngress``, which has them)."""

    api_key_hashes: list[str]
    servers: dict[str, DeploymentHandle]
    cold_start_timeouts: dict[str, float]
    open_stream: Callable[[str, GenerateRequest], Awaitable[tuple[StreamStart, Any]]]
    _server: Callable[[str], DeploymentHandle]

    async def Generate(  # Serve's gRPC proxy calls the method named as the RPC
        self, request: llm_pb2.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[llm_pb2.GenerateResponse]:
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
                        completion_tokens=choice.num_tokens,
                    )
        finally:
            items.cancel()

    async def Health(  # Serve's gRPC proxy calls the method named as the RPC
        self, request: llm_pb2.HealthRequest, grpc_context: RayServegRPCContext
    ) -> llm_pb2.HealthResponse:
        grpc_check_key(grpc_context, self.api_key_hashes)
        models = [request.model] if request.model else list(self.servers)
        servers = {}
        for model in models:
            try:
                servers[model] = self._server(model)
            except APIError as exc:
                grpc_abort(grpc_context, exc)
        problems = await unready_models(servers, self.cold_start_timeouts)  # as GET /health
        if problems:
            message = "; ".join(f"{m}: {e}" for m, e in problems.items())
            grpc_abort(grpc_context, APIError(503, message))
        return llm_pb2.HealthResponse(healthy=True, message="ok")


__all__ = [
    "LLMServicer",
    "grpc_abort",
    "grpc_check_key",
    "grpc_payload",
    "grpc_structured_outputs",
]
