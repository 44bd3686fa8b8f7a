"""S3-FIFO (Yang et al., SOSP'23): a small FIFO (10%) filters one-hit wonders, a main
FIFO with lazy reinsertion keeps the rest, and a ghost FIFO of recently evicted keys
sends a returning block straight to main.

Every operation is O(1) amortised: hits only bump a 2-bit counter. victim() may move
blocks between the queues (promotion and reinsertion happen lazily at eviction time,
as in the paper) but never drops one: the index then remove()s the block it returns.
Memory: the queues hold cached blocks; the ghost holds at most capacity keys.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

from kvtier.ids import IndexKey as Key
from kvtier.policies.base import BlockInfo, EvictionPolicy


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"
    small_fraction = 0.1

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self._small_cap = max(1, int(capacity_blocks * self.small_fraction))
        self._small: OrderedDict[Key, None] = OrderedDict()   # oldest first
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}

    def insert(self, info: BlockInfo) -> None:
        k = info.key
        self._freq[k] = 0
        if k in self._ghost:
            del self._ghost[k]
            self._main[k] = None
        else:
            self._small[k] = None

    def touch(self, keys: Sequence[Key]) -> None:
        f = self._freq
        for k in keys:
            c = f[k]
            if c < 3:
                f[k] = c + 1

    def remove(self, key: Key) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._small:
            del self._small[key]
            self._ghost[key] = None          # left from small: remember it for a while
            while len(self._ghost) > self.capacity_blocks:
                self._ghost.popitem(last=False)
        else:
            self._main.pop(key, None)

    def _from_small(self, evictable: Callable[[Key], bool]) -> Key | None:
        small, main, f = self._small, self._main, self._freq
        for _ in range(len(small)):
            k, _v = small.popitem(last=False)
            if f[k] > 0:          # used while in small: promote to main
                f[k] = 0
                main[k] = None
            elif evictable(k):
                small[k] = None
                small.move_to_end(k, last=False)   # stays at the head until remove()
                return k
            else:
                small[k] = None   # held: skip it, keep it in small
        return None

    def _from_main(self, evictable: Callable[[Key], bool]) -> Key | None:
        main, f = self._main, self._freq
        for _ in range(4 * len(main) + 1):   # each pass lowers a counter: bounded
            if not main:
                return None
            k, _v = main.popitem(last=False)
            main[k] = None                   # reinsert at the tail ...
            if f[k] > 0:
                f[k] -= 1                    # ... with one use spent
            elif evictable(k):
                return k
        return None

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        if len(self._small) >= self._small_cap:
            k = self._from_small(evictable)
            if k is not None:
                return k
        k = self._from_main(evictable)
        return k if k is not None else self._from_small(evictable)

    def order(self) -> list[Key]:
        # The order eviction would reach them in: small's unused blocks (oldest first), then
        # main's and those small would promote to main (used while there), fewer uses first.
        f, small = self._freq, self._small
        kept = [*self._main, *(k for k in small if f[k] > 0)]
        return [*(k for k in small if f[k] == 0), *sorted(kept, key=f.__getitem__)]

    def __len__(self) -> int:
        return len(self._freq)
