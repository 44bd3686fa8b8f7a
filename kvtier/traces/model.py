"""What a replay needs of a trace: per request, its block keys in prefix order.

Both trace formats reduce to this, so the replay, the cluster simulation and the
generator share one representation. Keys are whatever the format gives (Mooncake's
integer hash ids, or kvtier's own 16-byte block keys for token-level traces): the
BlockIndex is key-type agnostic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence
from kvtier.ids import IndexKey as Key


@dataclass(slots=True)
class Request:
    """One prompt: its block keys (prefix-chained) and what the replay counts."""

    keys: Sequence[Key]
    input_length: int               # prompt tokens
    output_length: int = 0
    timestamp: float = 0.0          # milliseconds since the trace start
    session: str | None = None      # conversation/agent session, when the trace has one
    last_tokens: int | None = None  # tokens in the last keyed block when it is partial

    def hit_tokens(self, hit_blocks: int, block_tokens: int) -> int:
        """Prompt tokens in the first `hit_blocks` blocks: what a prefix hit of that many
        blocks saves. Tokens after the last keyed block (a token-level trace's partial
        tail) are never cached, so they never count."""
        if hit_blocks <= 0:
            return 0
        if hit_blocks == len(self.keys) and self.last_tokens is not None:
            return (hit_blocks - 1) * block_tokens + self.last_tokens
        return min(self.input_length, hit_blocks * block_tokens)


@dataclass(slots=True)
class Trace:
    """A named sequence of requests keyed at `block_tokens` tokens a block."""

    name: str
    requests: list[Request]
    block_tokens: int
    format: str = "mooncake"        # "mooncake", "tokens" or "synthetic"
    path: str | None = None
    _unique: int | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def block_refs(self) -> int:
        return sum(len(r.keys) for r in self.requests)

    @property
    def unique_blocks(self) -> int:
        if self._unique is None:
            seen: set[Key] = set()
            for r in self.requests:
                seen.update(r.keys)
            self._unique = len(seen)
        return self._unique

    @property
    def has_sessions(self) -> bool:
        return any(r.session is not None for r in self.requests)

    @property
    def sessions(self) -> int:
        """Distinct sessions named by the requests (0 when the trace has none)."""
        return len({r.session for r in self.requests if r.session is not None})

    @property
    def has_partial_blocks(self) -> bool:
        """Whether some request's last key stands for a partial block (Mooncake hash_ids);
        kvtier's own keys cover full blocks only, so token-level traces never do."""
        return any(r.last_tokens is not None for r in self.requests)

    @property
    def infinite_hits(self) -> int:
        """Prefix hit blocks with a cache that never evicts: the ceiling of every policy.
        Keys are prefix-chained, so a request's hit is its leading run of keys seen before."""
        seen: set[Key] = set()
        hits = 0
        for r in self.requests:
            n = 0
            for k in r.keys:
                if k not in seen:
                    break
                n += 1
            hits += n
            seen.update(r.keys)
        return hits
