"""Incremental detokenization and stop strings, on the head.

Text grows by ``tokenizers``' ``DecodeStream`` primed with the prompt, so a multi-byte
character split across tokens appears only once complete, and a token's leading space depends
on the tokens before it exactly as in a full decode.
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
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("tokenizer: a fast (tokenizers-backed) tokenizer is required")
        self._backend = backend
        self._stream = DecodeStream(
            ids=list(prompt_token_ids), skip_special_tokens=skip_special_tokens
        )
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        # Stop strings are matched only once more than min_tokens tokens were generated.
        self.min_tokens = min_tokens
        self._num_tokens = 0
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.skip_special_tokens = skip_special_tokens
        self.output_text = ""
        self.stop_string: str | None = None
        # Tokens the stream holds back (an incomplete UTF-8 character so far).
        self._pending: list[int] = []

    def update(self, new_token_ids: list[int]) -> bool:
        """Append decoded text; True if a stop string appeared (the text is cut before it, or
        after it with ``include_stop_str_in_output``)."""
        start = len(self.output_text)
        self._num_tokens += len(new_token_ids)
        for token_id in new_token_ids:
            chunk = self._stream.step(self._backend, token_id)
            if chunk is None:
                self._pending.append(token_id)
            else:
                self._pending.clear()
                self.output_text += chunk
        if not self.stop or len(self.output_text) == start or self._num_tokens <= self.min_tokens:
            return False
        # A stop string can straddle old and new text: search from max_stop_len - 1 back.
        search_from = max(0, start - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            pos = self.output_text.find(stop, search_from)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        end = best[0] + len(best[1]) if self.include_stop_str_in_output else best[0]
        self.output_text = self.output_text[:end]
        self.stop_string = best[1]
        return True

    def finish(self) -> None:
        """At the end of generation, emit what the stream still holds back, decoded as a full
        decode would (an incomplete character becomes U+FFFD)."""
        if self._pending and self.stop_string is None:
            self.output_text += self._backend.decode(
                self._pending, skip_special_tokens=self.skip_special_tokens
            )
            self._pending.clear()
