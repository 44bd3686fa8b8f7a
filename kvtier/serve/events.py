"""KV events: a server's numbered log of the blocks its store gained and lost, for routers.

`GET /kvtier/events?since=N&limit=L` answers the events numbered N and after (at most L,
MAX_BATCH): `{"epoch", "first", "next", "reset", "events": [["+" | "-", key hex], ...]}`. A
router keeps `next` and asks from there; `epoch` is new each time the server starts, so a
restarted server's numbering is never mistaken for the old one's. The log is bounded
(`capacity` events, oldest forgotten first): a router that fell further behind than that, or
asks with another epoch's number, gets `reset: true` and the events from the oldest kept,
and starts its view of this server afresh (an underestimate: blocks stored before the
oldest event kept are learned again when they are stored again).

The events are the store's own changes (`Store.watch`/`changes`, its own feed: a node's
directory publisher has another): "+" when a block becomes readable, "-" when its last
copy leaves the store. Moves between tiers are not events: a router matches prefixes, not
tiers. The log starts with a "+" for every block the store holds (a disk tier's recovered
blocks), and is refreshed when a router asks, so an idle server costs nothing.
"""
from __future__ import annotations

import threading
import uuid
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.store import Store

FEED = "kv-events"
CAPACITY = 1 << 16          # events kept: ~2.5 MB, minutes of churn at thousands of blocks a second
MAX_BATCH = 4096            # events per answer (~160 KB of JSON)


class KvEvents:
    """The numbered, bounded log of one store's block events."""

    def __init__(self, store: Store, capacity: int = CAPACITY) -> None:
        self.store = store
        self.capacity = capacity
        self.epoch = uuid.uuid4().hex[:16]
        self.next = 0                                   # the number the next event gets
        self._log: deque[tuple[str, bytes]] = deque()   # events first .. next-1
        self._lock = threading.Lock()
        store.watch(feed=FEED)
        self._add([("+", bytes(k)) for k in store.cached_keys()])

    @property
    def first(self) -> int:
        return self.next - len(self._log)

    def _add(self, changes: list[tuple[str, bytes]]) -> None:
        self._log.extend(changes)
        self.next += len(changes)
        while len(self._log) > self.capacity:
            self._log.popleft()

    def since(self, n: int, limit: int = MAX_BATCH) -> dict[str, Any]:
        """The answer to `?since=n&limit=limit` (see the module docstring)."""
        limit = max(1, min(limit, MAX_BATCH))
        with self._lock:
            self._add(self.store.changes(FEED))
            first = self.first
            reset = not first <= n <= self.next
            start = first if reset else n
            picked = list(islice(self._log, start - first, min(self.next, start + limit) - first))
            return {"object": "kvtier.events", "epoch": self.epoch, "first": first, "next": start + len(picked),
                    "last": self.next, "reset": reset, "events": [[op, bytes(k).hex()] for op, k in picked]}

    def close(self) -> None:
        self.store.watch(False, feed=FEED)
