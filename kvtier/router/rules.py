"""Which worker takes a request: the routing rules, as pure functions (unit-tested, and the
same rules the cluster simulator compares: kvtier/sim/cluster.py).

Every rule sees, per candidate worker, the request's tokens it would have to compute
(`uncached`: the prompt minus the prefix that worker is believed to hold), the prefill
tokens it already has outstanding, and the KV blocks its running decodes hold. Load is
measured in tokens (blocks x block_tokens for decodes):

- dynamo (NVIDIA Dynamo's KV router): cost = w * prefill blocks (outstanding + this
  request's uncached) + decode blocks, w = 1; the cheapest worker.
- sglang (SGLang's cache-aware router): if the load gap between the busiest and the
  lightest worker exceeds 64 tokens and 1.5x, the least loaded; else the worker with the
  longest cached prefix if it covers at least half the prompt, else the least loaded.
- kvtier (this project's token-aware rule, as in the simulator): the longest cached prefix
  among workers whose load after taking the request stays within `slack` (5 %) of the mean
  load after it, or at the lightest; ties go to the lighter.

Session affinity (`x-session-affinity`): the session's last worker keeps it while its cost
is within AFFINITY_RATIO x the best cost + AFFINITY_SLACK tokens; otherwise the rule picks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

POLICIES = ("kvtier", "dynamo", "sglang")
DYNAMO_WEIGHT = 1.0
SGLANG_ABS_GAP = 64          # tokens
SGLANG_REL_GAP = 1.5
SGLANG_CACHE_THRESHOLD = 0.5
KVTIER_SLACK = 0.05
AFFINITY_RATIO = 1.5
AFFINITY_SLACK = 2048        # tokens


@dataclass
class Candidate:
    """One worker as the rule sees it."""

    name: str
    prefix_tokens: int = 0         # of this request's prompt, believed cached there
    prefill_tokens: int = 0        # outstanding prefill work (tokens not computed yet)
    decode_blocks: int = 0         # KV blocks held by its running requests

    def load(self, block_tokens: int) -> int:
        return self.prefill_tokens + self.decode_blocks * block_tokens


@dataclass
class Ask:
    """The request: its prompt tokens (estimated), and the block size."""

    prompt_tokens: int
    block_tokens: int = 16
    session_worker: str | None = None    # where x-session-affinity says its prefix is


def uncached(c: Candidate, ask: Ask) -> int:
    return max(0, ask.prompt_tokens - c.prefix_tokens)


def cost(c: Candidate, ask: Ask, policy: str = "dynamo") -> float:
    """A worker's cost for taking the request, in tokens (lower is better); the affinity bound uses it."""
    bt = ask.block_tokens
    if policy == "dynamo":
        return (DYNAMO_WEIGHT * -(-(c.prefill_tokens + uncached(c, ask)) // bt) + c.decode_blocks) * bt
    return c.load(bt) + uncached(c, ask)


def choose(cands: Sequence[Candidate], ask: Ask, policy: str = "kvtier") -> Candidate:
    """The worker the rule picks (the first of equals, so the order breaks ties)."""
    if not cands:
        raise ValueError("no worker to choose from")
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; choose from {', '.join(POLICIES)}")
    if ask.session_worker is not None:
        mine = [c for c in cands if c.name == ask.session_worker]
        best = min(cost(c, ask, policy) for c in cands)
        if mine and cost(mine[0], ask, policy) <= AFFINITY_RATIO * best + AFFINITY_SLACK:
            return mine[0]
    return _RULES[policy](cands, ask)


def _dynamo(cands: Sequence[Candidate], ask: Ask) -> Candidate:
    return min(cands, key=lambda c: cost(c, ask, "dynamo"))


def _sglang(cands: Sequence[Candidate], ask: Ask) -> Candidate:
    bt = ask.block_tokens
    loads = [c.load(bt) for c in cands]
    lightest = min(cands, key=lambda c: c.load(bt))
    if max(loads) - min(loads) > SGLANG_ABS_GAP and max(loads) > SGLANG_REL_GAP * min(loads):
        return lightest
    best = max(cands, key=lambda c: c.prefix_tokens)
    if ask.prompt_tokens and best.prefix_tokens / ask.prompt_tokens >= SGLANG_CACHE_THRESHOLD:
        return best
    return lightest


def _kvtier(cands: Sequence[Candidate], ask: Ask) -> Candidate:
    bt = ask.block_tokens
    after = [c.load(bt) + uncached(c, ask) for c in cands]
    lightest = min(after)
    mean = (sum(c.load(bt) for c in cands) + ask.prompt_tokens) / len(cands)
    ok = [i for i in range(len(cands)) if after[i] <= max(lightest, (1.0 + KVTIER_SLACK) * mean)]
    return cands[max(ok, key=lambda i: (cands[i].prefix_tokens, -after[i], -i))]


_RULES = {"dynamo": _dynamo, "sglang": _sglang, "kvtier": _kvtier}
