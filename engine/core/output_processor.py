"""The head's per-request output state and the ``RequestOutput``s built from it.

One role: what a request has produced (its samples' tokens, detokenized text, logprobs) and how
it is handed out, as the request's ``SamplingParams.output_kind`` asks:

- ``CUMULATIVE``: every output holds everything so far (copies that grow with the output);
- ``DELTA``: each output holds only what is new since the last one, so the per-step cost stays
  constant however long the output grows. A sample's text within ``max(len(stop)) - 1``
  characters of its end is held back while a stop string could still match it, so the
  concatenated deltas are exactly the final text; a sample with new tokens but no new text (an
  incomplete UTF-8 character, a special token) still gets a delta. Prompt logprobs come once,
  with the first output;
- ``FINAL_ONLY``: one output, the whole result, when every sample has finished.

Each step the engine core (``LLMEngine``) hands this module the step's tokens: ``take_tokens``
detokenizes a sample's new ones (one at a time when several, dropping those after a completed
stop string) and records their logprobs (their texts as vLLM's: ``LogprobTexts``);
``record_prompt_logprobs`` fills the prompt's; the engine finishes the requests and then builds
the outputs here (``make_request_output``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.request import Request, RequestStatus
from engine.core.structured_output import StructuredOutputGrammar
from engine.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.worker.step_messages import LogprobsLists, ModelRunnerOutput, PromptLogprobs


@dataclass
class SampleState:
    """Head-side state of one of a request's n samples, beside its scheduler ``Request``, and
    how much of it the last ``DELTA`` output handed out."""

    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    # Structured outputs: this sample's matcher, dropped when the sample finishes.
    grammar: StructuredOutputGrammar | None = None
    # DELTA: characters of text kept back while a stop string could still match.
    holdback: int = 0
    sent_text: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False


@dataclass
class RequestGroup:
    """A user request: its prompt, its n samples, and its prompt logprobs (position -> dict)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)


@dataclass
class PoolingState:
    """Head-side state of a pooling request: its scheduler ``Request`` and its prompt text."""

    request: Request
    prompt: str | None


def new_sample_state(request: Request, tokenizer: Any) -> SampleState:
    """A new sample's output state: its detokenizer (stop strings included) and logprob lists."""
    params = request.sampling_params
    detokenizer = IncrementalDetokenizer(
        tokenizer,
        request.prompt_token_ids,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        stop=params.stop,
        include_stop_str_in_output=params.include_stop_str_in_output,
        min_tokens=params.min_tokens,
        detokenize=params.detokenize,
    )
    wants_logprobs = params.logprobs is not None
    return SampleState(
        request=request,
        detokenizer=detokenizer,
        logprobs=[] if wants_logprobs else None,
        cumulative_logprob=0.0 if wants_logprobs else None,
        holdback=stop_holdback(params),
    )


def stop_holdback(params: SamplingParams) -> int:
    """Characters a delta keeps back while one of ``params.stop`` could still match: none
    with ``include_stop_str_in_output``, where a match cuts nothing already sent (vLLM's
    ``stop_buffer_length``)."""
    if params.include_stop_str_in_output:
        return 0
    return max((len(s) for s in params.stop or ()), default=1) - 1


def make_request_output(group: RequestGroup) -> RequestOutput | None:
    """The group's output as its ``output_kind`` asks; None when there is nothing to hand out
    (``FINAL_ONLY`` before the end, or a ``DELTA`` with nothing new)."""
    kind = group.params.output_kind
    if kind == RequestOutputKind.DELTA:
        return _delta_output(group)
    if kind == RequestOutputKind.FINAL_ONLY and not group.finished:
        return None
    return _cumulative_output(group)


