"""Counters a store reports: per tier and for the whole store."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.errors import ConfigError


@dataclass
class TierStats:
    name: str
    kind: str
    capacity_blocks: int
    used_blocks: int
    block_bytes: int
    inserted: int          # new blocks written here
    hits: int              # blocks read from here
    evicted: int           # blocks that left to make room
    demoted_in: int        # blocks that arrived from the tier above
    dropped: int           # blocks that left the store from here
    rejected: int          # new blocks refused (admission or no room)
    pinned_blocks: int     # distinct keys pinned to this tier
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.block_bytes

    @property
    def pinned_bytes(self) -> int:
        return self.pinned_blocks * self.block_bytes


@dataclass
class StoreCounters:
    lookups: int = 0
    lookup_blocks: int = 0       # keys asked about
    lookup_hit_blocks: int = 0   # keys in the returned prefixes
    gets: int = 0
    get_blocks: int = 0
    get_bytes: int = 0
    puts: int = 0
    put_blocks: int = 0          # newly written
    put_present: int = 0         # already cached (refreshed only)
    put_rejected: int = 0
    put_bytes: int = 0
    corrupt_blocks: int = 0      # blocks that failed verification on read (misses, dropped)
    remote_blocks: int = 0       # blocks fetched from peers


@dataclass
class StoreStats:
    """A snapshot of `store.stats()`."""

    counters: StoreCounters
    tiers: list[TierStats]
    pinned_sessions: int
    pins_shed: int = 0           # session pins dropped early to bound the pins' memory (Pins.ref_limit)
    recovered_blocks: int = 0    # blocks found in persistent tiers when the store opened
    remote: dict[str, Any] | None = None   # the remote tier's peers, timeout and errors
    backup: dict[str, Any] | None = None   # background copies one tier down: into which tier, blocks
                                           # copied and failed; None where off (backup=False, or "auto"
                                           # with a tier below smaller than 2x the top one)

    @property
    def hit_ratio(self) -> float:
        """Blocks found by lookup / blocks asked about."""
        c = self.counters
        return c.lookup_hit_blocks / c.lookup_blocks if c.lookup_blocks else 0.0

    @property
    def pinned_bytes(self) -> int:
        return sum(t.pinned_bytes for t in self.tiers)

    def tier(self, name: str) -> TierStats:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ConfigError(f"no tier named {name!r}: this store's tiers are "
                          f"{', '.join(repr(t.name) for t in self.tiers)}")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for td, t in zip(d["tiers"], self.tiers):
            td.update(used_bytes=t.used_bytes, capacity_bytes=t.capacity_bytes, pinned_bytes=t.pinned_bytes)
        d.update(hit_ratio=self.hit_ratio, pinned_bytes=self.pinned_bytes)
        return d
