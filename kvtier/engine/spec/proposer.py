"""The proposer interfaces: guess up to k next tokens for each decoding request.

A `Proposer` looks at token ids only (n-gram). A `RequestProposer` keeps state per request
(a draft model's paged KV, the MTP layer's inputs): it proposes for the step's requests at
once, may set `Request.draft_probs` (its q, for the rejection rule), and is told when a
request's pages go back (`release`) and when the engine closes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

from kvtier.engine.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    from kvtier.engine.llm import LLM
    from kvtier.engine.request import Request


class Proposer(Protocol):
    """Guesses continuations; the target model verifies them, so a bad guess costs only compute."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `tokens` (the prompt then the output); [] for none."""
        ...


class RequestProposer(Protocol):
    """A proposer with per-request state; the engine calls propose_requests instead of propose."""

    def propose_requests(self, reqs: Sequence[Request], ks: Sequence[int]) -> None:
        """Set each r.draft (up to its k tokens) and, for a sampled request, r.draft_probs."""
        ...

    def release(self, req: Request) -> None: ...

    def close(self) -> None: ...


def make_proposer(config: SpeculativeConfig, target: LLM, seed: int = 0) -> Proposer | RequestProposer:
    if config.method == "ngram":
        from kvtier.engine.spec.ngram import NgramProposer
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        from kvtier.engine.spec.draft import DraftModelProposer
        assert config.model is not None
        return DraftModelProposer(config.model, target, seed=seed)
    if config.method == "mtp":
        from kvtier.engine.spec.mtp import MTPProposer
        return MTPProposer(target)
    raise AssertionError(config.method)     # SpeculativeConfig validated it
