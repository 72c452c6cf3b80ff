"""Beam search on top of the engine, outside the core scheduler (as vLLM's ``LLM.beam_search``).

Each step, every live beam of every prompt becomes one ordinary engine request: its prompt is
the original prompt plus the beam's tokens, ``max_tokens=1``, greedy, with ``logprobs =
min(2 * beam_width, vocab)`` so that each beam proposes its best continuations with their raw
log-probabilities. Candidates (beam + token, cumulative logprob + logprob) are ranked by
``score = cumulative_logprob / generated_len ** length_penalty``; the best ``beam_width`` are
kept, and those ending in EOS (unless ``ignore_eos``) move to the finished set. After
``max_tokens`` steps the live beams join the finished set and the ``n`` best are returned.

Sharing: the engine's prefix cache does the work of a beam tree. After a step's requests finish,
their full KV blocks stay cached (free but reusable, chained-hash keyed by the token prefix), so
the next step's request of a beam extending them hits every full block of the prompt and of the
beam's own history, and computes only the tail since its last full block. Beams that descend
from one parent share the parent's blocks, exactly as a copy-on-write beam tree would.

The driver owns the engine while it runs: it steps it until its own requests finish, so it must
not share an ``LLMEngine`` with requests someone else is waiting on.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from engine.core.llm_engine import LLMEngine, PromptType
from engine.errors import InvalidRequestError
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams

_ids = itertools.count()


@dataclass
class Beam:
    token_ids: list[int]  # generated tokens
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finished: bool = False  # ended in EOS


@dataclass
class _Search:
    prompt: str | None
    prompt_token_ids: list[int]
    max_tokens: int
    live: list[Beam]
    done: list[Beam] = field(default_factory=list)


def beam_score(beam: Beam, length_penalty: float) -> float:
    """Cumulative logprob normalized by generated length ** length_penalty (HF / vLLM style;
    the EOS token does not count toward the length)."""
    length = max(1, len(beam.token_ids) - int(beam.finished))
    return beam.cumulative_logprob / (length**length_penalty)


def beam_search(
    engine: LLMEngine, prompts: list[PromptType], params: SamplingParams
) -> list[RequestOutput]:
    """Run beam search for every prompt; one ``RequestOutput`` per prompt with ``params.n``
    completions, best first. Raises ``InvalidRequestError`` before running anything."""
    width = params.num_beams
    vocab = engine.config.model.vocab_size
    num_logprobs = min(2 * width, vocab)
    if num_logprobs > engine.config.sampling.max_logprobs:
        raise InvalidRequestError(
            f"needs {num_logprobs} logprobs per step (2 * beam_width), above the server's "
            f"max_logprobs ({engine.config.sampling.max_logprobs})",
            param="beam_width",
        )
    searches = []
    for prompt in prompts:
        if isinstance(prompt, dict) and (
            prompt.get("multi_modal_data") or prompt.get("mm_features")
        ):
            # Each beam step is a new request of token ids: the images would be lost.
            raise InvalidRequestError("beam search does not take images", param="multi_modal_data")
        text, token_ids = engine.inputs.tokenize(prompt)
        max_tokens = engine.inputs.check_lengths(token_ids, params)
        searches.append(_Search(text, token_ids, max_tokens, live=[Beam([])]))
    step_params = SamplingParams(
        temperature=0,
        max_tokens=1,
        logprobs=num_logprobs,
        ignore_eos=True,
        skip_special_tokens=params.skip_special_tokens,
    )
    for step in range(max(s.max_tokens for s in searches)):
        active = [s for s in searches if s.live and step < s.max_tokens]
        if not active:
            break
        proposals = _expand(engine, active, step_params)
        for search in active:
            _select(search, proposals, engine, params)
    return [_output(engine, s, params) for s in searches]


def _expand(
    engine: LLMEngine, searches: list[_Search], step_params: SamplingParams
) -> dict[int, dict[int, Logprob]]:
    """One engine request per live beam; id(beam) -> its next-token logprobs."""
    pending: dict[str, Beam] = {}
    for search in searches:
        for beam in search.live:
            rid = f"beam-{next(_ids)}"
            engine.add_request(
                rid, {"prompt_token_ids": search.prompt_token_ids + beam.token_ids}, step_params
            )
            pending[rid] = beam
    proposals: dict[int, dict[int, Logprob]] = {}
    while len(proposals) < len(pending):
        for out in engine.step():
            if out.finished and out.request_id in pending:
                logprobs = out.outputs[0].logprobs
                if not logprobs:
                    raise RuntimeError(f"beam request {out.request_id} returned no logprobs")
                proposals[id(pending[out.request_id])] = logprobs[0]
    return proposals


def _select(
    search: _Search,
    proposals: dict[int, dict[int, Logprob]],
    engine: LLMEngine,
    params: SamplingParams,
) -> None:
    candidates = []
    for beam in search.live:
        for token, lp in proposals[id(beam)].items():
            candidates.append(
                Beam(
                    token_ids=[*beam.token_ids, token],
                    cumulative_logprob=beam.cumulative_logprob + lp.logprob,
                    logprobs=[*beam.logprobs, {token: lp}],
                    finished=not params.ignore_eos and token in engine.eos_token_ids,
                )
            )
    candidates.sort(key=lambda b: beam_score(b, params.length_penalty), reverse=True)
    kept = candidates[: params.num_beams]
    search.done.extend(b for b in kept if b.finished)
    search.live = [b for b in kept if not b.finished]


def _output(engine: LLMEngine, search: _Search, params: SamplingParams) -> RequestOutput:
    beams = sorted(
        search.done + search.live,
        key=lambda b: beam_score(b, params.length_penalty),
        reverse=True,
    )[: params.n]
    tokenizer = engine.tokenizer
    completions = [
        CompletionOutput(
            index=i,
            text=tokenizer.decode(b.token_ids, skip_special_tokens=params.skip_special_tokens),
            token_ids=b.token_ids,
            cumulative_logprob=b.cumulative_logprob,
            logprobs=b.logprobs if params.logprobs is not None else None,
            finish_reason="stop" if b.finished else "length",
        )
        for i, b in enumerate(beams)
    ]
    return RequestOutput(
        request_id=f"beam-search-{next(_ids)}",
        prompt=search.prompt,
        prompt_token_ids=search.prompt_token_ids,
        outputs=completions,
        finished=True,
    )
