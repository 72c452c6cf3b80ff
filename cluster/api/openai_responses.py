"""The replica's stream items -> OpenAI responses: a whole ``completion`` / ``chat.completion``
or its SSE chunks, with logprobs in OpenAI's shapes."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from cluster.api.api_errors import error_body
from cluster.api.forced_tool_calls import (
    NamedToolCallStreamer,
    RequiredToolCallStreamer,
    parse_named_tool_call,
    parse_required_tool_calls,
)
from cluster.api.openai_payloads import ToolChoice
from cluster.api.reasoning_parsers import (
    GptOssReasoningParser,
    ReasoningParser,
    ReasoningStreamer,
    get_reasoning_parser,
)
from cluster.api.reasoning_tokens import ReasoningMarks
from cluster.api.replica_messages import (
    StreamDelta,
    StreamError,
    StreamItem,
    StreamStart,
    TokenLogprobs,
    logprob_rows,
)
from cluster.api.tool_calls import ParsedToolCalls, ToolCallStreamer, ToolParser
from cluster.api.tool_parsers import HarmonyStreamer, get_tool_parser, parse_harmony
from engine.client.core_messages import ChoiceDelta

logger = logging.getLogger("llm_cluster.serve")


class _Choice:
    """One choice of a response as it accumulates."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.finish_reason: str | None = None
        # The stop string or stop token id that ended it (vLLM's ``stop_reason``).
        self.stop_reason: int | str | None = None
        self.num_tokens = 0
        self.prompt_tokens = 0  # its prompt's (a completions request may have several)
        self.text_offset = 0  # where the next token starts in the text (completions logprobs)
        self.logprobs: Any = None  # completions: the OpenAI dict; chat: the content list
        self.prompt_logprobs: PromptLogprobsJSON | None = None  # completions: vLLM's, its prompt's
        self.started = False
        self.tool_streamer: ToolCallStreamer | None = None  # a streamed chat with tools
        self.tool_text = ""  # the text it was fed
        self.reasoning: ReasoningStreamer | None = None  # a streamed chat, reasoning model
        self.marks: ReasoningMarks | None = None  # a reasoning model's chat: for usage


