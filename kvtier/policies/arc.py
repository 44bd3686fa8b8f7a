"""ARC (Megiddo and Modha, FAST'03): two LRU lists, T1 (seen once) and T2 (seen again),
whose split p adapts using ghost lists B1 and B2 of recently evicted keys.

O(1) per operation with OrderedDicts. Ghosts hold at most capacity keys in all, so
memory stays bounded. Tail-first touches keep leaves ahead of roots in each list.
The index calls admit(info) just before it may need a victim for that block, so ARC
learns there whether the incoming key is a B2 ghost (the paper's REPLACE rule).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

from kvtier.ids import IndexKey as Key
from kvtier.policies.base import BlockInfo, EvictionPolicy


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self.p = 0.0
        self._t1: OrderedDict[Key, None] = OrderedDict()   # LRU first
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._incoming: Key | None = None
        self._victim: Key | None = None

    def admit(self, info: BlockInfo) -> bool:
        self._incoming = info.key
        return True

    def insert(self, info: BlockInfo) -> None:
        k, c = info.key, self.capacity_blocks
        b1, b2 = self._b1, self._b2
        if k in b1:
            self.p = min(float(c), self.p + max(len(b2) / len(b1), 1.0))
            del b1[k]
            self._t2[k] = None
        elif k in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[k]
            self._t2[k] = None
        else:
            self._t1[k] = None
        self._incoming = None

    def touch(self, keys: Sequence[Key]) -> None:
        t1, t2 = self._t1, self._t2
        for k in keys:
            if k in t2:
                t2.move_to_end(k)
            else:
                del t1[k]
                t2[k] = None

    def _trim_ghosts(self) -> None:
        c = self.capacity_blocks
        b1, b2 = self._b1, self._b2
        while len(b1) + len(b2) > c:
            (b1 if len(b1) > len(b2) or not b2 else b2).popitem(last=False)

    def remove(self, key: Key) -> None:
        evicted = key == self._victim
        self._victim = None
        if key in self._t1:
            del self._t1[key]
            if evicted:
                self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            if evicted:
                self._b2[key] = None
        else:
            return
        self._trim_ghosts()

    @staticmethod
    def _first(d: OrderedDict[Key, None], evictable: Callable[[Key], bool]) -> Key | None:
        for k in d:
            if evictable(k):
                return k
        return None

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        n1 = len(self._t1)
        from_t1 = n1 > 0 and (n1 > self.p or (self._incoming in self._b2 and n1 == int(self.p)))
        first, second = (self._t1, self._t2) if from_t1 else (self._t2, self._t1)
        k = self._first(first, evictable)
        if k is None:
            k = self._first(second, evictable)
        self._victim = k
        return k

    def order(self) -> list[Key]:
        # T1 (seen once) before T2 (seen again), each least recent first: the order victim()
        # follows while T1 is over its target p, which a restarted tier starts from.
        return [*self._t1, *self._t2]

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)
