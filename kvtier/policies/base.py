"""The interface every eviction/admission policy implements.

Policies see metadata only, never payload: the store and the hit-ratio replay
(`kvtier bench hit-ratio`) drive the very same objects, so a replayed hit ratio is the
one the store gets. One policy instance governs one tier.

The index calls a policy in a fixed order, which the replay reproduces exactly:
- `touch(keys)` with a request's cached blocks tail-first (deepest block first), so a
  recency policy ends with the prefix's root as most recent: leaves go before roots;
- `admit(info)` then `insert(info)` for each new block, also tail-first;
- `victim(evictable)` when the tier needs a slot, then `remove(key)` for the block
  that leaves (also called when a block leaves for any other reason).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence
from kvtier.ids import IndexKey as Key


@dataclass(slots=True)
class BlockInfo:
    """What a policy may know about a block when it is inserted."""

    key: Key
    parent: Key | None      # the previous block's key in its chain (None: unknown)
    depth: int              # index of the block in its prompt (0 = root)
    tokens: int             # tokens in the block (< block_tokens only for traces' partial blocks)
    block_tokens: int       # full block size
    request_blocks: int     # blocks in the request that brought it (0: unknown)
    prefix_blocks: int = 0  # that request's cached prefix when it arrived (its first new block's depth)

    @property
    def partial(self) -> bool:
        return self.tokens < self.block_tokens


class EvictionPolicy(ABC):
    """Chooses which block a tier gives up, and (optionally) which new blocks it admits."""

    name: ClassVar[str]
    #: True for policies that need the future (Belady): replay only, never a live store.
    offline: ClassVar[bool] = False

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks

    def begin_request(self, i: int) -> None:
        """The replay is about to serve request i. A no-op except for policies that follow
        the trace (Belady); the live store never calls it."""

    def admit(self, info: BlockInfo) -> bool:
        """Whether a new block is cached at all. Default: admit everything."""
        return True

    @abstractmethod
    def insert(self, info: BlockInfo) -> None:
        """A new block entered the tier."""

    @abstractmethod
    def touch(self, keys: Sequence[Key]) -> None:
        """Cached blocks were used, in the order given (the index passes them tail-first)."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """A block left the tier (evicted, moved or dropped); forget it."""

    @abstractmethod
    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        """The block to evict next among those `evictable` accepts, or None if there is none.

        Must not change which blocks it tracks (the index calls remove() on the block it then
        evicts); it may reorder the blocks it had to skip.
        """

    def victims(self, kind: Callable[[Key], int], n: int) -> list[Key] | None:
        """Up to `n` blocks to evict next, in order: the blocks n calls of victim() would
        return (each followed by remove()), while kind(key) says 1 (evict it: index.DROP); a
        key whose kind is 0 (NOT_EVICTABLE) is skipped as victim() skips it, and one whose kind
        is -1 (DEMOTE) ends the list (the caller evicts it through victim()). For a tier giving up many blocks at once (a host
        hit's pages). None: not offered; the caller calls victim() for each."""
        return None

    def order(self) -> list[Key] | None:
        """The blocks it tracks, the next to evict first (as near as its state says: ARC and
        S3-FIFO decide between their lists at eviction time); None where it keeps no such
        order (Belady's depends on the future). A persistent tier records it at a flush and at
        close, so a restart adopts its blocks in the order they were used."""
        return None

    def __len__(self) -> int:  # pragma: no cover - optional
        raise NotImplementedError