class Completion:
    """Turns the server's stream of items into OpenAI responses (whole or as SSE chunks).
    ``top_logprobs`` is the number of alternatives a chat request asked for, or the ``logprobs``
    of a completions request; None when it asked for no logprobs.

    A completions request may carry several prompts, each its own server stream: items of
    prompt i are absorbed with ``prompt_index=i`` and its sample j is choice ``i * n + j``.
    ``echo`` puts each prompt (and its logprobs) before the generated text; ``echo_only`` (echo
    with ``max_tokens`` 0) leaves the generated token out. ``continuous_usage`` (vLLM's
    ``stream_options.continuous_usage_stats``) puts each chunk's choice's usage so far in it.
    ``include_reasoning`` False (vLLM's chat field) leaves a reasoning model's reasoning out of
    the message and the deltas, and its logprobs with it (their tokens would show it).
    ``chat_echo`` (vLLM's chat ``echo``: ``openai_payloads.chat_echo``) starts every chat
    choice's content, a stream's first delta of each choice."""

    def __init__(
        self,
        model: str,
        chat: bool,
        include_usage: bool,
        top_logprobs: int | None = None,
        *,
        echo: bool = False,
        echo_only: bool = False,
        tools: ToolChoice | None = None,
        stream: bool = False,
        continuous_usage: bool = False,
        include_reasoning: bool = True,
        chat_echo: str = "",
    ) -> None:
        self.model, self.chat, self.include_usage = model, chat, include_usage
        self.continuous_usage = continuous_usage
        self.top_logprobs = top_logprobs
        self.echo, self.echo_only = echo, echo_only
        self.tools, self.stream = tools, stream
        self.include_reasoning = include_reasoning
        self.chat_echo = chat_echo
        self.tool_call_parser: str | None = None
        # A chat served with a reasoning_parser: think blocks become its reasoning fields.
        self.reasoning_parser: ReasoningParser | None = None
        self.in_reasoning: bool | None = None
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = 0
        # Each prompt's tokens read from the prefix cache, as its last delta says; in usage when
        # the model reports them.
        self._cached: dict[int, int] = {}
        self.prompt_tokens_details = False
        # A chat request's prompt logprobs (vLLM's response field), when it asked for them.
        self.prompt_logprobs: PromptLogprobsJSON | None = None
        self.choices: list[_Choice] = []
        self._n = 1

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        return sum(self._cached.values())

    @property
    def usage(self) -> dict[str, Any]:
        """As vLLM's: with a reasoning model's chat, ``completion_tokens_details`` too; with a
        model's ``enable_prompt_tokens_details``, ``prompt_tokens_details``."""
        total = self.prompt_tokens + self.completion_tokens
        usage: dict[str, Any] = {"prompt_tokens": self.prompt_tokens,
                                 "completion_tokens": self.completion_tokens,
                                 "total_tokens": total}  # fmt: skip
        if self.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if self.reasoning_parser is not None:
            reasoning = sum(self.reasoning_tokens(c) for c in self.choices)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    def reasoning_tokens(self, choice: _Choice) -> int:
        """The tokens of the choice's reasoning, as vLLM counts them (``ReasoningMarks``)."""
        if self.reasoning_parser is None or choice.marks is None:
            return 0
        return choice.marks.count(self.reasoning_parser, choice.text, self.in_reasoning)

    def absorb(
        self, item: StreamStart | StreamDelta, prompt_index: int = 0
    ) -> list[dict[str, Any]]:
        """Take in a server item; returns the chunk choices it makes for a stream (a choice's
        first delta, and every delta with text, tokens, logprobs or its finish; with echo, each
        choice's prompt when its stream starts)."""
        if isinstance(item, StreamStart):
            return self._start(item, prompt_index)
        self._cached[prompt_index] = item.num_cached_tokens
        first = prompt_index * self._n
        return [c for d in item.choices for c in self._absorb_choice(d, first)]

    def _start(self, item: StreamStart, prompt_index: int) -> list[dict[str, Any]]:
        self._n = item.n
        self.prompt_tokens += item.prompt_tokens
        self.prompt_tokens_details = item.prompt_tokens_details
        self.tool_call_parser = item.tool_call_parser
        if self.chat and item.reasoning_parser is not None:
            self.reasoning_parser = get_reasoning_parser(item.reasoning_parser)
            self.in_reasoning = item.in_reasoning
        first = prompt_index * item.n
        while len(self.choices) < first + item.n:
            choice = _Choice(len(self.choices))
            choice.prompt_tokens = item.prompt_tokens
            if self.reasoning_parser is not None:
                choice.marks = ReasoningMarks()
            if self.stream and self.harmony:
                choice.tool_streamer = HarmonyStreamer(
                    reasoning=self.include_reasoning, read_calls=self._auto
                )
            elif self.stream:
                if self.tools is not None:
                    choice.tool_streamer = tool_streamer(self.tools, item.tool_call_parser)
                if self._splits_reasoning:
                    parser = self.reasoning_parser
                    assert parser is not None  # _splits_reasoning says so
                    choice.reasoning = parser.streamer(in_reasoning=self.in_reasoning)
            self.choices.append(choice)
        if item.prompt_logprobs is not None:
            prompt_logprobs = vllm_prompt_logprobs(item.prompt_logprobs)
            if self.chat:
                self.prompt_logprobs = prompt_logprobs
            for choice in self.choices[first : first + item.n]:
                choice.prompt_logprobs = prompt_logprobs
        if self.chat_echo and self.stream:
            for choice in self.choices[first : first + item.n]:
                choice.started = True
            return [{"index": choice.index, "logprobs": None, "finish_reason": None,
                     "delta": {"role": "assistant", "content": self.chat_echo}}
                    for choice in self.choices[first : first + item.n]]  # fmt: skip
        if not self.echo:
            return []
        chunks = []
        for choice in self.choices[first : first + item.n]:
            choice.started = True
            choice.text = item.prompt_text or ""
            logprobs = None
            if item.prompt_logprobs is not None and self.top_logprobs is not None:
                # As vLLM: the sampled token and the top ``logprobs`` of each prompt token,
                # however many alternatives prompt_logprobs asked for.
                rows = [row[: self.top_logprobs + 1] for row in item.prompt_logprobs]
                logprobs = self._logprobs(choice, rows)
            chunks.append({"index": choice.index, "text": choice.text, "logprobs": logprobs,
                           "finish_reason": None})  # fmt: skip
        return chunks

    @property
    def harmony(self) -> bool:
        """A gpt-oss chat (``openai_gptoss``): one reader takes reasoning, content and calls out
        of its harmony channels (vLLM's harmony path). A call the API forces is JSON from the
        output's first token, read as other models' are, with no reasoning."""
        harmony = isinstance(self.reasoning_parser, GptOssReasoningParser)
        return harmony and (self.tools is None or self.tools.mode == "auto")

    @property
    def _auto(self) -> bool:
        return self.tools is not None and self.tools.mode == "auto"

    @property
    def _hides_reasoning(self) -> bool:
        """A reasoning model's chat that asked for no reasoning (``include_reasoning`` False)."""
        return self.reasoning_parser is not None and not self.include_reasoning

    @property
    def _splits_reasoning(self) -> bool:
        """The answer is split from a think block before anything else reads it."""
        parser = self.reasoning_parser
        return parser is not None and not isinstance(parser, GptOssReasoningParser)

    def _absorb_choice(self, delta: ChoiceDelta, first_index: int = 0) -> list[dict[str, Any]]:
        choice = self.choices[first_index + delta.index]
        first, choice.started = not choice.started, True
        # "stop", "length", or (as vLLM sends it) "abort": the replica shut down past its drain.
        finish = delta.finish_reason
        if self.echo_only:  # max_tokens 0: the one token the engine sampled is not returned
            if finish is None:
                return []
            choice.finish_reason = "length" if finish != "abort" else finish
            return [{"index": choice.index, "text": "", "logprobs": None,
                     "finish_reason": choice.finish_reason}]  # fmt: skip
        choice.text += delta.text
        choice.num_tokens = delta.num_tokens
        if choice.marks is not None:
            choice.marks.add(delta.text, delta.num_tokens)
        if finish is not None:
            choice.finish_reason, choice.stop_reason = finish, delta.stop_reason
        rows = None if delta.logprobs is None else [logprob_rows(e) for e in delta.logprobs]
        logprobs = self._logprobs(choice, rows)
        reasoning, text = "", delta.text
        if choice.reasoning is not None:  # tools and the content deltas see the answer only
            reasoning, text = _split_reasoning(choice.reasoning, text, finish is not None)
        if self._hides_reasoning:
            reasoning = ""
        if choice.tool_streamer is not None:
            return self._tool_chunks(choice, choice.tool_streamer, text, first, logprobs,
                                     reasoning)  # fmt: skip
        # As vLLM does: a step that produced tokens is a chunk even when their text is empty
        # (an incomplete character, a special token), so clients see steady token timing.
        if not (first or delta.text or delta.token_ids or finish or logprobs):
            return []
        if self._hides_reasoning and not (first or text or finish):
            return []  # a step of hidden reasoning only (vLLM sends none either)
        if self.chat:
            content: dict[str, Any] = {"content": text}
            if reasoning:
                content = {**_reasoning(reasoning), **({"content": text} if text else {})}
            if first:
                content = {"role": "assistant", **content}
            chat_lp = {"content": logprobs} if logprobs is not None else None
            return [{"index": choice.index, "delta": content, "logprobs": chat_lp,
                     "finish_reason": finish}]  # fmt: skip
        return [{"index": choice.index, "text": delta.text, "logprobs": logprobs,
                 "finish_reason": finish}]  # fmt: skip

    def _tool_chunks(
        self,
        choice: _Choice,
        streamer: ToolCallStreamer,
        text: str,
        first: bool,
        logprobs: Any,
        reasoning: str = "",
    ) -> list[dict[str, Any]]:
        """A streamed chat choice with tools: its text through the tool-call streamer, as
        content and ``tool_calls`` deltas (text that may open a call is held back); its
        ``reasoning`` (a reasoning model's) as a reasoning delta before them. A forced call
        (``required``, named) is held back until the output ends, as the Responses and
        Messages streams hold it: one whose JSON did not end (cut off by ``max_tokens``) is
        then its text as content, no call, as in the whole response."""
        choice.tool_text += text
        if self.tools is not None and self.tools.mode != "auto":
            deltas = []
            if choice.finish_reason is not None:
                if self._forced_call_cut_off(choice.finish_reason, choice.tool_text):
                    deltas = [{"content": choice.tool_text}] if choice.tool_text else []
                else:
                    deltas = streamer.feed(choice.tool_text) + streamer.finish()
        else:
            deltas = streamer.feed(text) if text else []
            if choice.finish_reason is not None:
                deltas += streamer.finish()
        if choice.finish_reason is not None:
            choice.finish_reason = self._tool_finish(choice.finish_reason, streamer.tools_called)
        if self.tools is not None and not self.tools.parallel:
            deltas = _first_call_only(deltas)
        # A harmony streamer's analysis channel comes as reasoning_content deltas.
        deltas = [{**d, **_reasoning(d["reasoning_content"])} if "reasoning_content" in d else d
                  for d in deltas]  # fmt: skip
        if reasoning:
            deltas = [_reasoning(reasoning), *deltas]
        if first:
            deltas = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}] + (
                deltas[1:]
            )
        if not deltas and (choice.finish_reason is not None or logprobs is not None):
            # A step whose text the streamer holds back (a harmony header, a tag that may open
            # a call) still sends its tokens' logprobs, as vLLM does: the stream's add up to
            # the whole response's.
            deltas = [{}]
        chunks = [{"index": choice.index, "delta": d, "logprobs": None, "finish_reason": None}
                  for d in deltas]  # fmt: skip
        if chunks and logprobs is not None:
            chunks[0]["logprobs"] = {"content": logprobs}
        if chunks and choice.finish_reason is not None:
            chunks[-1]["finish_reason"] = choice.finish_reason
        return chunks

    def _forced_call_cut_off(self, finish: str | None, text: str) -> bool:
        """A forced call (``required``, named) whose output is not one whole JSON value (cut off
        by ``max_tokens``, a stop string or an abort): it is no call, and its text is returned as
        content (vLLM returns what was generated), never dropped."""
        if self.tools is None or self.tools.mode == "auto" or finish is None:
            return False
        try:
            json.loads(text)
        except (ValueError, RecursionError):
            return True
        return False

    def _tool_finish(self, finish: str, tools_called: bool) -> str:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required); a call forced
        by name ends with "stop"."""
        named = self.tools is not None and self.tools.mode == "named"
        return "tool_calls" if finish == "stop" and tools_called and not named else finish

    def _logprobs(self, choice: _Choice, entries: list[TokenLogprobs] | None) -> Any:
        """The OpenAI logprobs of new tokens (their rows: ``logprob_rows``, or the echoed
        prompt's from ``StreamStart``), also appended to the choice's."""
        if self.top_logprobs is None or entries is None or self._hides_reasoning:
            return None
        if self.chat:
            new = chat_logprobs(entries, self.top_logprobs)
            choice.logprobs = (choice.logprobs or []) + new
            return new
        new = completion_logprobs(entries, choice.text_offset)
        choice.text_offset += sum(len(t) for t in new["tokens"])
        whole = choice.logprobs or {k: [] for k in new}
        choice.logprobs = {k: whole[k] + new[k] for k in new}
        return new

    def whole(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            if self.chat:
                wanted = self.top_logprobs is not None and not self._hides_reasoning
                logprobs = {"content": c.logprobs or []} if wanted else None
                message, finish = self._message(c)
                choices.append({"index": c.index, "logprobs": logprobs, "message": message,
                                "finish_reason": finish, "stop_reason": c.stop_reason})  # fmt: skip
            else:
                logprobs = c.logprobs
                if logprobs is None and self.top_logprobs is not None:
                    logprobs = completion_logprobs([])
                choices.append({"index": c.index, "text": c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                "prompt_logprobs": c.prompt_logprobs})  # fmt: skip
        whole = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": choices,
                 "usage": self.usage}  # fmt: skip
        if self.chat:  # vLLM's: on the response, each choice has the same prompt
            whole["prompt_logprobs"] = self.prompt_logprobs
        return whole

    def _message(self, choice: _Choice) -> tuple[dict[str, Any], str | None]:
        """A whole chat choice's message and finish reason, tool calls read out of its text
        (out of its answer: a reasoning model's think block is its ``reasoning_content``)."""
        reasoning, parsed = self._read(choice.text, choice.finish_reason)
        content = self.chat_echo + (parsed.content or "") if self.chat_echo else parsed.content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning_parser is not None and self.include_reasoning:
            message.update(_reasoning(reasoning))
        parallel = self.tools is None or self.tools.parallel
        calls = parsed.tool_calls if parallel else parsed.tool_calls[:1]
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        finish = choice.finish_reason
        if finish is not None:
            finish = self._tool_finish(finish, bool(calls))
        return message, finish

    def _read(self, text: str, finish: str | None) -> tuple[str | None, ParsedToolCalls]:
        """A whole chat choice's reasoning, content and tool calls."""
        if self.harmony:
            return parse_harmony(text, read_calls=self._auto)
        reasoning: str | None = None
        answer: str | None = text
        if self.reasoning_parser is not None and self._splits_reasoning:
            reasoning, answer = self.reasoning_parser.extract(text, in_reasoning=self.in_reasoning)
        if self.tools is None:
            return reasoning, ParsedToolCalls(answer, [])
        if self._forced_call_cut_off(finish, answer or ""):
            return reasoning, ParsedToolCalls(answer or None, [])
        return reasoning, parse_tool_calls(self.tools, self.tool_call_parser, answer or "")

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        """The SSE chunk of one choice delta: the choice's ``stop_reason`` (vLLM's) with its
        finish, and with ``continuous_usage`` its usage so far."""
        state = self.choices[choice["index"]]
        stop_reason = state.stop_reason if choice.get("finish_reason") is not None else None
        envelope = self._chunk_envelope([{**choice, "stop_reason": stop_reason}])
        if self.continuous_usage:
            done = state.num_tokens
            envelope["usage"] = {"prompt_tokens": state.prompt_tokens, "completion_tokens": done,
                                 "total_tokens": state.prompt_tokens + done}  # fmt: skip
            if self.reasoning_parser is not None:
                reasoning = self.reasoning_tokens(state)
                envelope["usage"]["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return envelope

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._chunk_envelope([]), "usage": self.usage}

    def _chunk_envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        envelope = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                    "choices": choices}  # fmt: skip
        if self.include_usage:
            envelope["usage"] = None
        return envelope


def _split_reasoning(streamer: ReasoningStreamer, text: str, finished: bool) -> tuple[str, str]:
    """A streamed delta's (reasoning, content); the choice's last one flushes what the
    streamer held back (an unfinished tag)."""
    reasoning, content = streamer.feed(text) if text else ("", "")
    if finished:
        r, c = streamer.finish()
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def tool_streamer(tools: ToolChoice, parser: str | None) -> ToolCallStreamer:
    if tools.mode == "named":
        return NamedToolCallStreamer(tools.name or "")
    if tools.mode == "required":
        return RequiredToolCallStreamer()
    return _auto_parser(tools, parser).streamer()


def parse_tool_calls(tools: ToolChoice, parser: str | None, text: str) -> ParsedToolCalls:
    if tools.mode == "named":
        return parse_named_tool_call(tools.name or "", text)
    if tools.mode == "required":
        return parse_required_tool_calls(text)
    return _auto_parser(tools, parser).parse(text)


def _auto_parser(tools: ToolChoice, parser: str | None) -> ToolParser:
    """The ``tool_call_parser`` for a request's tools (their parameters' schemas)."""
    return get_tool_parser(parser or "", tools.parameter_schemas)


def _first_call_only(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``parallel_tool_calls: false``: the deltas of calls after the first are dropped."""
    kept = []
    for delta in deltas:
        calls = [c for c in delta.get("tool_calls", ()) if c["index"] == 0]
        if "tool_calls" not in delta:
            kept.append(delta)
        elif calls:
            kept.append({**delta, "tool_calls": calls})
    return kept


# JSON has no -inf: a token the model rules out entirely gets this floor (as vLLM does).
_MIN_LOGPROB = -9999.0


def completion_logprobs(entries: list[Any], text_offset: int = 0) -> dict[str, list[Any]]:
    """OpenAI completions logprobs of tokens whose server entries (per token: ``[token_id, text,
    logprob, rank]`` rows, the sampled token first, then the top-k) are ``entries``;
    ``top_logprobs`` maps text -> logprob over the sampled token and the top-k (at most k + 1;
    tokens with the same text keep the higher logprob)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for rows in entries:
        _, text, logprob, _ = rows[0]
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if logprob is None:  # a prompt's first token: nothing before it to score it
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(max(logprob, _MIN_LOGPROB))
        top: dict[str, float] = {}
        for _, alt, alt_logprob, _ in rows:
            top[alt] = max(top.get(alt, _MIN_LOGPROB), alt_logprob)
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}  # fmt: skip


# vLLM's ``prompt_logprobs``: None for the first prompt token (nothing before it scores it),
# then per token: token id -> {logprob, rank, decoded_token}, the prompt's token first.
PromptLogprobsJSON = list[dict[str, dict[str, Any]] | None]


def vllm_prompt_logprobs(entries: list[TokenLogprobs]) -> PromptLogprobsJSON:
    """vLLM's ``prompt_logprobs`` of a prompt whose server entries (``StreamStart``'s) are
    ``entries``."""
    return [None] + [
        {str(token): {"logprob": max(logprob, _MIN_LOGPROB), "rank": rank, "decoded_token": text}
         for token, text, logprob, rank in rows}
        for rows in entries[1:]
    ]  # fmt: skip


def chat_logprobs(entries: list[Any], top_k: int) -> list[dict[str, Any]]:
    """OpenAI chat ``logprobs.content`` of tokens with server entries ``entries`` (as in
    ``completion_logprobs``): each sampled token with its ``top_k`` most likely alternatives."""

    def token(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": max(logprob, _MIN_LOGPROB),
                "bytes": list(text.encode())}  # fmt: skip

    content = []
    for rows in entries:
        _, text, logprob, _ = rows[0]
        # The rows are the top-k plus the sampled token (which may rank below them): the k most
        # likely rows are the top-k, whether or not the sampled token is among them.
        best = sorted(rows, key=lambda row: -row[2])[:top_k]
        content.append({**token(text, logprob), "top_logprobs": [token(r[1], r[2]) for r in best]})
    return content


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def stream_sse(
    completion: Completion,
    items: AsyncIterator[tuple[int, StreamItem]],
    on_close: Callable[[], None],
    first_chunks: Sequence[dict[str, Any]] = (),
) -> AsyncIterator[bytes]:
    """SSE chunks for the rest of the streams whose "start" items were already absorbed: one
    chunk per choice delta, its ``choices[0].index`` saying which choice. ``items`` yields
    ``(prompt_index, item)`` pairs (several prompts' streams merged)."""
    try:
        for choice in first_chunks:
            yield sse(completion.chunk(choice))
        async for prompt_index, item in items:
            if isinstance(item, StreamError):
                yield sse(error_body(item.status, item.message, item.param))
                break
            for choice in completion.absorb(item, prompt_index):
                yield sse(completion.chunk(choice))
        if completion.include_usage:
            yield sse(completion.usage_chunk())
        yield sse("[DONE]")
    except Exception:  # a fault shaping this response: its client is told, the stream ends
        logger.exception("a streamed response failed while being built")
        yield sse(error_body(500, "the server failed while building this response", None))
        yield sse("[DONE]")
    finally:
        on_close()


def _reasoning(text: str | None) -> dict[str, str | None]:
    """A message's or delta's reasoning under both of its names: ``reasoning`` (vLLM 0.32's,
    which clients written for it read) and ``reasoning_content`` (DeepSeek's API's, SGLang's and
    earlier vLLM's)."""
    return {"reasoning": text, "reasoning_content": text}
