"""Incremental detokenization and stop strings, on the head.

Text grows by ``tokenizers``' ``DecodeStream`` primed with the prompt, so a multi-byte
character split across tokens appears only once complete, and a token's leading space depends
on the tokens before it exactly as in a full decode.

A prompt can end inside a character (token-id prompts, a prompt cut at a token limit). The
output text is then what the full decode of prompt and output has beyond the prompt's own
decoded text, as in vLLM: the character the output completes belongs to the prompt, which
already shows it as U+FFFD. The stream is primed with the prompt up to its last complete
character and fed the rest, and as many characters as that rest decodes to are skipped.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: object,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        detokenize: bool = True,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("tokenizer: a fast (tokenizers-backed) tokenizer is required")
        self._backend = backend
        # False: no text at all (vLLM's ``detokenize=False``), only the tokens counted.
        self.detokenize = detokenize
        prompt = list(prompt_token_ids) if detokenize else []
        head, tail = _split_incomplete_tail(backend, prompt, skip_special_tokens)
        self.skip_special_tokens = skip_special_tokens
        # Without spaces between special tokens: the added tokens (id -> content), and whether
        # the last token was one (vLLM's FastIncrementalDetokenizer).
        self._added: dict[int, str] = {}
        if not (skip_special_tokens or spaces_between_special_tokens):
            added = backend.get_added_tokens_decoder()
            self._added = {token_id: token.content for token_id, token in added.items()}
        self._last_added = False
        self._stream = DecodeStream(ids=head, skip_special_tokens=skip_special_tokens)
        # Characters of the stream's text that are the prompt's (its incomplete last one).
        self._skip = 0
        if tail:
            self._skip = len(backend.decode(tail, skip_special_tokens=skip_special_tokens))
            for token_id in tail:
                chunk = self._step(token_id)  # a restarted stream sets _skip to 0
                if chunk is not None:
                    self._skip = max(0, self._skip - len(chunk))
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        # Stop strings are matched only once more than min_tokens tokens were generated.
        self.min_tokens = min_tokens
        self._num_tokens = 0
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # The text as the chunks the stream produced (joined only when all of it is read), so
        # a step's cost does not grow with the text: see ``text_between``.
        self._chunks: list[str] = []
        self._length = 0
        self.stop_string: str | None = None
        # Tokens the stream holds back (an incomplete UTF-8 character so far).
        self._pending: list[int] = []

    @property
    def output_text(self) -> str:
        """All the text so far (joins the chunks: O(length) once per new chunk)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def text_length(self) -> int:
        return self._length

    def text_between(self, start: int, end: int) -> str:
        """``output_text[start:end]`` reading only the chunks it spans, from the end: O(the
        text between ``start`` and the end) when ``start`` is near the end, as a delta's is."""
        pieces = []
        chunk_end = self._length
        for chunk in reversed(self._chunks):
            chunk_start = chunk_end - len(chunk)
            if chunk_start < end and chunk_end > start:
                pieces.append(chunk[max(start - chunk_start, 0) : end - chunk_start])
            if chunk_start <= start:
                break
            chunk_end = chunk_start
        return "".join(reversed(pieces))

    def _append(self, chunk: str) -> None:
        if chunk:
            self._chunks.append(chunk)
            self._length += len(chunk)

    def update(self, new_token_ids: list[int]) -> bool:
        """Append decoded text; True if a stop string appeared (the text is cut before it, or
        after it with ``include_stop_str_in_output``)."""
        start = self._length
        self._num_tokens += len(new_token_ids)
        if not self.detokenize:
            return False
        for token_id in new_token_ids:
            chunk = self._step(token_id)
            if self._added:
                content = self._added.get(token_id)
                if content is not None and self._last_added:
                    chunk = content  # its bare content, no space before it
                self._last_added = content is not None
            if chunk is None:
                self._pending.append(token_id)
                continue
            self._pending.clear()
            if self._skip:
                cut = min(self._skip, len(chunk))
                self._skip -= cut
                chunk = chunk[cut:]
            self._append(chunk)
        if not self.stop or self._length == start or self._num_tokens <= self.min_tokens:
            return False
        # A stop string can straddle old and new text: search from max_stop_len - 1 back, for
        # stop strings that end in the new text (as vLLM: text before the min_tokens-th token
        # only starts one).
        search_from = max(0, start - self._max_stop_len + 1)
        window = self.text_between(search_from, self._length)
        # The stop string that completes first, as if the text came one character at a time
        # (vLLM's rule); of two that end together, the first listed.
        best: tuple[int, str] | None = None
        for stop in self.stop:
            pos = window.find(stop, max(0, start - search_from - len(stop) + 1))
            if pos != -1 and (best is None or pos + len(stop) < best[0] + len(best[1])):
                best = (pos, stop)
        if best is None:
            return False
        pos = search_from + best[0]
        end = pos + len(best[1]) if self.include_stop_str_in_output else pos
        text = self.output_text[:end]  # once, at the end of the request
        self._chunks, self._length = [text] if text else [], len(text)
        self.stop_string = best[1]
        return True

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX):
                raise
        # A decoder whose text is not monotonic (byte-fallback bytes that, with the next
        # token, decode to other characters than before) breaks the stream's prefix: restart
        # it without context, as vLLM does (its ``FastIncrementalDetokenizer``).
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        self._skip = 0
        return self._stream.step(self._backend, token_id)

    def finish(self) -> None:
        """At the end of generation, drop what the stream still holds back: the bytes of a
        character the output did not finish are no text (vLLM's detokenizer never emits them;
        a full decode would show them as U+FFFD)."""
        self._pending.clear()


# The start of the error ``DecodeStream.step`` raises when the text decoded so far is not a
# prefix of the text with the new token.
_INVALID_PREFIX = "Invalid prefix encountered"

# A UTF-8 character is at most 4 bytes, so at most 4 tokens can hold an unfinished one.
_MAX_CHAR_TOKENS = 4


def _split_incomplete_tail(
    backend: object, prompt: list[int], skip_special_tokens: bool
) -> tuple[list[int], list[int]]:
    """``prompt`` as (tokens up to its last complete character, the tokens after): the tail is
    empty unless the prompt's decoded text ends in U+FFFD."""
    decode = backend.decode  # type: ignore[attr-defined]
    if not prompt or not decode(
        prompt[-_MAX_CHAR_TOKENS:], skip_special_tokens=skip_special_tokens
    ).endswith("\ufffd"):
        return prompt, []
    for cut in range(1, min(_MAX_CHAR_TOKENS, len(prompt)) + 1):
        head = prompt[:-cut]
        window = head[-_MAX_CHAR_TOKENS:]
        if not decode(window, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            return head, prompt[-cut:]
    return prompt, []
