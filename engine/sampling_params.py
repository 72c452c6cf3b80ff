"""``SamplingParams``: what a request asks of decoding, with vLLM's names, defaults and ranges.

It is a ``msgspec.Struct`` so that it travels inside ``ExecuteModelRequest`` through the typed
codec, never through pickle. Ranges that need no model (penalty bounds, ``min_tokens <=
max_tokens``) are checked here; those that need the model or the server's caps (token ids inside
the vocabulary, ``n <= max_n``, ``logprobs <= max_logprobs``) in ``LLMEngine.add_request``.
"""

from __future__ import annotations

import enum
import json
import math
from typing import Any

import msgspec

from engine.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
_MAX_LOGIT_BIAS = 100.0
# Objects and arrays a structured output's JSON schema may nest (vLLM's bound): deeper ones
# would exhaust the recursion of the schema checks and the grammar compiler.
MAX_JSON_SCHEMA_NESTING = 64

# Fields that must keep their default under beam search: the driver ranks beams by the model's
# raw log-probabilities, so these would silently do nothing.
_NOT_WITH_BEAM_SEARCH = (
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "prompt_logprobs",
    "structured_outputs",
)

# The kinds of constraint StructuredOutputsParams offers; a request sets exactly one.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Constrain the output to a grammar (vLLM's ``StructuredOutputsParams``), enforced with
    xgrammar by masking every token the grammar cannot accept next. Set exactly one of:

    ``json``: a JSON schema, as a dict or a JSON string (kept as a compact JSON string, so that
    it travels through the msgpack step message unchanged; property order is kept, it is the
    order the output follows), its objects and arrays nested at most 64 levels, as in vLLM.
    ``regex``: a regular expression the whole output matches. ``choice``: the output is one of
    these strings. ``grammar``: an EBNF grammar in xgrammar's syntax (GBNF-like, rule ``root``
    is the start), or a Lark grammar (rule ``start``), told apart as vLLM does: a grammar with
    no ``::=`` is Lark. ``json_object``: any JSON object.

    ``disable_any_whitespace``: JSON output without optional whitespace (``{"a":1,"b":[1,2]}``,
    never ``{"a": 1}`` or newlines, as in vLLM), which keeps a weak model from looping on
    whitespace.
    ``disable_additional_properties``: objects allow no property their schema does not name;
    xgrammar's strict mode, which the engine always uses, already does this for every object
    schema that does not say ``additionalProperties`` (kept for vLLM compatibility).

    The request finishes with ``finish_reason`` "stop" once the grammar is complete (even with
    ``ignore_eos``); ``max_tokens`` must leave room for the whole output.

    ``reasoning_end_token_id``: a reasoning model's answer is constrained, not its reasoning
    (vLLM enables the grammar once its reasoning parser sees the end of the reasoning). With
    this token id (``</think>``), no token is masked until that token is sampled; the grammar
    then starts from its initial state with the next token. The serving front sets it from its
    ``reasoning_parser``.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_end_token_id: int | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if self._is_set(k)]
        _check(
            len(kinds) == 1,
            "structured_outputs",
            f"exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)} must be set, got "
            + (", ".join(kinds) or "none"),
        )
        if self.json is not None:
            self.json = _json_schema_text(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check(
                    isinstance(value, str) and bool(value),
                    f"structured_outputs.{name}",
                    "must be a non-empty string",
                )
        if self.choice is not None:
            _check(
                isinstance(self.choice, list)
                and bool(self.choice)
                and all(isinstance(c, str) and c for c in self.choice),
                "structured_outputs.choice",
                "must be a non-empty list of non-empty strings",
            )
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            _check(
                isinstance(getattr(self, name), bool),
                f"structured_outputs.{name}",
                f"must be a boolean, got {getattr(self, name)!r}",
            )
        end = self.reasoning_end_token_id
        _check(
            end is None or (isinstance(end, int) and not isinstance(end, bool) and end >= 0),
            "structured_outputs.reasoning_end_token_id",
            f"must be a token id (an integer >= 0), got {end!r}",
        )

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``STRUCTURED_OUTPUT_KINDS``."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if self._is_set(k))

    def _is_set(self, kind: str) -> bool:
        # json may be the schema ``false`` (refused when compiled); json_object is a flag.
        value = getattr(self, kind)
        return value is not None if kind == "json" else value not in (None, False)


class RequestOutputKind(enum.IntEnum):
    """What each output of a request holds (vLLM's names and values): ``CUMULATIVE`` everything
    so far (text, token ids, logprobs), ``DELTA`` only what is new since the last output,
    ``FINAL_ONLY`` one output, the whole result, when the request finishes."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Decoding parameters of one request (vLLM's ``SamplingParams`` names and ranges).

    ``temperature`` 0 means greedy. ``top_k`` 0 (or -1) and ``top_p`` 1 disable those filters;
    ``min_p`` drops tokens whose probability is below ``min_p`` times the top token's.
    ``max_tokens`` None means "up to max_model_len". ``stop`` strings end generation and are
    excluded from the text unless ``include_stop_str_in_output``; ``stop_token_ids`` end it
    too (the token is kept in ``token_ids``). Until ``min_tokens`` tokens are generated, EOS and
    ``stop_token_ids`` cannot be sampled and stop strings are not matched.

    Penalties: ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] subtract
    ``penalty * [count > 0]`` / ``penalty * count`` over the generated tokens (OpenAI);
    ``repetition_penalty`` > 0 divides positive logits and multiplies negative ones of every
    token seen in the prompt or the output (HF / CTRL). ``logit_bias`` maps token id -> bias in
    [-100, 100], added to the logits. ``bad_words`` are strings never to generate: the head
    tokenizes them into ``bad_words_token_ids`` (which may also be given directly).
    ``allowed_token_ids`` (vLLM's): only these tokens can be sampled (a non-empty list).

    ``n`` independent samples share the prompt's KV blocks. ``logprobs`` = k returns, per
    generated token, the top-k log-probabilities plus the sampled token's own;
    ``prompt_logprobs`` = k the same for every prompt token after the first. Log-probabilities
    are those of the raw model (log_softmax of the logits before penalties and temperature), as
    vLLM v1 returns by default.

    ``use_beam_search`` runs beam search (``LLM.beam_search``) with ``beam_width`` beams
    (default ``n``) and returns the ``n`` best by cumulative logprob / length**length_penalty.

    ``structured_outputs`` constrains the output to a JSON schema, regex, choice or grammar
    (see ``StructuredOutputsParams``); not with beam search.

    ``output_kind`` (``RequestOutputKind``) says what each output holds, as in vLLM:
    cumulative (the default of ``LLMEngine.step`` and ``AsyncLLMEngine.generate``), deltas
    (each output's text, token ids and logprobs are only the new ones; concatenated they give
    the final result; text within ``max(len(stop)) - 1`` characters of the end is held back
    while a stop string could still match), or the final output only (what ``LLM.generate``
    uses). The engine builds deltas natively, so a streaming client's per-step cost does not
    grow with the length of its output.

    ``spaces_between_special_tokens`` False (with ``skip_special_tokens`` False): an added
    token right after another reads as its bare content, without the space a decoder may put
    before it (vLLM's fast detokenizer). ``detokenize`` False: no text (the outputs' ``text``
    is "", their logprobs' ``decoded_token`` None), as vLLM.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's: arguments for the engine's plug-ins; ``kv_transfer_params`` is the KV
    # connector's (``engine.kv_transfer.nixl``: ``do_remote_decode`` on a prefill engine, the
    # prefill's output ``kv_transfer_params`` on a decode engine).
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.seed == -1 and _is_int(self.seed):  # vLLM's (and many UIs') "random seed"
            self.seed = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self._check_filters()
        self._check_penalties()
        self._check_lengths_and_stops()
        self._check_logprobs()
        self._check_logit_bias()
        self._check_bad_words()
        self._check_beam_search()
        _check(
            self.output_kind in tuple(RequestOutputKind),
            "output_kind",
            f"must be one of {[k.name for k in RequestOutputKind]} (0, 1, 2), "
            f"got {self.output_kind!r}",
        )
        self.output_kind = RequestOutputKind(self.output_kind)
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
        )
        _check(
            self.extra_args is None
            or (
                isinstance(self.extra_args, dict)
                and all(isinstance(k, str) for k in self.extra_args)
            ),
            "extra_args",
            f"must be a mapping with string keys or null, got {self.extra_args!r}",
        )

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        """``extra_args["kv_transfer_params"]`` (vLLM's place for them), or None."""
        return (self.extra_args or {}).get("kv_transfer_params")

    def _check_filters(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", f"must be >= 1, got {self.n!r}")
        _check(
            _is_number(self.temperature) and 0 <= self.temperature <= 2,
            "temperature",
            f"must be in [0, 2], got {self.temperature!r}",
        )
        _check(
            _is_number(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            _is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1),
            "top_k",
            f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}",
        )
        _check(
            _is_number(self.min_p) and 0 <= self.min_p <= 1,
            "min_p",
            f"must be in [0, 1], got {self.min_p!r}",
        )
        if self.seed is not None:
            # A 64-bit seed, as OpenAI's: torch.Generator and the msgpack step message take no
            # more (sample i of n draws from seed + i, wrapped to stay in range).
            _check(
                _is_int(self.seed) and -(2**63) <= self.seed < 2**63,
                "seed",
                f"must be a 64-bit integer in [-2**63, 2**63), got {self.seed!r}",
            )

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _is_number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}"
            )
        _check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be a finite number > 0, got {self.repetition_penalty!r}",
        )

    def _check_lengths_and_stops(self) -> None:
        if self.max_tokens is not None:
            _check(
                _is_int(self.max_tokens) and self.max_tokens >= 1,
                "max_tokens",
                f"must be >= 1, got {self.max_tokens!r}",
            )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            f"must be >= 0, got {self.min_tokens!r}",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        if self.stop is not None:
            _check(
                isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop),
                "stop",
                "must be a string or a list of strings",
            )
            _check(all(self.stop), "stop", "must not contain empty strings")
            _check(
                self.detokenize or not self.stop,
                "stop",
                "stop strings are only supported when detokenize is True",
            )
        if self.stop_token_ids is not None:
            _check(
                isinstance(self.stop_token_ids, list)
                and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "must be a list of non-negative integers",
            )

    def _check_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(_is_int(value) and value >= 0, name, f"must be >= 0, got {value!r}")

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        _check(isinstance(self.logit_bias, dict), "logit_bias", "must map token ids to biases")
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            token = _json_token_id(key)
            _check(
                _is_int(token) and token >= 0,
                "logit_bias",
                f"keys must be non-negative token ids, got {key!r}",
            )
            _check(
                _is_number(value) and -_MAX_LOGIT_BIAS <= value <= _MAX_LOGIT_BIAS,
                "logit_bias",
                f"bias of token {token} must be in [-100, 100], got {value!r}",
            )
            bias[token] = float(value)
        self.logit_bias = bias

    def _check_bad_words(self) -> None:
        if self.bad_words is not None:
            _check(
                isinstance(self.bad_words, list)
                and all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words",
                "must be a list of non-blank strings",
            )
        if self.bad_words_token_ids is not None:
            _check(
                isinstance(self.bad_words_token_ids, list)
                and all(
                    isinstance(seq, list) and seq and all(_is_int(t) and t >= 0 for t in seq)
                    for seq in self.bad_words_token_ids
                ),
                "bad_words_token_ids",
                "must be a list of non-empty lists of non-negative token ids",
            )
        if self.allowed_token_ids is not None:
            _check(
                isinstance(self.allowed_token_ids, list)
                and bool(self.allowed_token_ids)
                and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids",
                f"must be a non-empty list of non-negative token ids, got "
                f"{self.allowed_token_ids!r}",
            )

    def _check_beam_search(self) -> None:
        if self.beam_width is not None:
            _check(
                _is_int(self.beam_width) and self.beam_width >= 1,
                "beam_width",
                f"must be >= 1, got {self.beam_width!r}",
            )
        _check(
            _is_number(self.length_penalty),
            "length_penalty",
            f"must be a number, got {self.length_penalty!r}",
        )
        if not self.use_beam_search:
            return
        _check(
            self.n <= self.num_beams,
            "n",
            f"must be <= beam_width ({self.num_beams}) with use_beam_search, got {self.n}",
        )
        _check(
            self.greedy,
            "temperature",
            f"must be 0 with use_beam_search, got {self.temperature!r}",
        )
        defaults = SamplingParams()
        for name in _NOT_WITH_BEAM_SEARCH:
            _check(
                getattr(self, name) == getattr(defaults, name),
                name,
                "is not supported with use_beam_search (beams are ranked by raw logprobs)",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def num_beams(self) -> int:
        return self.beam_width if self.beam_width is not None else self.n

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=name)


