"""The proposer interface: given a request's tokens so far, guess up to k next tokens."""
from __future__ import annotations

from typing import Protocol, Sequence

from kvtier.engine.spec.config import SpeculativeConfig


class Proposer(Protocol):
    """Guesses continuations; the target model verifies them, so a bad guess costs only compute."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `tokens` (the prompt then the output); [] for none."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        from kvtier.engine.spec.ngram import NgramProposer
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise AssertionError(config.method)     # SpeculativeConfig validated it
