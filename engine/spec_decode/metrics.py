"""Speculative decoding counters (vLLM's names): drafts, proposed (draft) tokens, accepted
tokens, and acceptance per proposal position, summed since the engine started.

    mean acceptance length = 1 + accepted / drafts   (tokens emitted per verification step)
    acceptance rate        = accepted / proposed
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Position j: how many drafts had their proposal j + 1 accepted.
    accepted_per_pos: list[int] = field(default_factory=list)

    def reset(self) -> None:
        """Start counting afresh (a benchmark's timed run after its warm-up)."""
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = []

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """One request's verification: ``num_accepted`` of its ``num_proposed`` proposals (a
        prefix of them) were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_proposed:
            self.accepted_per_pos.extend([0] * (num_proposed - len(self.accepted_per_pos)))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "accepted_per_pos": list(self.accepted_per_pos),
        }
