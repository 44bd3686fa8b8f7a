"""Reuse-protected LRU ("reuse"): LRU in which a block that has been reused since it was
cached is treated as if it had been used `delta` operations more recently.

Why: on the prefix-chained traces a block that was reused once is about twice as likely
to be reused again as a fresh one (conversation trace: 0.42 against 0.24; synthetic:
0.84 against 0.42), with the same distribution of reuse gaps. Counting hits (LFU) or
admitting on a second reference (S3-FIFO, ARC's T1/T2 split) over-weights that signal
and loses to LRU from 5% up; a bounded recency bonus does not: a reused block still
leaves once it is `delta` operations older than the oldest fresh block.

Mechanics, O(1) per operation:
- two LRU lists keyed by a logical clock that ticks once per inserted or touched block:
  A (never reused since insertion) and B (reused at least once);
- victim: the head of A if `t(A head) <= t(B head) + delta`, else the head of B. With
  `delta == 0` that is exactly leaf-first LRU (the global oldest block goes first);
- `delta` adapts like ARC's p with ghost lists of recently evicted keys (at most
  `capacity` keys in all): a block evicted from A that comes back means fresh blocks
  were evicted too early (delta shrinks); one evicted from B that comes back means
  reused blocks were (delta grows). It stays in [0, max_protect * capacity].

The store never calls begin_request(), and this policy doesn't need it.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable, Sequence

from kvtier.ids import IndexKey as Key
from kvtier.policies.base import BlockInfo, EvictionPolicy


class ReusePolicy(EvictionPolicy):
    name = "reuse"

    def __init__(self, capacity_blocks: int, protect: float = 0.5, step: float = 4.0,
                 max_protect: float = 2.0) -> None:
        super().__init__(capacity_blocks)
        #: recency bonus of a reused block, in clock ticks (blocks inserted or touched)
        self.max_delta = max_protect * capacity_blocks
        self.delta = min(protect * capacity_blocks, self.max_delta)
        self.step = step
        self._a: OrderedDict[Key, int] = OrderedDict()   # never reused: key -> last tick, oldest first
        self._b: OrderedDict[Key, int] = OrderedDict()   # reused at least once
        self._ga: OrderedDict[Key, None] = OrderedDict()  # ghosts evicted from A
        self._gb: OrderedDict[Key, None] = OrderedDict()  # ghosts evicted from B
        self._t = 0
        self._victim: Key | None = None

    def insert(self, info: BlockInfo) -> None:
        k = info.key
        ga, gb = self._ga, self._gb
        if k in ga:
            del ga[k]
            self.delta = max(0.0, self.delta - self.step * max(1.0, len(gb) / max(1, len(ga))))
        elif k in gb:
            del gb[k]
            self.delta = min(self.max_delta, self.delta + self.step * max(1.0, len(ga) / max(1, len(gb))))
        self._t += 1
        self._a[k] = self._t

    def touch(self, keys: Sequence[Key]) -> None:
        a, b = self._a, self._b
        t = self._t
        for k in keys:
            t += 1
            if k in b:
                b.move_to_end(k)
            else:
                del a[k]
            b[k] = t
        self._t = t

    def remove(self, key: Key) -> None:
        evicted = key == self._victim
        self._victim = None
        if self._a.pop(key, None) is not None:
            if evicted:
                self._ga[key] = None
        elif self._b.pop(key, None) is not None:
            if evicted:
                self._gb[key] = None
        else:
            return
        ga, gb = self._ga, self._gb
        while len(ga) + len(gb) > self.capacity_blocks:
            (ga if len(ga) > len(gb) or not gb else gb).popitem(last=False)

    @staticmethod
    def _first(d: OrderedDict[Key, int], evictable: Callable[[Key], bool]) -> Key | None:
        for k in d:
            if evictable(k):
                return k
        return None

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        ka = self._first(self._a, evictable)
        kb = self._first(self._b, evictable)
        if ka is None:
            v = kb
        elif kb is None:
            v = ka
        else:
            v = ka if self._a[ka] <= self._b[kb] + self.delta else kb
        self._victim = v
        return v

    def order(self) -> list[Key]:
        # victim()'s rule over both lists at once: A's blocks by their tick, B's by tick + delta.
        a, b, delta = self._a, self._b, self.delta
        return [k for _, k in heapq.merge(((t, k) for k, t in a.items()),
                                          ((t + delta, k) for k, t in b.items()), key=lambda x: x[0])]

    def ghosts(self) -> int:
        return len(self._ga) + len(self._gb)

    def __len__(self) -> int:
        return len(self._a) + len(self._b)
