"""Structured outputs with xgrammar: the head compiles and tracks grammars, the driver masks.

    head (LLMEngine)                                 driver worker (ModelRunner.sample)
    add_request: check and parse the spec (a 400
                 if bad), compile it on the compile
                 thread (LRU cache of futures); the
                 request waits (WAITING_FOR_FSM)
    step:  compiled -> a GrammarMatcher per sample,
           and the request joins the queue;
           for each constrained sample that
           samples this step, fill its row of the
           next-token bitmask  ───── ExecuteModelRequest ─────▶  logits[row] = -inf where
                                  structured_output_req_ids      the row's bit is 0, before
                                  grammar_bitmask (int32 rows)   anything else in the sampler
    after: matcher.accept_token(sampled token);
           terminated (stop token accepted) -> FINISHED_STOPPED

Bitmask layout: row i is for ``structured_output_req_ids[i]``; ``ceil(vocab_size / 32)``
little-endian int32 words, bit ``j`` of word ``w`` set iff token ``32 * w + j`` is allowed.
Matchers advance only with sampled tokens, so preemption (recompute or swap) leaves them as
they are: a recomputed request recomputes its old tokens without sampling them again.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.core.json_schema_limits import check_json_schema
from engine.core.json_string_grammar import json_schema_grammar
from engine.core.xgrammar_lib import xgrammar
from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger("llm_cluster.structured_output")

_BITMASK_DTYPE = np.dtype("<i4")
# xgrammar's messages start with "[hh:mm:ss] /path/to/file.cc:123: " and may carry a
# "Check failed: (...) is false: " preamble; neither helps a client.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_MAX_ERROR_CHARS = 300
# A comment in either grammar syntax, to the end of its line (as vLLM strips them).
_GRAMMAR_COMMENT = re.compile(r"(#|//).*$")
# JSON allows any run of whitespace between tokens; a model that has drifted (small, quantized,
# or random weights) can emit newlines until max_tokens and never close the object. Capping
# each run keeps every pretty-printed JSON (indents of a few levels) and rules that out.
MAX_JSON_WHITESPACE_RUN = 16


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return -(-vocab_size // 32)


class StructuredOutputGrammar:
    """One sample's grammar state: a ``GrammarMatcher`` advanced by the sampled tokens.

    With ``start_after`` (a reasoning model's end-of-reasoning token), the grammar is dormant
    until that token is sampled: no bitmask row, sampled tokens not fed to the matcher. The
    token after it is the first the grammar constrains, from its initial state."""

    def __init__(
        self, matcher: xgr.GrammarMatcher, vocab_size: int, start_after: int | None = None
    ) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_accepted_tokens = 0
        self.start_after = start_after

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (False while dormant)."""
        return self.start_after is None

    def accept_tokens(self, token_ids: Iterable[int]) -> bool:
        """Advance by ``token_ids``; False (state unchanged from the rejected token on) if the
        grammar rejects one. While dormant, tokens up to the awakening one pass unchecked."""
        for token in token_ids:
            if self.start_after is not None:
                if token == self.start_after:
                    self.start_after = None
                continue
            if not self.matcher.accept_token(token):
                return False
            self.num_accepted_tokens += 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.matcher.is_terminated()

    def allows_only(self, token_ids: Iterable[int]) -> bool:
        """Whether every token the grammar allows next is one of ``token_ids`` (a complete
        document whose only continuation is its stop token)."""
        if not self.active or not self.matcher.is_completed():
            return False
        bitmask = xgrammar().allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        bits = bits[: self.vocab_size]
        return set(np.flatnonzero(bits).tolist()) <= set(token_ids)


class StructuredOutputManager:
    """Head side, one per engine: the tokenizer's xgrammar views and compilers (built on first
    use; one for requests whose text drops special tokens, one for those that keep them),
    compiles on a thread of their own (a large schema takes seconds, and the engine thread
    keeps stepping the other requests meanwhile; xgrammar releases the GIL), the compiles'
    futures in an LRU cache keyed by the spec, and the per-step bitmask."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int] = (),
        *,
        cache_size: int = 128,
    ) -> None:
        self.tokenizer = tokenizer
        # The model's vocabulary (its logits' width), which may exceed the tokenizer's.
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self._compilers: dict[bool, xgr.GrammarCompiler] = {}
        self._cache: OrderedDict[tuple[str, str, bool, bool], Future[xgr.CompiledGrammar]] = (
            OrderedDict()
        )
        self._executor: ThreadPoolExecutor | None = None

    def compiler(self, skip_special_tokens: bool = True) -> xgr.GrammarCompiler:
        """The compiler for requests whose text drops special tokens (the default) or keeps
        them (a grammar may then spell a special token, as a harmony transcript does)."""
        if skip_special_tokens not in self._compilers:
            info = _tokenizer_info(
                self.tokenizer, self.vocab_size, self.stop_token_ids, skip_special_tokens
            )
            # One compile thread, one xgrammar thread: the model's forward needs the cores.
            # Our LRU is the only cache (xgrammar's own is unbounded by default).
            self._compilers[skip_special_tokens] = xgrammar().GrammarCompiler(
                info, max_threads=1, cache_enabled=False
            )
        return self._compilers[skip_special_tokens]

    @property
    def num_cached_grammars(self) -> int:
        return len(self._cache)

    def prepare(
        self, params: StructuredOutputsParams, skip_special_tokens: bool = True
    ) -> Future[xgr.CompiledGrammar]:
        """Check and parse ``params`` now, compile on the compile thread: the compile's
        future (cached; a failed one is compiled again). An invalid schema, regex or grammar,
        or a schema keyword the grammar would not enforce (``json_schema_limits``), raises
        ``InvalidRequestError`` naming the field and the reason; so does the future if the
        compile itself fails."""
        end = params.reasoning_end_token_id
        if end is not None and end >= self.vocab_size:
            raise InvalidRequestError(
                f"must be a token id in [0, {self.vocab_size}), got {end}",
                param="structured_outputs.reasoning_end_token_id",
            )
        kind = params.kind
        spec = _spec_text(params)
        key = (kind, spec, params.disable_any_whitespace, skip_special_tokens)
        cached = self._cache.get(key)
        if cached is not None and not (cached.done() and cached.exception() is not None):
            self._cache.move_to_end(key)
            return cached
        if kind == "json":
            check_json_schema(json.loads(spec))
        try:
            grammar = _parse(kind, spec, any_whitespace=not params.disable_any_whitespace)
        except (RuntimeError, ValueError) as exc:
            raise _compile_error(kind, exc) from None
        compiler = self.compiler(skip_special_tokens)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        future = self._executor.submit(_compile, compiler, grammar, kind)
        self._cache[key] = future
        self._cache.move_to_end(key)
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return future

    def compile(
        self, params: StructuredOutputsParams, skip_special_tokens: bool = True
    ) -> xgr.CompiledGrammar:
        """``prepare``, waiting for the compile."""
        return self.prepare(params, skip_special_tokens).result()

    def new_grammar(
        self,
        params: StructuredOutputsParams,
        skip_special_tokens: bool = True,
        compiled: xgr.CompiledGrammar | None = None,
    ) -> StructuredOutputGrammar:
        """A sample's grammar state over ``compiled`` (by default ``params`` compiled now)."""
        if compiled is None:
            compiled = self.compile(params, skip_special_tokens)
        return StructuredOutputGrammar(
            xgrammar().GrammarMatcher(compiled),
            self.vocab_size,
            start_after=params.reasoning_end_token_id,
        )

    def shutdown(self) -> None:
        """Drop the compiles not started (a running one ends on its own)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def grammar_bitmask(self, grammars: Sequence[StructuredOutputGrammar]) -> bytes:
        """The next-token bitmask of each grammar, one row each, as the step message carries
        it."""
        bitmask = xgrammar().allocate_token_bitmask(len(grammars), self.vocab_size)
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, row)
        return bitmask.numpy().astype(_BITMASK_DTYPE, copy=False).tobytes()


def _parse(kind: str, spec: str, *, any_whitespace: bool) -> xgr.Grammar:
    """The spec as an xgrammar ``Grammar`` (quick; the compile is the slow part)."""
    if kind in ("json", "json_object"):
        # Not xgrammar's own JSON schema converter: xgrammar 0.2.8's length-bounded strings
        # admit raw control characters (see engine/core/json_string_grammar.py). Without any
        # whitespace, no space after "," and ":" either (xgrammar's default writes ", " and
        # ": "); vLLM passes the same separators.
        return json_schema_grammar(
            spec,
            any_whitespace=any_whitespace,
            max_whitespace_cnt=MAX_JSON_WHITESPACE_RUN,
            separators=None if any_whitespace else (",", ":"),
        )
    if kind == "regex":
        return xgrammar().Grammar.from_regex(spec)
    if kind == "grammar" and _is_lark(spec):
        return xgrammar().Grammar.from_lark(spec)
    return xgrammar().Grammar.from_ebnf(spec)  # grammar, and choice as a grammar


def _is_lark(grammar: str) -> bool:
    """Whether a grammar is in Lark's syntax rather than xgrammar's EBNF: no rule is defined
    with ``::=`` (comments aside), the test vLLM uses to pick the parser."""
    return all("::=" not in _GRAMMAR_COMMENT.sub("", line) for line in grammar.splitlines())


def _compile(compiler: xgr.GrammarCompiler, grammar: xgr.Grammar, kind: str) -> xgr.CompiledGrammar:
    """On the compile thread."""
    try:
        return compiler.compile_grammar(grammar)
    except (RuntimeError, ValueError) as exc:
        raise _compile_error(kind, exc) from None


def _compile_error(kind: str, exc: Exception) -> InvalidRequestError:
    return InvalidRequestError(
        f"cannot be compiled: {_short_message(exc)}", param=f"structured_outputs.{kind}"
    )


def _tokenizer_info(
    tokenizer: Any, vocab_size: int, stop_token_ids: list[int], skip_special_tokens: bool
) -> xgr.TokenizerInfo:
    """xgrammar's view of the tokenizer, with the engine's EOS ids as the grammar's stop tokens
    (the grammar's end is the token that ends the request). xgrammar would match any token as
    its literal text; a stop token inside a document would end it there, and with
    ``skip_special_tokens`` a special token (BOS, padding, chat markers) would vanish from the
    text. So those tokens are outside every grammar: xgrammar leaves a token whose string is
    empty out of grammars (a stop token still ends one), and they are given one."""
    info = xgrammar().TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
    )
    special = set(info.stop_token_ids)
    if skip_special_tokens:
        special |= set(getattr(tokenizer, "all_special_ids", ()))
    special = {i for i in special if 0 <= i < vocab_size}
    if not special:
        return info
    encoded = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if 0 <= index < vocab_size and index not in special:
            encoded[index] = token
    blanked = xgrammar().TokenizerInfo.from_vocab_and_metadata(encoded, info.dump_metadata())
    same = all(
        a == b
        for i, (a, b) in enumerate(zip(info.decoded_vocab, blanked.decoded_vocab))
        if i not in special
    )
    if not same:  # a tokenizer xgrammar reads otherwise than by get_vocab (tiktoken)
        logger.warning("special tokens left in grammars: the tokenizer's vocabulary differs")
        return info
    return blanked


def _spec_text(params: StructuredOutputsParams) -> str:
    """What xgrammar compiles: schema text, regex, or EBNF or Lark (a choice becomes EBNF
    alternatives)."""
    kind = params.kind
    if kind == "json":
        return str(params.json)
    if kind == "json_object":
        return '{"type":"object"}'
    if kind == "regex":
        return str(params.regex)
    if kind == "choice":
        return "root ::= " + " | ".join(_ebnf_literal(c) for c in params.choice or ())
    return str(params.grammar)


def _ebnf_literal(text: str) -> str:
    r"""A string literal in xgrammar's EBNF: quotes and backslashes escaped, control characters
    as \n, \t, \uHHHH."""
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20:  # fixed width: xgrammar's \x takes every hex digit after it
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _short_message(exc: Exception) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    message = _XGRAMMAR_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
    if len(message) > _MAX_ERROR_CHARS:
        message = message[: _MAX_ERROR_CHARS - 3] + "..."
    return message


# ---- driver worker ---------------------------------------------------------------------


def unpack_bitmask(data: bytes, num_rows: int) -> np.ndarray:
    """The step message's ``grammar_bitmask`` as an int32 array [num_rows, words]."""
    words = np.frombuffer(data, dtype=_BITMASK_DTYPE)
    if num_rows == 0 or words.size % num_rows:
        raise ValueError(f"grammar_bitmask: {words.size} words do not make {num_rows} rows")
    return words.reshape(num_rows, -1)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: Sequence[int]) -> None:
    """In place: ``logits[rows[i], t] = -inf`` for every token t that row i of ``bitmask``
    disallows. Columns past the bitmask (a model vocabulary padded beyond the grammar's) are
    disallowed too; bits past the logits' width are ignored."""
    if not rows:
        return
    num_rows, width = logits.shape
    covered = min(width, bitmask.shape[1] * 32)
    # xgrammar indexes the logits and the bitmask with the same row: spread the rows out over
    # a full-batch bitmask whose other rows allow everything.
    full = torch.full((num_rows, bitmask.shape[1]), -1, dtype=torch.int32)
    full[list(rows)] = torch.from_numpy(np.array(bitmask, dtype=np.int32))
    xgrammar().apply_token_bitmask_inplace(
        logits, full.to(logits.device), vocab_size=covered, indices=list(rows)
    )
    if covered < width:
        index = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
        logits[index, covered:] = float("-inf")
