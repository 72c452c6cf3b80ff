"""Anthropic's Messages API on the ingress (``POST /v1/messages``, ``POST
/v1/messages/count_tokens``), mixed into ``OpenAIIngress``: the request becomes the chat request
the chat route serves (``cluster.api.anthropic_payloads``), its chat stream becomes the
message's events (``cluster.api.anthropic_builder``): sent as SSE, or, for a whole reply, built
into the message they make, so both have the same blocks. Errors take Anthropic's shape
(``cluster.api.api_errors``: the route decides)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi.responses import JSONResponse, StreamingResponse

from cluster.api.anthropic_builder import MessageBuilder
from cluster.api.anthropic_models import CountTokensRequest, MessagesRequest
from cluster.api.anthropic_payloads import chat_request, template_kwargs
from cluster.api.api_errors import APIError, api_error, renamed
from cluster.api.openai_payloads import chat_payload, tool_choice
from cluster.api.openai_responses import Completion
from cluster.api.replica_messages import GenerateRequest, StreamError
from cluster.api.responses_builder import sse_event
from cluster.serving.ingress_calls import call_replica, guard_stream

logger = logging.getLogger("llm_cluster.serve")

# A generation the replica ended early (shut down past its drain): no message to give.
_ABORTED = (503, "the server stopped the generation; retry the request", "unavailable")


# The chat route's names of the fields the Messages API names otherwise, for its 400s.
_RENAMES = (("tool_choice.function.name", "tool_choice.name"), ("stop", "stop_sequences"))


def messages_payload(req: CountTokensRequest) -> tuple[GenerateRequest, Any]:
    """The server request for ``req`` and the chat request it came from."""
    chat = chat_request(req)
    try:
        payload = chat_payload(chat)
    except APIError as exc:
        raise renamed(exc, _RENAMES) from exc
    kwargs = template_kwargs(req)
    if kwargs is not None:  # thinking: a template variable; the request's own kwargs win
        merged = {
            **(payload.chat_template_kwargs or {}),
            **kwargs,
            **(chat.chat_template_kwargs or {}),
        }
        payload = msgspec.structs.replace(payload, chat_template_kwargs=merged)
    return payload, chat


class MessagesServicer:
    """The Messages routes over ``open_stream`` and ``_route`` (``OpenAIIngress``'s, which
    mixes this in)."""

    open_stream: Any
    _route: Any
    _with_image_data: Any

    async def messages(self, req: MessagesRequest) -> Any:
        payload, chat = messages_payload(req)
        tools = tool_choice(chat)
        # Read as a stream either way: a whole reply is the message its events build.
        completion = Completion(req.model, True, False, None, tools=tools, stream=True)
        try:
            first, stream = await self.open_stream(req.model, payload)
        except APIError as exc:
            raise renamed(exc, _RENAMES) from exc
        completion.absorb(first)
        builder = MessageBuilder(req.model, req.stop_sequences or ())
        builder.input_tokens = first.prompt_tokens
        events = _message_events(builder, completion, stream, req.model)
        if req.stream:
            return StreamingResponse(_sse(builder, events, stream),
                                     media_type="text/event-stream")  # fmt: skip
        try:
            async for _ in events:
                pass
        finally:
            stream.cancel()
        return JSONResponse(builder.message())

    async def count_message_tokens(self, req: CountTokensRequest) -> Any:
        """The prompt's token count as the chat template renders it, tools included."""
        payload, _ = messages_payload(req)
        payload = await self._with_image_data(payload)
        handle, adapter = self._route(req.model)  # (its server 404s an adapter it lacks)
        payload = msgspec.structs.replace(payload, adapter=adapter)
        result = await call_replica(req.model, handle.tokenize.remote(payload))
        if isinstance(result, StreamError):
            raise api_error(result)
        return {"input_tokens": result.count}


async def _message_events(
    builder: MessageBuilder, completion: Completion, stream: Any, model: str
) -> AsyncIterator[dict[str, Any]]:
    """The message's events from the server's stream; a server error or an aborted
    generation raises its ``APIError``."""
    for event in builder.start():
        yield event
    async for item in guard_stream(stream, model):
        if isinstance(item, StreamError):
            raise api_error(item)
        for chunk in completion.absorb(item):
            for event in builder.feed(chunk["delta"]):
                yield event
    choice = completion.choices[0]
    if choice.finish_reason == "abort":
        raise APIError(_ABORTED[0], _ABORTED[1], None, _ABORTED[2])
    if completion.prompt_tokens_details:
        builder.cache_read_input_tokens = completion.cached_tokens
    for event in builder.finish(choice.finish_reason, choice.stop_reason,
                                completion.completion_tokens):  # fmt: skip
        yield event


async def _sse(
    builder: MessageBuilder, events: AsyncIterator[dict[str, Any]], stream: Any
) -> AsyncIterator[bytes]:
    """The events as SSE; an error ends the stream with Anthropic's ``error`` event."""
    try:
        try:
            async for event in events:
                yield sse_event(event)
        except APIError as exc:
            for event in builder.fail(exc.status, exc.message, exc.code):
                yield sse_event(event)
        except Exception:  # a fault shaping this response: its client is told
            logger.exception("a streamed message failed while being built")
            for event in builder.fail(500, "the server failed while building this response"):
                yield sse_event(event)
    finally:
        stream.cancel()


__all__ = ["MessagesServicer", "messages_payload"]