def _json_schema_text(schema: Any) -> str:
    """A JSON schema (dict, bool or JSON text) as compact JSON text, key order kept."""
    param = "structured_outputs.json"
    too_deep = (
        f"is nested too deeply: objects and arrays may nest at most {MAX_JSON_SCHEMA_NESTING} "
        "levels"
    )
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(f"is not valid JSON: {exc}", param=param) from None
        except RecursionError:
            raise InvalidRequestError(too_deep, param=param) from None
    _check(isinstance(schema, (dict, bool)), param, "must be a JSON schema (an object)")
    _check(not _nests_deeper(schema, MAX_JSON_SCHEMA_NESTING), param, too_deep)
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"is not JSON-serializable: {exc}", param=param) from None


def _nests_deeper(document: Any, limit: int) -> bool:
    """Whether ``document`` nests objects and arrays more than ``limit`` levels (level by
    level, without recursion)."""
    level = [document] if isinstance(document, (dict, list)) else []
    for _ in range(limit):
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


def _json_token_id(key: Any) -> Any:
    """JSON object keys are strings: "50256" is token 50256. Only ASCII digits, and few enough
    that ``int`` parses them ("²" is a digit to ``str.isdigit``; no vocabulary has 10**18
    tokens); any other key is returned as is, to be rejected."""
    text = key.strip() if isinstance(key, str) else ""
    if text.isascii() and text.isdigit() and len(text) <= 18:
        return int(text)
    return key


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float (inf would turn logits into NaN: every draw the last token)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
