"""The Responses API on the ingress (``POST /v1/responses``, ``GET`` / ``DELETE
/v1/responses/{id}``), mixed into ``OpenAIIngress``: the request becomes the chat request the
chat route serves (``cluster.api.responses_payloads``), its chat stream becomes output items
and events (``cluster.api.responses_builder``): sent as SSE, or, for a whole response, built
into the object they make, so both have the same items; the response is kept in the
application's store (``cluster.serving.responses_store``) that every ingress replica sees."""

from __future__ import annotations

import bisect
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi.responses import JSONResponse, StreamingResponse

from cluster.api.api_errors import APIError, api_error
from cluster.api.harmony import read_harmony
from cluster.api.openai_payloads import chat_payload, tool_choice
from cluster.api.openai_responses import Completion
from cluster.api.reasoning_parsers import THINK_END, THINK_START, GptOssReasoningParser
from cluster.api.replica_messages import StreamDelta, StreamError
from cluster.api.responses_builder import ResponseBuilder, sse_event
from cluster.api.responses_models import ResponsesRequest
from cluster.api.responses_payloads import chat_request, check_request, input_items
from cluster.serving.ingress_calls import guard_stream
from cluster.serving.responses_store import StoreClient, StoreLimits
from engine.harmony_template import CALL, END, MESSAGE, RETURN, START

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
        chat = chat_request(req, conversation)
        # Read as a stream either way: a whole response is the one its events build, so both
        # have the same output items, in the order the model wrote them.
        completion = Completion(req.model, True, False, None, tools=tool_choice(chat),
                                stream=True)  # fmt: skip
        try:
            first, stream = await self.open_stream(req.model, chat_payload(chat))
        except APIError as exc:
            raise _renamed(exc, req) from exc
        completion.absorb(first)
        builder = ResponseBuilder(req, req.tools)
        builder.input_tokens = first.prompt_tokens
        headers = self._replica_headers()
        read = _ResponseRead(builder, completion, stream)
        if req.stream:
            events = self._sse(read, conversation)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            async for _ in read.events():
                pass
            read.finish()
        finally:
            stream.cancel()
        await self._keep(builder, conversation)
        return JSONResponse(builder.response(), headers=headers)

    async def _sse(
        self, read: _ResponseRead, conversation: list[dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        """The events as SSE; a server error ends them with ``error`` and ``response.failed``."""
        builder = read.builder
        try:
            try:
                async for event in read.events():
                    yield sse_event(event)
                last = read.finish()
            except APIError as exc:
                last = builder.fail(exc.message, exc.code)
            # Kept before the last event goes out: a client may send the next turn at once.
            await self._keep(builder, conversation)
            for event in last:
                yield sse_event(event)
        finally:
            read.stream.cancel()

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


class _ResponseRead:
    """One response read from the server's stream: ``events`` (all but the last; a server
    error raises its ``APIError``), then ``finish`` (the closing events, usage counted)."""

    def __init__(self, builder: ResponseBuilder, completion: Completion, stream: Any) -> None:
        self.builder, self.completion, self.stream = builder, completion, stream
        self.marks = TokenMarks()

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        builder, completion = self.builder, self.completion
        for event in builder.start():
            yield event
        async for item in guard_stream(self.stream, builder.req.model):
            if isinstance(item, StreamError):
                raise api_error(item)
            self.marks.add(item)
            for chunk in completion.absorb(item):
                for event in builder.feed(chunk["delta"]):
                    yield event

    def finish(self) -> list[dict[str, Any]]:
        completion, builder = self.completion, self.builder
        choice = completion.choices[0]
        # Held forced calls: the whole output's message says if they are calls.
        whole = completion.whole()["choices"][0]["message"] if builder.holds_calls else None
        builder.reasoning_tokens = self.marks.reasoning_tokens(completion)
        return builder.finish(choice.finish_reason, completion.completion_tokens, whole)


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


class TokenMarks:
    """The first choice's text length and token count after each delta (O(1) a delta): which
    tokens wrote its reasoning. A count is exact when each delta adds one token; a delta of
    several (speculative decoding) counts as a whole on the side its text ends."""

    def __init__(self) -> None:
        self.chars: list[int] = []
        self.tokens: list[int] = []

    def add(self, item: Any) -> None:
        if not isinstance(item, StreamDelta):
            return
        for delta in item.choices:
            if delta.index == 0:
                self.chars.append((self.chars[-1] if self.chars else 0) + len(delta.text))
                self.tokens.append(delta.num_tokens)

    def reasoning_tokens(self, completion: Completion) -> int:
        """``usage.output_tokens_details.reasoning_tokens``: as vLLM counts them, the tokens
        between the think tags (to the end when cut off inside); for gpt-oss (harmony), the
        tokens of its analysis messages' text."""
        parser = completion.reasoning_parser
        if parser is None or not completion.choices:
            return 0
        text = completion.choices[0].text
        if isinstance(parser, GptOssReasoningParser):
            return sum(self._tokens_at(end) - self._tokens_at(start, first=True)
                       for start, end in analysis_spans(text))  # fmt: skip
        in_reasoning = completion.in_reasoning
        if parser.extract(text, in_reasoning=in_reasoning)[0] is None:
            return 0
        if in_reasoning is None:
            in_reasoning = parser.starts_in_reasoning
        start = 0 if in_reasoning else text.find(THINK_START) + len(THINK_START)
        end = text.find(THINK_END, start)
        return self._tokens_at(len(text) if end < 0 else end) - self._tokens_at(start)

    def _tokens_at(self, chars: int, first: bool = False) -> int:
        """The tokens whose text ends at or before character ``chars``; ``first``: only up to
        the first delta that reaches it (the tokens after it that wrote no text yet, the start
        of a character, are the next text's)."""
        i = (bisect.bisect_left if first else bisect.bisect_right)(self.chars, chars)
        if first and i < len(self.chars) and self.chars[i] == chars:
            return self.tokens[i]
        return self.tokens[i - 1] if i else 0


# Where a harmony message's text ends (a <|start|> without an <|end|> before it too): the
# output is cut into messages after each end, before each start.
_MESSAGE_CUTS = re.compile(
    "|".join(re.escape(token) for token in (END, RETURN, CALL)) + f"|(?={re.escape(START)})"
)


def analysis_spans(text: str) -> list[tuple[int, int]]:
    """The ``(start, end)`` characters of the text of each analysis message in a harmony
    output: its header, ``<|message|>`` and its end token left out. Each message is read
    alone by the harmony reader, which says whether its text is reasoning (the whole text
    then, which starts after the header's ``<|message|>``); text between messages, which no
    ``<|start|>`` opens, is outside every message."""
    spans = []
    at = 0
    for cut in [*_MESSAGE_CUTS.finditer(text), None]:
        end = len(text) if cut is None else cut.end()
        message, start, at = text[at:end], at, end
        if not message or (start > 0 and not message.startswith(START)):
            continue
        reasoning = [p.text for p in read_harmony(message) if p.kind == "reasoning"]
        if reasoning:
            body = start + message.index(MESSAGE) + len(MESSAGE)
            spans.append((body, body + len("".join(reasoning))))
    return spans


# Chat-side parameter names -> the Responses request's (a prefix of ``param``).
_RENAMES = (
    ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
    ("messages", "input"), ("prompt", "input"),
)  # fmt: skip


def _renamed(exc: APIError, req: ResponsesRequest) -> APIError:
    """The server's 400 as the Responses request names the field."""
    param = exc.param or ""
    renames: tuple[tuple[str, str], ...] = _RENAMES
    fmt = req.text.format if req.text is not None else None
    # text.format's grammar (a forced call's is its tool's schema; text.format with
    # structured_outputs is a 400 before the server).
    forced = req.tool_choice not in (None, "none", "auto") and bool(req.tools)
    if fmt is not None and fmt.type == "json_schema" and not forced:
        renames += (("structured_outputs.json", "text.format.schema"),)
    for chat_name, name in renames:
        if param == chat_name or param.startswith(f"{chat_name}."):
            # A chat message's index is not its input item's (instructions come first).
            new_param = name if name == "input" else name + param[len(chat_name) :]
            break
    else:
        return exc
    message = exc.message
    if message.startswith(f"{param}:"):
        message = new_param + message[len(param) :]
    if name == "max_output_tokens":  # the engine's message names it more than once
        message = message.replace(chat_name, name)
    return APIError(exc.status, message, new_param, exc.code, exc.retry_after)


__all__ = [
    "INGRESS_REPLICA_HEADER",
    "PreviousResponseNotFound",
    "ResponsesServicer",
    "TokenMarks",
    "analysis_spans",
    "responses_store",
]