def _cumulative_output(group: RequestGroup) -> RequestOutput:
    completions = [
        CompletionOutput(
            index=i,
            text=sample.detokenizer.output_text,
            token_ids=list(sample.request.output_token_ids),
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
            finish_reason=sample.request.status.finish_reason,
            stop_reason=sample.request.stop_reason,
        )
        for i, sample in enumerate(group.samples)
    ]
    prompt_logprobs = None
    if group.prompt_logprobs is not None:
        prompt_logprobs = list(group.prompt_logprobs)
    return _request_output(group, completions, prompt_logprobs)


def _delta_output(group: RequestGroup) -> RequestOutput | None:
    completions = []
    for i, sample in enumerate(group.samples):
        completion = _sample_delta(i, sample)
        if completion is not None:
            completions.append(completion)
    finished = group.finished
    if not (completions or finished):
        return None
    prompt_logprobs = None
    if group.prompt_logprobs is not None and not group.sent_prompt_logprobs:
        prompt_logprobs, group.sent_prompt_logprobs = list(group.prompt_logprobs), True
    return _request_output(group, completions, prompt_logprobs)


def _sample_delta(index: int, sample: SampleState) -> CompletionOutput | None:
    request = sample.request
    finished = request.is_finished
    detokenizer = sample.detokenizer
    length = detokenizer.text_length
    end = length if finished else max(sample.sent_text, length - sample.holdback)
    tokens = request.output_token_ids
    num_tokens = len(tokens)
    finishing = finished and not sample.sent_finish
    if not (end > sample.sent_text or num_tokens > sample.sent_tokens or finishing):
        return None
    logprobs = None
    if sample.logprobs is not None:
        logprobs = sample.logprobs[sample.sent_tokens :]
    completion = CompletionOutput(
        index=index,
        text=detokenizer.text_between(sample.sent_text, end),
        token_ids=tokens[sample.sent_tokens :],
        cumulative_logprob=sample.cumulative_logprob,
        logprobs=logprobs,
        finish_reason=request.status.finish_reason if finishing else None,
        stop_reason=request.stop_reason if finishing else None,
    )
    sample.sent_text, sample.sent_tokens, sample.sent_finish = end, num_tokens, finished
    return completion


def _request_output(
    group: RequestGroup,
    completions: list[CompletionOutput],
    prompt_logprobs: list[dict[int, Logprob] | None] | None,
) -> RequestOutput:
    first = group.samples[0].request
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        outputs=completions,
        finished=group.finished,
        num_cached_tokens=max(first.num_cached_tokens, 0),
        prompt_logprobs=prompt_logprobs,
        kv_transfer_params=first.kv_transfer_params if group.finished else None,
    )


