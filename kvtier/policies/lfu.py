"""LFU with LRU among equals: the block used least often goes first.

O(1) per operation: one OrderedDict (oldest first) per access count, and the lowest
non-empty count tracked. Counts live only while a block is cached (bounded memory).
A request's blocks are touched tail-first, so among equal counts leaves go first.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

from kvtier.ids import IndexKey as Key
from kvtier.policies.base import BlockInfo, EvictionPolicy


class LFUPolicy(EvictionPolicy):
    name = "lfu"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self._count: dict[Key, int] = {}
        self._buckets: dict[int, OrderedDict[Key, None]] = {}
        self._min = 1

    def _bucket(self, c: int) -> OrderedDict[Key, None]:
        b = self._buckets.get(c)
        if b is None:
            b = self._buckets[c] = OrderedDict()
        return b

    def insert(self, info: BlockInfo) -> None:
        self._count[info.key] = 1
        self._bucket(1)[info.key] = None
        self._min = 1

    def touch(self, keys: Sequence[Key]) -> None:
        count, buckets = self._count, self._buckets
        for k in keys:
            c = count[k]
            b = buckets[c]
            del b[k]
            if not b:
                del buckets[c]
                if self._min == c:
                    self._min = c + 1
            count[k] = c + 1
            self._bucket(c + 1)[k] = None

    def remove(self, key: Key) -> None:
        c = self._count.pop(key, None)
        if c is None:
            return
        b = self._buckets[c]
        del b[key]
        if not b:
            del self._buckets[c]
            if self._min == c:
                self._min = min(self._buckets, default=1)   # rare: O(distinct counts)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        b = self._buckets.get(self._min)
        if b is not None:
            for k in b:
                if evictable(k):
                    return k
        for c in sorted(self._buckets):   # held blocks in the lowest bucket: look higher
            for k in self._buckets[c]:
                if evictable(k):
                    return k
        return None

    def order(self) -> list[Key]:
        buckets = self._buckets
        return [k for c in sorted(buckets) for k in buckets[c]]

    def __len__(self) -> int:
        return len(self._count)
