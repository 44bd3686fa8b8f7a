"""Leaf-first LRU: least recently used goes first; a request's blocks are touched
tail-first, so within a prefix the deepest block is evicted before its root."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

from kvtier.policies.base import BlockInfo, EvictionPolicy, Key


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        # Oldest first. OrderedDict gives O(1) move_to_end and pop from either end in C.
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, info: BlockInfo) -> None:
        self._order[info.key] = None

    def touch(self, keys: Sequence[Key]) -> None:
        move = self._order.move_to_end
        for k in keys:
            move(k)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        # Speed: blocks skipped because they are held or pinned are in use: they move to the
        # recent end, so the next search does not walk past them again (amortized O(1)
        # even with thousands of pinned blocks). The replay never skips (no pins, no holds).
        skipped = []
        found = None
        for k in self._order:
            if evictable(k):
                found = k
                break
            skipped.append(k)
        move = self._order.move_to_end
        for k in skipped:
            move(k)
        return found

    def __len__(self) -> int:
        return len(self._order)
