"""Speculation counters, as vLLM reports them: drafts, draft tokens, accepted tokens (per position)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    drafts: int = 0                         # verify steps that had at least one draft token
    draft_tokens: int = 0                   # tokens proposed
    accepted_tokens: int = 0                # proposed tokens the target accepted
    accepted_per_position: list[int] = field(default_factory=list)   # [i]: drafts whose token i was accepted

    def record(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step: 1 (the target's own token) + accepted drafts per draft."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_rate": self.acceptance_rate}
