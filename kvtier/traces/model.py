"""What a replay needs of a trace: per request, its block keys in prefix order.

Both trace formats reduce to this, so the replay, the cluster simulation and the
generator share one representation. Keys are whatever the format gives (Mooncake's
integer hash ids, or kvtier's own 16-byte block keys for token-level traces): the
BlockIndex is key-type agnostic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

Key = Hashable


@dataclass(slots=True)
class Request:
    """One prompt: its block keys (prefix-chained) and what the replay counts."""

    keys: Sequence[Key]
    input_length: int               # prompt tokens
    output_length: int = 0
    timestamp: float = 0.0          # milliseconds since the trace start
    session: str | None = None      # conversation/agent session, when the trace has one
    last_tokens: int | None = None  # tokens in the last keyed block when it is partial

    def block_tokens_at(self, i: int, block_tokens: int) -> int:
        """Tokens in block i of this request."""
        if i == len(self.keys) - 1 and self.last_tokens is not None:
            return self.last_tokens
        return block_tokens


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
