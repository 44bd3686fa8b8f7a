"""Belady's MIN, the offline bound: evict the block whose next use is furthest away
(ties: the deeper block first, so a prefix loses its leaves before its root), and
don't insert a block whose next use is later than every cached block's.

It needs the trace's future, so it is replay-only (offline = True; the store refuses
it). The replay calls begin_request(i) before request i. MIN processes a request's
blocks tail-first and may evict a block it inserted earlier in the same request; the
index cannot (a block being written is held), so MIN plans the whole request at
begin_request and then answers admit() and victim() from the plan: the index ends the
request holding exactly the blocks MIN would, which reproduces the reference table.
"""
from __future__ import annotations

import heapq
from bisect import bisect_right
from typing import Callable, Sequence

from kvtier.ids import IndexKey as Key
from kvtier.policies.base import BlockInfo, EvictionPolicy

NEVER = 1 << 62


class BeladyPolicy(EvictionPolicy):
    name = "belady"
    offline = True

    def __init__(self, capacity_blocks: int, future: Sequence[Sequence[Key]]) -> None:
        super().__init__(capacity_blocks)
        self._future = future
        # key -> ascending request indices that reference it (built once; one int a reference).
        occ: dict[Key, list[int]] = {}
        for i, keys in enumerate(future):
            for k in keys:
                occ.setdefault(k, []).append(i)
        self._occ = occ
        self.now = -1
        self._cached: dict[Key, tuple[int, int]] = {}     # key -> (next use, -depth)
        # Max-heap on (next use, depth) with lazy deletion: stale entries are skipped.
        self._heap: list[tuple[int, int, Key]] = []
        self._admit: set[Key] = set()                    # this request's new blocks MIN keeps
        self._evict: list[Key] = []                      # blocks MIN evicts in this request

    def next_use(self, key: Key) -> int:
        o = self._occ.get(key)
        if not o:
            return NEVER
        j = bisect_right(o, self.now)
        return o[j] if j < len(o) else NEVER

    def _put(self, key: Key, depth: int) -> None:
        v = (self.next_use(key), -depth)
        self._cached[key] = v
        heapq.heappush(self._heap, (-v[0], v[1], key))

    def _top(self) -> tuple[int, int, Key] | None:
        h, c = self._heap, self._cached
        while h:
            nu, d, k = h[0]
            if c.get(k) == (-nu, d):
                return h[0]
            heapq.heappop(h)
        return None

    def begin_request(self, i: int) -> None:
        """Plan request i with MIN: which new blocks it keeps and which cached ones go."""
        self.now = i
        keys = self._future[i]
        cached, cap = self._cached, self.capacity_blocks
        n = 0
        for k in keys:
            if k not in cached:
                break
            n += 1
        keys = keys[:n + cap]                            # the replay reserves at most `cap` new blocks
        new: set[Key] = set()
        evicted: list[Key] = []
        for d in range(len(keys) - 1, -1, -1):           # tail-first, as the index walks a put
            k = keys[d]
            if k in cached:
                self._put(k, d)
                continue
            if len(cached) >= cap:
                top = self._top()
                if top is None or self.next_use(k) > -top[0]:
                    continue                             # used later than everything cached: bypass
                heapq.heappop(self._heap)
                del cached[top[2]]
                if top[2] in new:
                    new.discard(top[2])                  # inserted and dropped within this request
                else:
                    evicted.append(top[2])
            self._put(k, d)
            new.add(k)
        self._admit = new
        self._evict = evicted[::-1]                      # pop() hands them out in MIN's order

    def admit(self, info: BlockInfo) -> bool:
        return info.key in self._admit

    def insert(self, info: BlockInfo) -> None:
        if info.key not in self._cached:                 # outside the plan (not a replay): track it
            self._put(info.key, info.depth)

    def touch(self, keys: Sequence[Key]) -> None:
        pass                                             # next uses were refreshed by the plan

    def remove(self, key: Key) -> None:
        self._cached.pop(key, None)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        while self._evict:
            k = self._evict.pop()
            if evictable(k):
                return k
        # Off-plan (e.g. an index used without begin_request): furthest next use that can go.
        h, c, skipped, found = self._heap, self._cached, [], None
        while h:
            e = heapq.heappop(h)
            if c.get(e[2]) != (-e[0], e[1]):
                continue
            skipped.append(e)
            if evictable(e[2]):
                found = e[2]
                break
        for e in skipped:
            heapq.heappush(h, e)
        return found

    def __len__(self) -> int:
        return len(self._cached)
