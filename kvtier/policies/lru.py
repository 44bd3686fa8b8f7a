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

    def victims(self, kind: Callable[[Key], int], n: int) -> list[Key]:
        # One walk for n victims: victim() walked from the oldest each time (EvictionPolicy.victims).
        # The blocks skipped before the last victim move to the recent end, as those calls
        # moved them; any skipped after it stay, for the next victim() to walk (and move).
        out: list[Key] = []
        skipped: list[Key] = []
        moved = 0
        for k in self._order:
            c = kind(k)
            if c > 0:
                out.append(k)
                moved = len(skipped)
                if len(out) == n:
                    break
            elif c < 0:
                break
            else:
                skipped.append(k)
        move = self._order.move_to_end
        for k in skipped[:moved]:
            move(k)
        return out

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

    def order(self) -> list[Key]:
        return list(self._order)

    def __len__(self) -> int:
        return len(self._order)