def logprob_dicts(
    lists: LogprobsLists, texts: LogprobTexts | None, context: list[int]
) -> list[dict[int, Logprob]]:
    """Rows of (chosen, top-k...) as vLLM's dicts: token id -> Logprob(logprob, rank, text); the
    chosen token first, with its own rank, then the top-k ranked 1..k. ``context``: the chosen
    tokens before the first row (each row's chosen token is the next row's context). ``texts``
    None (``detokenize=False``): no texts (None)."""
    entries = []
    context = context[-MAX_UTF8_CONTEXT:]

    def text(token: int) -> str | None:
        return texts.text(token, context) if texts is not None else None

    for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
        entry = {ids[0]: Logprob(lps[0], rank, text(ids[0]))}
        for r, (token, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            if token not in entry:
                entry[token] = Logprob(lp, r, text(token))
        entries.append(entry)
        context = [*context, ids[0]][-MAX_UTF8_CONTEXT:]
    return entries


def take_tokens(
    sample: SampleState, num_new: int, logprobs: LogprobsLists | None, texts: LogprobTexts
) -> bool:
    """Take the ``num_new`` tokens the sample's request got this step into its output state:
    their text (``_detokenize``) and, when asked for, their logprobs (``texts``: the step's
    ``decode_logprob_tokens``). True when a stop string completed: the caller stops the
    request."""
    request = sample.request
    num_before = request.num_output_tokens - num_new
    if logprobs is None or sample.logprobs is None:
        return _detokenize(sample, num_new)
    # The tokens before this step's (their texts finish a character this step's may end).
    context = request.output_token_ids[max(0, num_before - MAX_UTF8_CONTEXT) : num_before]
    stopped = _detokenize(sample, num_new)
    # A verified run cut by a stop keeps the rows of the tokens it kept.
    kept = request.num_output_tokens - num_before
    row_texts = texts if sample.detokenizer.detokenize else None
    sample.logprobs.extend(logprob_dicts(logprobs, row_texts, context)[:kept])
    sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + sum(
        lps[0] for lps in logprobs.logprobs[:kept]
    )
    return stopped


def _detokenize(sample: SampleState, num_new: int) -> bool:
    """Feed the step's tokens to the detokenizer; True on a stop string. Several tokens
    (verified speculative ones) go one at a time, and those after the token that completed
    a stop string are dropped, as one-token steps would never have sampled them."""
    request, detok = sample.request, sample.detokenizer
    new = request.output_token_ids[-num_new:]
    if _stopped_by_token(request):
        new = new[:-1]
    if len(new) <= 1:
        return detok.update(new)
    for i, token in enumerate(new):
        if detok.update([token]):
            request.truncate_output(request.num_output_tokens - num_new + i + 1)
            return True
    return False


def _stopped_by_token(request: Request) -> bool:
    """The request just ended on a stop token (EOS, one of ``stop_token_ids``, or the stop
    token that completed its grammar): as in vLLM, that token's text is not part of the output
    unless ``include_stop_str_in_output`` (it shows only with ``skip_special_tokens=False`` or
    a stop token that is not special: a chat parser reading special tokens never sees the
    ``<|return|>`` or ``</s>`` that ended the answer)."""
    if request.status != RequestStatus.FINISHED_STOPPED:
        return False
    params = request.sampling_params
    last = request.output_token_ids[-1]
    stop_ids = params.stop_token_ids or ()
    return not params.include_stop_str_in_output and (
        last in request.eos_token_ids or last in stop_ids
    )


# A UTF-8 character is at most 4 bytes: the tokens that end one are among the last 4 before.
MAX_UTF8_CONTEXT = 4
_REPLACEMENT = "\ufffd"


class LogprobTexts:
    """The ``decoded_token`` of each token in a step's logprobs, as vLLM gives it: the token's
    own text, except for a token that ends inside a UTF-8 character (a byte of a byte-level or
    byte-fallback vocabulary), which decodes alone to U+FFFD. Such a token's text is "" while
    its character is unfinished, and the token that finishes it carries the whole character
    (what it decodes to after the tokens before it, less their own text), so the texts (and
    their UTF-8 ``bytes``) of the chosen tokens join into the output's text."""

    def __init__(self, tokenizer: Any, texts: dict[int, str]) -> None:
        self._tokenizer = tokenizer
        self._texts = texts  # token id -> its text decoded alone (``_with_leading_spaces``)

    def text(self, token_id: int, context: list[int]) -> str:
        """The text of ``token_id`` after the chosen tokens ``context`` (at most the last
        ``MAX_UTF8_CONTEXT``)."""
        alone = self._alone(token_id)
        if not alone.endswith(_REPLACEMENT):
            return alone
        for size in range(1, len(context) + 1):
            before = context[-size:]
            whole = self._decode([*before, token_id])
            if whole.endswith(_REPLACEMENT):
                continue
            # The context tokens that end inside this character gave "" when they came: their
            # bytes are in this token's text. The text of the tokens before them is not.
            clean = len(before)
            while clean > 0 and self._alone(before[clean - 1]).endswith(_REPLACEMENT):
                clean -= 1
            prefix = self._decode(before[:clean]) if clean else ""
            common = next((i for i, (a, b) in enumerate(zip(prefix, whole)) if a != b),
                          min(len(prefix), len(whole)))  # fmt: skip
            return whole[common:]
        return ""

    def _alone(self, token_id: int) -> str:
        if token_id not in self._texts:
            text = self._decode([token_id])
            self._texts[token_id] = _with_leading_spaces(self._tokenizer, [token_id], [text])[0]
        return self._texts[token_id]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.backend_tokenizer.decode(token_ids, skip_special_tokens=False)


def decode_logprob_tokens(tokenizer: Any, output: ModelRunnerOutput) -> LogprobTexts:
    """Text of every token id in this step's logprobs (sampled and prompt), decoded in one
    batch."""
    rows = [row for lists in output.logprobs or () if lists for row in lists.token_ids]
    rows += [row for chunk in output.prompt_logprobs.values() for row in chunk.lists.token_ids]
    if not rows:
        return LogprobTexts(tokenizer, {})
    unique = sorted({t for row in rows for t in row})
    texts = tokenizer.backend_tokenizer.decode_batch(
        [[t] for t in unique], skip_special_tokens=False
    )
    texts = _with_leading_spaces(tokenizer, unique, texts)
    return LogprobTexts(tokenizer, dict(zip(unique, texts)))


_SPACE_MARKER_ATTR = "_llm_cluster_space_marker"


def _space_marker(tokenizer: Any) -> str | None:
    """The replacement character of the tokenizer's Metaspace pre-tokenizer (``▁``), or None:
    only there does a token decoded alone lose the leading space its piece stands for."""
    marker = getattr(tokenizer, _SPACE_MARKER_ATTR, False)
    if marker is not False:
        return marker
    marker = None
    try:
        pre = json.loads(tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    except Exception:  # a tokenizer that cannot say: no marker
        pre = {}
    subs = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
    for sub in subs:
        if sub.get("type") == "Metaspace":
            marker = sub.get("replacement", "\u2581")
            break
    with contextlib.suppress(AttributeError):
        setattr(tokenizer, _SPACE_MARKER_ATTR, marker)
    return marker


def _with_leading_spaces(tokenizer: Any, token_ids: list[int], texts: list[str]) -> list[str]:
    """``texts`` (each token decoded alone) with the leading spaces a Metaspace decoder strips
    from the first token put back, one per leading ``▁`` of the token's piece (as vLLM's
    ``convert_ids_list_to_tokens``): ``▁he`` reads " he", as it does within a text."""
    marker = _space_marker(tokenizer)
    if marker is None:
        return texts
    out = []
    for piece, text in zip(tokenizer.convert_ids_to_tokens(token_ids), texts):
        wanted = len(piece or "") - len((piece or "").lstrip(marker))
        missing = wanted - (len(text) - len(text.lstrip(" ")))
        out.append(" " * missing + text if missing > 0 else text)
    return out


def record_prompt_logprobs(
    samples: Mapping[str, tuple[RequestGroup, int]],
    chunks: dict[str, PromptLogprobs],
    texts: LogprobTexts,
) -> None:
    """The prompt logprobs a step computed (``chunks``, by request id; a chunked prefill's
    part at a time) into their groups (``samples``: request id to its group and index). As in
    vLLM, a prompt token's text reads the prompt tokens before it from the second on."""
    for rid, chunk in chunks.items():
        group = samples[rid][0] if rid in samples else None
        if group is None or group.prompt_logprobs is None:
            continue
        start = chunk.start
        context = group.prompt_token_ids[max(1, start - MAX_UTF8_CONTEXT) : start]
        chunk_texts = texts if group.params.detokenize else None
        for offset, entry in enumerate(logprob_dicts(chunk.lists, chunk_texts, context)):
            group.prompt_logprobs[start + offset] = entry


def pooling_output(state: PoolingState, vector: list[float] | None) -> PoolingRequestOutput:
    """A pooling request's one output: its vector, or None when it ended without one."""
    request = state.request
    return PoolingRequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        outputs=PoolingOutput(vector) if vector is not None else None,
        finished=True,
        prompt=state.prompt,
        finish_reason=request.status.finish_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
    )
