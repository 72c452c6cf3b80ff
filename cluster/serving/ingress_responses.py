"""The Responses API on the ingress (``POST /v1/responses``, ``GET`` / ``DELETE
/v1/responses/{id}``), mixed into ``OpenAIIngress``: the request becomes the chat request the
chat route serves (``cluster.api.responses_payloads``), its result or stream becomes output
items and events (``cluster.api.responses_builder``), and the response is kept in the
application's store (``cluster.serving.responses_store``) that every ingress replica sees."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi.responses import JSONResponse, StreamingResponse

from cluster.api.api_errors import APIError, api_error, renamed
from cluster.api.openai_payloads import chat_payload, tool_choice
from cluster.api.openai_responses import Completion
from cluster.api.reasoning_parsers import GptOssReasoningParser
from cluster.api.replica_messages import StreamError
from cluster.api.responses_builder import ResponseBuilder, sse_event
from cluster.api.responses_models import ResponsesRequest
from cluster.api.responses_payloads import chat_request, check_request, input_items
from cluster.serving.ingress_calls import guard_stream
from cluster.serving.responses_store import StoreClient, StoreLimits

logger = logging.getLogger("llm_cluster.serve")

# Which ingress replica served a Responses call (the store is shared: tests show it).
INGRESS_REPLICA_HEADER = "x-llm-cluster-ingress-replica"


def responses_store(spec: tuple[str, dict[str, Any]] | None) -> StoreClient:
    """The store of ``(app name, limits)``; None: a store in this process (no Serve)."""
    if spec is None:
        return StoreClient(None)
    app_name, limits = spec
    return StoreClient(app_name, StoreLimits(**limits))


def _ingress_replica_id() -> str | None:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not in a Serve replica (tests, the fuzzer)
        return None


class ResponsesServicer:
    """The Responses routes over ``open_stream`` (``OpenAIIngress``'s, which mixes this in)."""

    open_stream: Any

    def _responses_store(self) -> StoreClient:
        store = self.__dict__.get("responses_store")
        if store is None:
            store = self.__dict__["responses_store"] = StoreClient(None)
        return store

    def _replica_headers(self) -> dict[str, str] | None:
        replica = _ingress_replica_id()
        return {INGRESS_REPLICA_HEADER: replica} if replica else None

    async def _stored(self, response_id: str) -> dict[str, Any]:
        record = await self._responses_store().get(response_id)
        if record is None:
            raise APIError(404, f"Response with id {response_id!r} not found.", "response_id",
                           "response_not_found")  # fmt: skip
        return record

    async def responses(self, req: ResponsesRequest) -> Any:
        check_request(req)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            record = await self._responses_store().get(req.previous_response_id)
            if record is None:  # OpenAI's error: the request is wrong, not the URL
                raise PreviousResponseNotFound(req.previous_response_id)
            history = record["input"] + record["response"]["output"]
        conversation = history + input_items(req.input)
        chat = chat_request(req, conversation, num_history=len(history))
        try:
            first, stream = await self.open_stream(req.model, chat_payload(chat))
        except APIError as exc:
            raise _renamed(exc, req) from exc
        # gpt-oss, whole too: read as it streams, an item per harmony message in their order.
        streamed = req.stream or first.reasoning_parser == GptOssReasoningParser.name
        completion = Completion(req.model, True, False, None, tools=tool_choice(chat),
                                stream=streamed)  # fmt: skip
        completion.absorb(first)
        builder = ResponseBuilder(req, req.tools)
        builder.input_tokens = first.prompt_tokens
        builder.temperature, builder.top_p = first.temperature, first.top_p
        headers = self._replica_headers()
        if req.stream:
            events = self._events(builder, completion, stream, conversation)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        in_order = completion.harmony
        try:
            async for item in guard_stream(stream, req.model):
                if isinstance(item, StreamError):
                    raise api_error(item)
                for chunk in completion.absorb(item):
                    if in_order:
                        builder.feed(chunk["delta"])
        finally:
            stream.cancel()
        choice = completion.whole()["choices"][0]
        builder.reasoning_tokens = completion.reasoning_tokens(completion.choices[0])
        builder.cached_tokens = completion.cached_tokens
        if in_order:
            builder.finish(choice["finish_reason"], completion.completion_tokens)
        else:
            builder.absorb_message(choice["message"], choice["finish_reason"],
                                   completion.completion_tokens)  # fmt: skip
        await self._keep(builder, conversation)
        return JSONResponse(builder.response(), headers=headers)

    async def _events(
        self,
        builder: ResponseBuilder,
        completion: Completion,
        stream: Any,
        conversation: list[dict[str, Any]],
    ) -> AsyncIterator[bytes]:
        try:
            for event in builder.start():
                yield sse_event(event)
            async for item in guard_stream(stream, builder.req.model):
                if isinstance(item, StreamError):
                    last = builder.fail(item.message, item.code)
                    break
                for chunk in completion.absorb(item):
                    for event in builder.feed(chunk["delta"]):
                        yield sse_event(event)
            else:
                choice = completion.choices[0]
                builder.reasoning_tokens = completion.reasoning_tokens(choice)
                builder.cached_tokens = completion.cached_tokens
                last = builder.finish(choice.finish_reason, completion.completion_tokens)
            # Kept before the last event goes out: a client may send the next turn at once.
            await self._keep(builder, conversation)
            for event in last:
                yield sse_event(event)
        except Exception:  # a fault shaping this response: its client is told
            logger.exception("a streamed response failed while being built")
            for event in builder.fail("the server failed while building this response"):
                yield sse_event(event)
        finally:
            stream.cancel()

    async def _keep(self, builder: ResponseBuilder, conversation: list[dict[str, Any]]) -> None:
        if not builder.req.store:
            return
        record = {"response": builder.response(), "input": conversation}
        try:
            await self._responses_store().put(builder.id, record)
        except ray.exceptions.RayError as exc:
            # The answer is still the client's; only a later previous_response_id / GET of it
            # will be a 404.
            logger.warning("response %s not stored: %s", builder.id, type(exc).__name__)

    async def get_response(self, response_id: str) -> Any:
        return (await self._stored(response_id))["response"]

    async def delete_response(self, response_id: str) -> Any:
        if not await self._responses_store().delete(response_id):
            raise APIError(404, f"Response with id {response_id!r} not found.", "response_id",
                           "response_not_found")  # fmt: skip
        return {"id": response_id, "object": "response", "deleted": True}


class PreviousResponseNotFound(APIError):
    """OpenAI's 404 for an unknown ``previous_response_id``: an ``invalid_request_error``."""

    def __init__(self, response_id: str) -> None:
        super().__init__(404, f"Previous response with id {response_id!r} not found.",
                         "previous_response_id", "previous_response_not_found")  # fmt: skip
        self.response_id = response_id

    def __reduce__(self) -> tuple[type[APIError], tuple[Any, ...]]:
        return (PreviousResponseNotFound, (self.response_id,))

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"]["type"] = "invalid_request_error"
        return body


# Chat-side parameter names -> the Responses request's (a prefix of ``param``).
_RENAMES = (
    ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
    ("tool_choice.function.name", "tool_choice.name"),
)  # fmt: skip
# A chat message's index is not its input item's (instructions come first): the whole input.
_INPUT = ("messages", "prompt")


def _renamed(exc: APIError, req: ResponsesRequest) -> APIError:
    """The server's 400 as the Responses request names the field."""
    param = exc.param or ""
    if param.split(".")[0] in _INPUT:
        return renamed(exc, ((param, "input"),))
    renames: tuple[tuple[str, str], ...] = _RENAMES
    fmt = req.text.format if req.text is not None else None
    # text.format's grammar (a forced call's is its tool's schema; text.format with
    # structured_outputs is a 400 before the server).
    forced = req.tool_choice not in (None, "none", "auto") and bool(req.tools)
    if fmt is not None and fmt.type == "json_schema" and not forced:
        renames += (("structured_outputs.json", "text.format.schema"),)
    out = renamed(exc, renames)
    if out.param == "max_output_tokens" and param != "max_output_tokens":
        # the engine's message names it more than once
        out = APIError(out.status, out.message.replace(param, "max_output_tokens"), out.param,
                       out.code, out.retry_after)  # fmt: skip
    return out


__all__ = [
    "INGRESS_REPLICA_HEADER",
    "PreviousResponseNotFound",
    "ResponsesServicer",
    "responses_store",
]
