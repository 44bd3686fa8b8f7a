"""A cluster of N nodes, each with its own cache (a BlockIndex, no payload), behind a
router. Per router: the cluster-wide prefix hit ratio and the load balance, max/mean
of tokens computed (prompt tokens that missed) per node.

Routers:
- random, round-robin: ignore the cache;
- session: a request's `session` when the trace has one, else a hash of its leading
  blocks (xxh64, never Python's hash());
- kv-aware: the node with the longest cached prefix (ties: the least loaded);
- pooled: any node can fetch any node's blocks (hits are the prefix cached anywhere),
  requests go round-robin: the hit-ratio ceiling of N separate caches;
- token-aware (ours): the longest cached prefix among nodes whose computed tokens,
  after taking this request, stay within `slack` of the lightest node's plus the
  request; otherwise the node that finishes lightest. It trades a little hit ratio for
  balance where prefix routing would pile shared-root traffic on one node;
- dynamo, sglang: the published rules `kvtier router` also implements
  (kvtier/router/rules.py, the same functions): Dynamo's cost = w * uncached prefill blocks
  + load blocks (w = 1), and SGLang's cache-aware rule (the least loaded if the load gap
  exceeds 64 tokens and 1.5x, else the longest prefix if it covers at least half the
  prompt, else the least loaded).

Load here is tokens computed so far per node (the simulator has no clock), so "outstanding
prefill" in the live rules is its cumulative total here: a balance proxy, not a queue.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import xxhash

from kvtier.errors import ConfigError
from kvtier.index import BlockIndex
from kvtier.sim.capacity import effective_blocks
from kvtier.sim.replay import serve
from kvtier.traces.model import Request, Trace

ROUTERS = ("random", "round-robin", "session", "kv-aware", "pooled", "token-aware", "dynamo", "sglang")
SESSION_PREFIX_BLOCKS = 4   # leading blocks that stand for a session when the trace has none


@dataclass(slots=True)
class ClusterResult:
    trace: str
    router: str
    nodes: int
    capacity_blocks: int                      # per node
    block_refs: int = 0
    prefix_hits: int = 0
    computed: list[int] = field(default_factory=list)   # tokens computed per node

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hits / self.block_refs if self.block_refs else 0.0

    @property
    def load_imbalance(self) -> float:
        mean = sum(self.computed) / len(self.computed)
        return max(self.computed) / mean if mean else 1.0

    def to_json(self) -> dict:
        return {"trace": self.trace, "router": self.router, "nodes": self.nodes,
                "capacity_blocks": self.capacity_blocks,
                "prefix_hit_ratio": round(self.prefix_hit_ratio, 6),
                "load_imbalance": round(self.load_imbalance, 4)}


def _stable_hash(req: Request) -> int:
    if req.session is not None:
        return xxhash.xxh64_intdigest(req.session.encode())
    lead = ",".join(map(str, req.keys[:SESSION_PREFIX_BLOCKS])).encode()
    return xxhash.xxh64_intdigest(lead)


def simulate(trace: Trace, router: str, nodes: int, capacity_blocks: int, policy: str = "lru",
             seed: int = 0, slack: float = 0.05,
             progress: Callable[[int], None] | None = None) -> ClusterResult:
    """Replay `trace` over `nodes` caches of `capacity_blocks` blocks each, routed by `router`.

    `progress(i)`, when given, is called with the requests done so far, more often the more
    nodes there are (a request on 4,096 nodes asks every node's cache: minutes for a trace)."""
    if router not in ROUTERS:
        raise ConfigError(f"unknown router {router!r}; choose from {', '.join(ROUTERS)} or 'all'")
    if nodes < 1 or capacity_blocks < 1:
        raise ConfigError("a cluster needs at least one node of at least one block")
    capacity_blocks = effective_blocks(capacity_blocks, trace.unique_blocks)   # more never evicts
    idx = [BlockIndex([("host", capacity_blocks)], policy=policy, block_tokens=trace.block_tokens)
           for _ in range(nodes)]
    res = ClusterResult(trace.name, router, nodes, capacity_blocks, computed=[0] * nodes)
    load = res.computed
    rng = random.Random(seed)
    bt = trace.block_tokens
    every = progress_every(nodes)
    for i, req in enumerate(trace.requests):
        if progress is not None and i % every == 0:
            progress(i)
        keys = req.keys
        hit = None
        if router == "random":
            node = rng.randrange(nodes)
        elif router == "round-robin" or router == "pooled":
            node = i % nodes
        elif router == "session":
            node = _stable_hash(req) % nodes
        else:
            pref = [ix.lookup(keys)[0] for ix in idx]
            if router == "kv-aware":
                node = max(range(nodes), key=lambda j: (pref[j], -load[j]))
            elif router in ("dynamo", "sglang"):
                node = _published(router, req, pref, load, bt)
            else:
                node = _token_aware(req, pref, load, bt, slack)
        if router == "pooled":
            hit = _pooled_prefix(idx, keys)
        n = serve(idx[node], req, capacity_blocks, hit)
        res.block_refs += len(keys)
        res.prefix_hits += n
        load[node] += req.input_length - req.hit_tokens(n, bt)
    return res


def progress_every(nodes: int) -> int:
    """Requests between two progress calls: about 256 node lookups' worth, at least one request."""
    return max(1, 256 // nodes)


def _token_aware(req: Request, pref: list[int], load: list[int], bt: int, slack: float) -> int:
    """Longest cached prefix among nodes that stay balanced after computing this request."""
    cost = [req.input_length - req.hit_tokens(p, bt) for p in pref]
    after = [l + c for l, c in zip(load, cost)]
    lightest = min(after)
    # A node qualifies if taking the request keeps it within `slack` of the mean load
    # plus the lightest option's: greedy in hits, bounded in imbalance.
    mean = (sum(load) + req.input_length) / len(load)
    ok = [j for j in range(len(load)) if after[j] <= max(lightest, (1.0 + slack) * mean)]
    return max(ok, key=lambda j: (pref[j], -after[j]))


def _published(rule: str, req: Request, pref: list[int], load: list[int], bt: int) -> int:
    """The live router's rule (kvtier/router/rules.py) over the simulated nodes."""
    from kvtier.router.rules import Ask, Candidate, choose

    cands = [Candidate(str(j), prefix_tokens=req.hit_tokens(p, bt), prefill_tokens=l)
             for j, (p, l) in enumerate(zip(pref, load))]
    return int(choose(cands, Ask(req.input_length, bt), rule).name)


def _pooled_prefix(idx: list[BlockIndex], keys) -> int:
    """Leading blocks cached on some node; peers' blocks are refreshed where they live."""
    n = 0
    owners = []
    for k in keys:
        for j, ix in enumerate(idx):
            if k in ix.ready:
                owners.append(j)
                break
        else:
            break
        n += 1
    for j, ix in enumerate(idx):
        mine = [keys[b] for b in range(n) if owners[b] == j]
        if mine:
            ix.touch(mine)
    return n
