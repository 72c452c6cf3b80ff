"""What a token-channel request's front (the replica) gets from its head: tallies, not outputs.
The tokens, text and logprobs go to the ingress's sink; the front only needs the first token's
time, every step's time and token count (latency metrics), each choice's finish (a timeout's
408) and the end. ``first_tally`` is sent at once; ``HeldTally`` collects the steps after it
and is sent, as ``last``, with the request's final delta (``cluster.serving.head_actor``).
"""

from __future__ import annotations

from engine.client.core_messages import ChoiceDelta, RequestDelta


class HeldTally:
    """What a sink request's front is owed since its first delta: each step's time and token
    count, and each choice's latest tally (its finish once it has one)."""

    __slots__ = ("choices", "steps")

    def __init__(self, first: RequestDelta) -> None:
        self.choices = {c.index: c for c in first.choices}
        self.steps: list[tuple[float, int]] = []

    def add(self, delta: RequestDelta, at: float) -> None:
        for choice in delta.choices:
            self.choices[choice.index] = _tally(choice)
        made = delta.num_new_tokens
        if made:
            self.steps.append((at, made))

    def last(self, delta: RequestDelta) -> RequestDelta:
        choices = [self.choices[i] for i in sorted(self.choices)]
        return RequestDelta(
            delta.request_id, choices, True, delta.num_cached_tokens, steps=self.steps
        )


def _tally(choice: ChoiceDelta) -> ChoiceDelta:
    """A choice's delta without its text, tokens and logprobs (those go to the sink)."""
    return ChoiceDelta(
        choice.index, "", [], None, choice.finish_reason, choice.stop_reason, choice.num_tokens,
        choice.cumulative_logprob,
    )  # fmt: skip


def first_tally(delta: RequestDelta, at: float) -> RequestDelta:
    """A sink request's first delta as its front gets it: the tallies, the prompt's logprobs
    (its ``StreamStart`` carries them) and the step's time and token count."""
    made = delta.num_new_tokens
    return RequestDelta(
        delta.request_id,
        [_tally(c) for c in delta.choices],
        delta.finished,
        delta.num_cached_tokens,
        prompt_logprobs=delta.prompt_logprobs,
        steps=[(at, made)] if made else [],
    )
