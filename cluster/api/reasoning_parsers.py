"""Reasoning parsers (vLLM's ``reasoning_parser``): split a reasoning model's output into its
reasoning (``reasoning_content`` in chat, reasoning items in Responses) and its answer.

The parsers read ``<think>…</think>`` blocks and differ in where the output starts (each
class says how): ``deepseek_r1`` (the template opens ``<think>`` in the prompt), ``qwen3`` and
``glm45`` (the model writes ``<think>`` itself), ``deepseek_v3`` and ``kimi_k2`` (thinking on or
off by the request's ``chat_template_kwargs``: on, the output starts in reasoning; off, it is all
content), and ``openai_gptoss`` (harmony messages, ``cluster.api.harmony``: the analysis channel
is the reasoning). Either way, a prompt whose last think tag is ``</think>``
(``enable_thinking=False`` renders ``<think>\\n\\n</think>\\n\\n``) has ended the reasoning.

One state machine (``ReasoningStreamer``) serves both modes, so a streamed response's deltas
always add up to the non-streamed split: ``extract(text)`` is ``feed(text)`` then
``finish()``. vLLM's non-streamed ``qwen3`` returns a ``<think>`` without its ``</think>``
(output cut off mid-reasoning) as content while its stream sends it as reasoning; here both
say reasoning.

The tags are single tokens in the tokenizers of these models (added tokens that decoding keeps):
``think_token_ids`` finds them, and the engine starts a structured output's grammar once the
``</think>`` token is sampled (``StructuredOutputsParams.reasoning_end_token_id``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cluster.api.harmony import HARMONY_TOKENS, HarmonyReader, Piece
from engine.errors import ConfigError

THINK_START = "<think>"
THINK_END = "</think>"
# Kimi K2's tool calls section: in its reasoning, it ends the reasoning (and starts the content).
KIMI_TOOL_SECTION = "<|tool_calls_section_begin|>"

_PRE, _REASONING, _CONTENT = "pre", "reasoning", "content"


class ReasoningStreamer:
    """One choice's streamed split. ``feed(delta)`` returns what of ``delta`` is reasoning and
    what is content (either may be ""); text that may be the start of a tag is held back until
    the next delta (or ``finish``) decides it. ``opens``: out of the reasoning, a ``<think>``
    opens a think block (else the output that starts out of it is all content)."""

    def __init__(self, in_reasoning: bool, opens: bool = True) -> None:
        self._phase = _REASONING if in_reasoning else _PRE if opens else _CONTENT
        self._start_seen = False  # a <think> after the first is reasoning text, not a tag
        self._held = ""
        self.entered_reasoning = in_reasoning

    @property
    def in_reasoning(self) -> bool:
        return self._phase == _REASONING

    def feed(self, delta: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        text, self._held = self._held + delta, ""
        while text:
            if self._phase == _CONTENT:
                content.append(text)
                break
            tags = self._tags()
            at, tag = _first_tag(text, tags)
            if tag is None:
                keep = _partial_tag_len(text, tags)
                self._emit(text[: len(text) - keep], reasoning, content)
                self._held = text[len(text) - keep :]
                break
            self._emit(text[:at], reasoning, content)
            text = self._on_tag(tag) + text[at + len(tag) :]
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The held-back text (no tag after all), once the output has ended."""
        reasoning: list[str] = []
        content: list[str] = []
        held, self._held = self._held, ""
        self._emit(held, reasoning, content)
        return "".join(reasoning), "".join(content)

    def _tags(self) -> tuple[str, ...]:
        if self._phase == _PRE:
            return (THINK_START,)
        return (THINK_END,) if self._start_seen else (THINK_START, THINK_END)

    def _emit(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if text:
            (reasoning if self._phase == _REASONING else content).append(text)

    def _on_tag(self, tag: str) -> str:
        """Takes ``tag`` in; returns what of it is text (read on after it)."""
        if tag == THINK_START:  # opens the reasoning, or (already in it) is dropped
            self._start_seen = True
            self._phase = _REASONING
            self.entered_reasoning = True
        else:
            self._phase = _CONTENT
        return ""


def _first_tag(text: str, tags: Sequence[str]) -> tuple[int, str | None]:
    found = [(text.find(tag), tag) for tag in tags if tag in text]
    return min(found) if found else (-1, None)


def _partial_tag_len(text: str, tags: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of one of ``tags``."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in tags):
            return n
    return 0


class ReasoningParser:
    """A named way to split reasoning from the answer (see the module doc and each subclass).
    ``in_reasoning`` says whether the output starts inside a think block; None: the parser's
    default for a prompt with no think tags (``output_starts_in_reasoning`` reads the prompt's)."""

    name = ""
    starts_in_reasoning = False
    # Out of the reasoning, a <think> the model writes opens a think block.
    opens_in_output = True
    # What ends the reasoning in the output, the first of these (reasoning tokens are counted
    # up to it).
    end_tags: tuple[str, ...] = (THINK_END,)
    # An empty reasoning (a think block with nothing in it) is no reasoning (None).
    empty_reasoning_is_none = False

    def streamer(self, *, in_reasoning: bool | None = None) -> ReasoningStreamer:
        start = self.starts_in_reasoning if in_reasoning is None else in_reasoning
        return ReasoningStreamer(start, self.opens_in_output)

    def extract(
        self, text: str, *, in_reasoning: bool | None = None
    ) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a whole output: reasoning None when the output
        has none, content None when nothing follows the reasoning."""
        streamer = self.streamer(in_reasoning=in_reasoning)
        r1, c1 = streamer.feed(text)
        r2, c2 = streamer.finish()
        reasoning = r1 + r2 if streamer.entered_reasoning else None
        if self.empty_reasoning_is_none:
            reasoning = reasoning or None
        return reasoning, (c1 + c2) or None

    def output_starts_in_reasoning(
        self,
        prompt_token_ids: Sequence[int],
        start_id: int,
        end_id: int,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> bool:
        """Whether the output starts inside a think block, given the prompt's tokens: the last
        think tag of the prompt decides (``</think>``: no; ``<think>``: yes); with none, the
        parser's default. (``chat_template_kwargs``: the request's, for parsers they switch.)"""
        for token in reversed(prompt_token_ids):
            if token == end_id:
                return False
            if token == start_id:
                return True
        return self.starts_in_reasoning

    def reasoning_ended_in_prompt(
        self, prompt_token_ids: Sequence[int], start_id: int, end_id: int
    ) -> bool:
        """The prompt's last think tag is ``</think>``: the output is the answer from its first
        token (vLLM's ``is_reasoning_end`` on the prompt), so a grammar applies at once."""
        for token in reversed(prompt_token_ids):
            if token in (start_id, end_id):
                return token == end_id
        return False


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills) templates open ``<think>`` in the prompt, so the output
    starts in reasoning and runs until ``</think>``; a ``<think>`` the model writes itself
    before that is dropped. Without ``</think>`` (cut off by ``max_tokens``) all of it is
    reasoning and the content is None."""

    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 writes ``<think>`` itself; output without a think block is all content. A
    ``<think>`` opens the reasoning, the first ``</think>`` closes it, and everything after is
    content. A template that opens ``<think>`` in the prompt (Qwen3-Thinking-2507) is read from
    the prompt's tokens (``output_starts_in_reasoning``): the output then starts in reasoning,
    as vLLM reads output whose ``</think>`` has no ``<think>``."""

    name = "qwen3"
    starts_in_reasoning = False


class Glm45ReasoningParser(ReasoningParser):
    """GLM-4.5 / 4.6 write ``<think>`` themselves (their template renders ``<think></think>``
    into the prompt when thinking is off): Qwen3's reading."""

    name = "glm45"
    starts_in_reasoning = False


class _ThinkingSwitchedParser(ReasoningParser):
    """A parser that the request's ``chat_template_kwargs`` switch, as vLLM builds one per
    request: thinking when ``thinking`` or ``enable_thinking`` is true (a ``reasoning_effort``
    sets ``enable_thinking`` unless that is given: ``"none"`` off, any other on); with neither,
    the parser's default (``starts_in_reasoning``). Thinking, the output starts in reasoning (a
    ``<think>`` the model writes there is dropped) and ``</think>`` ends it; without ``</think>``
    (cut off) all of it is reasoning and the content None. Not thinking, the output is all
    content, tags and all, as vLLM's identity parser leaves it; so is it when the prompt's last
    think tag is ``</think>`` (the template rendered thinking off), as vLLM's stream reads it
    (its non-streamed parse splits at ``</think>`` there)."""

    opens_in_output = False

    def thinking(self, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether the request thinks, as vLLM's parser reads its ``chat_template_kwargs``."""
        kwargs = dict(chat_template_kwargs or {})
        effort = kwargs.get("reasoning_effort")
        if effort is not None and "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = effort != "none"
        thinking, enable = kwargs.get("thinking"), kwargs.get("enable_thinking")
        if thinking is None and enable is None:
            return self.starts_in_reasoning
        return bool(thinking) or bool(enable)

    def output_starts_in_reasoning(
        self,
        prompt_token_ids: Sequence[int],
        start_id: int,
        end_id: int,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> bool:
        ended = self.reasoning_ended_in_prompt(prompt_token_ids, start_id, end_id)
        return self.thinking(chat_template_kwargs) and not ended

    def extract(
        self, text: str, *, in_reasoning: bool | None = None
    ) -> tuple[str | None, str | None]:
        if not (self.starts_in_reasoning if in_reasoning is None else in_reasoning):
            return None, text or None  # vLLM's identity parser: the whole output
        return super().extract(text, in_reasoning=True)


class DeepSeekV3ReasoningParser(_ThinkingSwitchedParser):
    """DeepSeek-V3.1 (vLLM's ``deepseek_v3``): thinking only when the request asks for it
    (``chat_template_kwargs``: ``{"thinking": true}``, whose template then opens ``<think>`` in
    the prompt; without it, the template closes ``</think>`` there): then DeepSeek-R1's reading;
    otherwise all content."""

    name = "deepseek_v3"
    starts_in_reasoning = False


class KimiK2ReasoningParser(_ThinkingSwitchedParser):
    """Kimi K2 Thinking (vLLM's ``kimi_k2``): thinking unless the request turns it off
    (``{"thinking": false}``). In the reasoning every ``<think>`` is dropped, its trailing
    whitespace is trimmed (an empty reasoning is None), and Kimi's tool calls section
    (``<|tool_calls_section_begin|>``) ends it too: the section is content, for the tool
    parser."""

    name = "kimi_k2"
    starts_in_reasoning = True
    end_tags = (THINK_END, KIMI_TOOL_SECTION)
    empty_reasoning_is_none = True

    def streamer(self, *, in_reasoning: bool | None = None) -> ReasoningStreamer:
        return _KimiStreamer(self.starts_in_reasoning if in_reasoning is None else in_reasoning)


class _KimiStreamer(ReasoningStreamer):
    """Kimi K2's reading of a think block: whitespace at the end of the reasoning so far is
    held until more reasoning follows it (dropped when the reasoning ends)."""

    def __init__(self, in_reasoning: bool) -> None:
        super().__init__(in_reasoning, opens=False)
        self._space = ""

    def feed(self, delta: str) -> tuple[str, str]:
        reasoning, content = super().feed(delta)
        return self._trim(reasoning, self.in_reasoning), content

    def finish(self) -> tuple[str, str]:
        reasoning, content = super().finish()
        return self._trim(reasoning, False), content

    def _trim(self, reasoning: str, more: bool) -> str:
        reasoning = self._space + reasoning
        kept = reasoning.rstrip()
        self._space = reasoning[len(kept) :] if more else ""
        return kept

    def _tags(self) -> tuple[str, ...]:
        return (THINK_START, THINK_END, KIMI_TOOL_SECTION)

    def _on_tag(self, tag: str) -> str:
        if tag == THINK_START:  # every <think> in the reasoning is dropped
            return ""
        super()._on_tag(tag)
        return tag if tag == KIMI_TOOL_SECTION else ""


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss (vLLM's ``openai_gptoss``): harmony's analysis channel is the reasoning; a call
    read without tools is content. The final channel (and commentary preambles) is the content.
    Its chats keep their special tokens for the reader (:class:`HarmonyFront`), and a chat's
    calls come out of the same reader (``tool_parsers.HarmonyStreamer``): the front reads
    reasoning, content and calls in one pass, as vLLM's harmony path does."""

    name = "openai_gptoss"

    def streamer(self, *, in_reasoning: bool | None = None) -> ReasoningStreamer:
        return _HarmonyReasoningStreamer()


class _HarmonyReasoningStreamer(ReasoningStreamer):
    """The (reasoning, content) split of a harmony output as it streams."""

    def __init__(self) -> None:
        super().__init__(False)
        self._reader = HarmonyReader(read_calls=False)

    def feed(self, delta: str) -> tuple[str, str]:
        return self._split(self._reader.feed(delta))

    def finish(self) -> tuple[str, str]:
        return self._split(self._reader.finish())

    def _split(self, pieces: list[Piece]) -> tuple[str, str]:
        reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
        self.entered_reasoning = self.entered_reasoning or bool(reasoning)
        return reasoning, "".join(p.text for p in pieces if p.kind == "content")


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser
    for parser in (
        DeepSeekR1ReasoningParser,
        DeepSeekV3ReasoningParser,
        KimiK2ReasoningParser,
        Qwen3ReasoningParser,
        Glm45ReasoningParser,
        GptOssReasoningParser,
    )
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as ``name``; ValueError naming the field and the valid names."""
    try:
        return REASONING_PARSERS[name]()
    except (KeyError, TypeError):
        valid = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"reasoning_parser: unknown parser {name!r}; one of {valid}") from None


def think_token_ids(tokenizer: Any, parser_name: str) -> tuple[int, int]:
    """The ids of ``<think>`` and ``</think>``, each a single token of ``tokenizer`` that
    decoding keeps (an added, non-special token, as in Qwen3's and DeepSeek-R1's tokenizers);
    ValueError naming ``reasoning_parser`` otherwise (vLLM refuses such a model at start too)."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids = []
    for tag in (THINK_START, THINK_END):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"reasoning_parser: {parser_name!r} needs {tag} as one token of the model's "
                f"tokenizer; it encodes to {len(encoded)} tokens"
            )
        if encoded[0] in special:
            raise ValueError(
                f"reasoning_parser: {parser_name!r}: the tokenizer's {tag} is a special token, "
                "which decoding skips; the model's tokenizer must keep it in the text"
            )
        ids.append(encoded[0])
    return ids[0], ids[1]


class ReasoningFront:
    """A model server's reasoning setup: its parser and the think tokens of its tokenizer
    (checked when the server starts: ``ConfigError`` naming ``reasoning_parser``)."""

    # Whether its chats are decoded with their special tokens (the parser reads them).
    keeps_special_tokens = False

    def __init__(self, name: str, tokenizer: Any) -> None:
        try:
            self.parser = get_reasoning_parser(name)
            self.start_id, self.end_id = think_token_ids(tokenizer, name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def prepare(
        self,
        prompt_token_ids: Sequence[int],
        structured_outputs: Any,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> bool | None:
        """For one chat request (its prompt's tokens and its ``chat_template_kwargs``): whether
        its output starts inside a think block (None: the parser's default); a structured
        output (``StructuredOutputsParams``) is set to constrain only what follows the
        reasoning, unless the output has none to come (the prompt ended it, or thinking is off
        where no ``<think>`` opens it). The grammar then waits for the first ``</think>``, so
        the output is read as starting in reasoning too (vLLM's ``qwen3`` reads all output so
        while thinking is on): what the grammar did not constrain is never content, and a
        ``<think>`` inside the constrained answer is its text, not a tag."""
        parser, ids, start, end = self.parser, prompt_token_ids, self.start_id, self.end_id
        in_reasoning = parser.output_starts_in_reasoning(ids, start, end, chat_template_kwargs)
        ended = parser.reasoning_ended_in_prompt(ids, start, end) or not (
            in_reasoning or parser.opens_in_output
        )
        if structured_outputs is not None and not ended:
            structured_outputs.reasoning_end_token_id = end
            return True
        return in_reasoning


class HarmonyFront(ReasoningFront):
    """``openai_gptoss``: the harmony tokens are special tokens of the model's tokenizer, so
    its chats are decoded with ``skip_special_tokens=False`` for the reader (as vLLM's parsers
    ask in ``adjust_request``); clients see only what the reader makes of them. A structured
    output constrains the whole output (no single token ends the reasoning)."""

    keeps_special_tokens = True

    def __init__(self, tokenizer: Any) -> None:
        self.parser = GptOssReasoningParser()
        for token in HARMONY_TOKENS:
            if len(tokenizer.encode(token, add_special_tokens=False)) != 1:
                raise ConfigError(
                    f"reasoning_parser: 'openai_gptoss' needs {token} as one token of the "
                    "model's tokenizer (a gpt-oss harmony tokenizer)"
                )

    def prepare(
        self,
        prompt_token_ids: Sequence[int],
        structured_outputs: Any,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> bool | None:
        return None


def reasoning_front(name: str, tokenizer: Any) -> ReasoningFront:
    """The setup of the parser ``name`` for a server of ``tokenizer`` (``ConfigError`` naming
    ``reasoning_parser``)."""
    if name == GptOssReasoningParser.name:
        return HarmonyFront(tokenizer)
    return ReasoningFront(name, tokenizer)
