"""Speculative decoding for the reference engine: a proposer guesses the next k tokens, one
forward verifies them all, and only accepted tokens' KV ever reaches the store.

    config.py    SpeculativeConfig: method, num_speculative_tokens, prompt_lookup_min/max, model
    proposer.py  the Proposer / RequestProposer interfaces and make_proposer(config, target)
    ngram.py     NgramProposer: prompt lookup over the prompt and the output so far
    draft.py     DraftModelProposer: a smaller model on its own paged KV (its own kvtier store)
    mtp.py       MTPProposer: DeepSeek-V3's next-token-prediction layer, its KV in the target's pages
    verify.py    greedy acceptance and speculative sampling with the draft's q (output = target distribution)
    stats.py     SpecStats: drafts, draft tokens, accepted tokens (per position), mean acceptance length
"""
from __future__ import annotations

from kvtier.engine.spec.config import SpeculativeConfig
from kvtier.engine.spec.proposer import Proposer, make_proposer
from kvtier.engine.spec.stats import SpecStats

__all__ = ["SpeculativeConfig", "Proposer", "make_proposer", "SpecStats"]
