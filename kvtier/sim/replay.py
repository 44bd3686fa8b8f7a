"""Metadata-only replay: drive a BlockIndex (no payload) with a trace, through the same
calls, in the same order, as the store does for each request:

    n, _ = index.lookup(keys)                              # hits against the cache as it was
    index.acquire(keys[:n]); index.release(keys[:n])       # get(): refresh the prefix tail-first
    res = index.reserve(keys[n:], prefix=keys[:n], ...)    # put(): admit/insert new blocks
    index.commit(res)

so the hit ratio printed is the one a store with this policy and capacity gets. A
request with more new blocks than the tier holds reserves only its first `capacity`
new blocks (the ones nearest the prefix, which a later request can still use). A
capacity above the trace's unique blocks never evicts, so it runs as a cache of exactly
the unique blocks (an infinite cache; kvtier.sim.capacity.effective_blocks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvtier.errors import ConfigError
from kvtier.index import BlockIndex
from kvtier.policies import EvictionPolicy, make_policy
from kvtier.sim.capacity import effective_blocks, fraction_blocks
from kvtier.traces.model import Request, Trace

Progress = Callable[[int], None]


@dataclass(slots=True)
class ReplayResult:
    """Counts of one (trace, policy, capacity) replay, and each request's prefix hits."""

    trace: str
    policy: str
    offline: bool
    capacity_blocks: int
    capacity_fraction: float
    requests: int = 0
    block_refs: int = 0
    prefix_hits: int = 0
    tokens: int = 0
    token_hits: int = 0
    evictions: int = 0
    rejected: int = 0
    hits: list[int] = field(default_factory=list)   # prefix hit blocks of each request

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hits / self.block_refs if self.block_refs else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.token_hits / self.tokens if self.tokens else 0.0

    def to_json(self) -> dict:
        return {"trace": self.trace, "policy": self.policy, "offline": self.offline,
                "capacity_blocks": self.capacity_blocks,
                "capacity_fraction": round(self.capacity_fraction, 6),
                "prefix_hit_ratio": round(self.prefix_hit_ratio, 6),
                "token_hit_ratio": round(self.token_hit_ratio, 6), "evictions": self.evictions}


def capacity_for(trace: Trace, fraction: float) -> int:
    """Blocks for `fraction` of the trace's unique blocks (see sim/capacity.py)."""
    return fraction_blocks(fraction, trace.unique_blocks)


def build_policy(name: str, trace: Trace, capacity_blocks: int) -> EvictionPolicy:
    """A registered policy by name, or "belady" built with the trace's future."""
    if name == "belady":
        from kvtier.policies.belady import BeladyPolicy
        return BeladyPolicy(capacity_blocks, [r.keys for r in trace.requests])
    return make_policy(name, capacity_blocks)


def serve(index: BlockIndex, req: Request, capacity_blocks: int, hit: int | None = None) -> int:
    """One request through `index` exactly as the store runs it; returns its prefix hit blocks.

    `hit` overrides the local lookup (the cluster's pooled mode counts peers' blocks too).
    """
    keys = req.keys
    n, _ = index.lookup(keys)
    if n:
        head = keys[:n]
        index.acquire(head)
        index.release(head)
    else:
        head = []
    if hit is not None and hit > n:
        n = hit                      # blocks n_local..hit came from peers: not stored here
        head = keys[:n]
    new = keys[n:]
    last = req.last_tokens
    if len(new) > capacity_blocks:
        new = new[:capacity_blocks]
        last = None                  # the partial tail is cut off: every kept block is full
    r = index.reserve(new, prefix=head, start=n, parent=keys[n - 1] if n else None, last_tokens=last)
    drop = r.unreachable()           # as the store's Mover.commit: blocks past a gap are not kept
    if drop.keys:
        index.drop_unreachable(drop)
    index.commit(r.without(drop))
    return n


def replay(trace: Trace, policy: str | EvictionPolicy, capacity_blocks: int,
           progress: Progress | None = None, progress_every: int = 256) -> ReplayResult:
    """Replay `trace` through a one-tier BlockIndex of `capacity_blocks` blocks (at most
    the trace's unique blocks: the result reports the blocks actually run)."""
    if capacity_blocks < 1:
        raise ConfigError(f"capacity must be at least one block, got {capacity_blocks}")
    capacity_blocks = effective_blocks(capacity_blocks, trace.unique_blocks)
    pol = build_policy(policy, trace, capacity_blocks) if isinstance(policy, str) else policy
    index = BlockIndex([("host", capacity_blocks)], policy=pol, block_tokens=trace.block_tokens,
                       allow_offline=True)
    bt = trace.block_tokens
    begin = pol.begin_request     # offline policies (Belady) follow the replay
    res = ReplayResult(trace.name, pol.name if isinstance(policy, EvictionPolicy) else policy, pol.offline,
                       capacity_blocks, capacity_blocks / max(1, trace.unique_blocks))
    hits = res.hits
    for i, req in enumerate(trace.requests):
        begin(i)
        n = serve(index, req, capacity_blocks)
        nk = len(req.keys)
        hits.append(n)
        res.block_refs += nk
        res.prefix_hits += n
        res.tokens += req.input_length
        res.token_hits += req.hit_tokens(n, bt)
        if progress is not None and i % progress_every == 0:
            progress(i)
    res.requests = len(trace.requests)
    ts = index.tiers[0]
    res.evictions = ts.counters.evicted
    res.rejected = ts.counters.rejected
    return res
