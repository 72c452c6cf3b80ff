"""N-gram (prompt lookup) proposals over a request's prompt + output tokens.

For the sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
find the latest earlier position where the same n tokens ended, and propose the tokens that
followed it. Where that continuation runs into the end of the sequence the match is periodic
(the suffix repeats with period d = distance to the match), so it is extended with period d:
a model stuck in a loop gets full-length proposals.

Constant work per step: each request keeps an index {n-gram -> latest end position} that is
grown only over the tokens added since the last proposal (O(n_max^2) per new token), so no step
rescans the history. The index lives on the ``Request`` (``spec_state``) and dies with it.
"""

from __future__ import annotations

from engine.core.request import Request
from engine.spec_decode.config import SpeculativeConfig


class NgramIndex:
    """{n-gram -> the latest position t where it ended} for every n-gram whose continuation
    (token t + 1) exists; positions [0, num_indexed) are registered."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self.latest: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0

    def extend(self, tokens: list[int]) -> None:
        # An n-gram ending at t is registered once token t + 1 exists, so that a lookup of the
        # sequence's own suffix never finds itself.
        for t in range(self.num_indexed, len(tokens) - 1):
            for n in range(self.n_min, min(self.n_max, t + 1) + 1):
                self.latest[tuple(tokens[t - n + 1 : t + 1])] = t
        self.num_indexed = max(self.num_indexed, len(tokens) - 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self.extend(tokens)
        length = len(tokens)
        for n in range(min(self.n_max, length), self.n_min - 1, -1):
            t = self.latest.get(tuple(tokens[length - n :]))
            if t is None:
                continue
            period = length - 1 - t
            proposal = tokens[t + 1 : t + 1 + k]
            while len(proposal) < k:
                proposal.append(proposal[len(proposal) - period])
            return proposal
        return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def room(self, request: Request) -> int:
        """How many proposals ``request`` may verify next (the draft model's are cut to it)."""
        room = min(
            request.max_tokens - request.num_output_tokens,
            self.max_model_len - request.num_tokens,
        )
        return max(0, min(self.config.num_speculative_tokens, room - 1))

    def propose(self, request: Request) -> list[int]:
        """Up to ``num_speculative_tokens`` proposals for ``request``'s next tokens, never more
        than it may still generate (max_tokens, max_model_len) beyond the token verified with
        them."""
        k = self.room(request)
        if k <= 0:
            return []
        index = request.spec_state
        if not isinstance(index, NgramIndex):
            index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
            request.spec_state = index
        return index.propose(request.all_token_ids, k)
