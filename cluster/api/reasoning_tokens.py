"""Counting a reasoning model's reasoning tokens as vLLM does, for ``usage``'s
``completion_tokens_details`` (chat) and ``output_tokens_details`` (Responses): the tokens
between the think tags (to the end when cut off inside), or, for gpt-oss, the tokens of its
analysis messages and of its calls' arguments (``harmony.reasoning_spans``).

The text is read whole at the end; which tokens wrote which characters comes from marks kept
as the deltas arrive (text length and token count after each, O(1) a delta), so a token is
counted when all of its text lies inside a reasoning span."""

from __future__ import annotations

import bisect

from cluster.api.harmony import reasoning_spans
from cluster.api.reasoning_parsers import (
    THINK_START,
    GptOssReasoningParser,
    ReasoningParser,
)


class ReasoningMarks:
    """One choice's marks: its text length and token count after each delta."""

    def __init__(self) -> None:
        self.chars: list[int] = []
        self.tokens: list[int] = []

    def add(self, text: str, num_tokens: int) -> None:
        """A delta of ``text`` arrived; the choice has ``num_tokens`` tokens now."""
        self.chars.append((self.chars[-1] if self.chars else 0) + len(text))
        self.tokens.append(num_tokens)

    def count(self, parser: ReasoningParser, text: str, in_reasoning: bool | None) -> int:
        """The reasoning tokens of the choice's whole ``text`` (``in_reasoning``: whether the
        output starts inside a think block, None: the parser's default)."""
        if isinstance(parser, GptOssReasoningParser):
            return sum(self._at(end) - self._at(start) for start, end in reasoning_spans(text))
        if parser.extract(text, in_reasoning=in_reasoning)[0] is None:
            return 0
        if in_reasoning is None:
            in_reasoning = parser.starts_in_reasoning
        opened = text.find(THINK_START)
        # Out of a think block, the reasoning starts after the <think> that opens one; in one
        # from the start, after a <think> the model writes first (a tag, not reasoning).
        start = opened + len(THINK_START)
        if in_reasoning and (opened < 0 or text[:opened].strip()):
            start = 0
        ends = [at for at in (text.find(tag, start) for tag in parser.end_tags) if at >= 0]
        return self._at(min(ends, default=len(text))) - self._at(start)

    def _at(self, chars: int) -> int:
        """The tokens whose text ends at or before character ``chars``."""
        i = bisect.bisect_right(self.chars, chars)
        return self.tokens[i - 1] if i else 0


__all__ = ["ReasoningMarks"]
