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

The engine core (``LLMEngine``) updates the state each step; this module only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.request import Request
from engine.core.structured_output import StructuredOutputGrammar
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.worker.step_messages import LogprobsLists


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


def stop_holdback(params: SamplingParams) -> int:
    """Characters a delta keeps back while one of ``params.stop`` could still match."""
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
    )


def logprob_dicts(lists: LogprobsLists, texts: dict[int, str]) -> list[dict[int, Logprob]]:
    """Rows of (chosen, top-k...) as vLLM's dicts: token id -> Logprob(logprob, rank, text); the
    chosen token first, with its own rank, then the top-k ranked 1..k."""
    entries = []
    for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
        entry = {ids[0]: Logprob(lps[0], rank, texts.get(ids[0]))}
        for r, (token, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            entry.setdefault(token, Logprob(lp, r, texts.get(token)))
        entries.append(entry)
    return entries
