"""KV events: a server's numbered log of the blocks its store gained and lost, for routers.

`GET /kvtier/events?since=N&epoch=E&limit=L` answers the events numbered N and after (at most
L, MAX_BATCH): `{"epoch", "first", "next", "last", "reset", "events": [["+" | "-", key hex],
...]}`. A router keeps `epoch` and `next` and asks from there; `epoch` is new each time the
server starts, so a restarted server's numbering is never mistaken for the old one's.

A consumer that cannot continue from the log gets a **snapshot** instead: a new one (`since=0`
and no `epoch`), one that asks with another epoch, or one further behind than the log holds
(`capacity` events, oldest forgotten first). A snapshot is the store's cached keys as `+`
events, `reset: true` on its first page (the consumer starts its view afresh), paged: while
`"cursor"` is in an answer, the consumer asks again with `cursor=...` for the next page (a
cursor of a snapshot no longer kept starts a new one, `reset: true` again). `next` is the
event number the snapshot was taken at: once its last page is read, the consumer asks for
the events from there, so the changes made while it paged are applied over it (each event
sets its key's state, so replaying a change the snapshot already shows is harmless).

The events are the store's own changes (`Store.watch`/`changes`, its own feed: a node's
directory publisher has another): "+" when a block becomes readable, "-" when its last
copy leaves the store. Moves between tiers are not events: a router matches prefixes, not
tiers. The log starts when the first router asks, so an idle server costs nothing.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, Callable

from kvtier.ids import BlockKey

if TYPE_CHECKING:
    from kvtier.store import Store

FEED = "kv-events"
CAPACITY = 1 << 16          # events kept: ~2.5 MB, minutes of churn at thousands of blocks a second
MAX_BATCH = 4096            # events (or snapshot keys) per answer (~160 KB of JSON)
SNAPSHOT_TTL_S = 60.0       # an unread snapshot is dropped after this long (it holds every key's reference)


@dataclass
class Snapshot:
    """The store's keys when the log was at `at`: shared by every consumer that starts while
    `at` is still in the log, so routers starting together cost one copy of the key list."""

    id: str
    at: int
    keys: list[BlockKey]
    used: float                 # when a page of it was last read


class KvEvents:
    """The numbered, bounded log of one store's block events, and its snapshot."""

    def __init__(self, store: Store, capacity: int = CAPACITY, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.capacity = capacity
        self.clock = clock
        self.epoch = uuid.uuid4().hex[:16]
        self.next = 0                                   # the number the next event gets
        self._log: deque[tuple[str, bytes]] = deque()   # events first .. next-1
        self._snapshot: Snapshot | None = None
        self._lock = threading.Lock()
        store.watch(feed=FEED)

    @property
    def first(self) -> int:
        return self.next - len(self._log)

    def _add(self, changes: list[tuple[str, bytes]]) -> None:
        self._log.extend(changes)
        self.next += len(changes)
        while len(self._log) > self.capacity:
            self._log.popleft()

    def since(self, n: int, limit: int = MAX_BATCH, epoch: str | None = None,
              cursor: str | None = None) -> dict[str, Any]:
        """The answer to `?since=n&limit=limit&epoch=epoch&cursor=cursor` (see the module
        docstring). A cursor that is not `id:offset` raises ValueError."""
        limit = max(1, min(limit, MAX_BATCH))
        with self._lock:
            changes = self.store.changes(FEED)
            if changes is None:                # more changed than the store's feed keeps: the log
                self.epoch = uuid.uuid4().hex[:16]   # cannot go on; every reader takes a snapshot
                self._log.clear()
                self._snapshot = None
            else:
                self._add(changes)
            snap = self._snapshot
            if snap is not None and (snap.at < self.first or self.clock() - snap.used > SNAPSHOT_TTL_S):
                self._snapshot = None          # its continuation left the log, or nobody reads it: free it
            if cursor is not None:
                sid, _, offset = cursor.partition(":")
                return self._page(sid, int(offset), limit)
            if (epoch is not None and epoch != self.epoch) or not self.first <= n <= self.next \
                    or (n == 0 and epoch is None):
                return self._page(None, 0, limit)
            picked = list(islice(self._log, n - self.first, min(self.next, n + limit) - self.first))
            return self._answer(n + len(picked), False, picked)

    def _page(self, sid: str | None, offset: int, limit: int) -> dict[str, Any]:
        """The page of snapshot `sid` from `offset`; for a new consumer, or a cursor of a
        snapshot no longer kept, the first page of the current one (taken now if none is kept)."""
        snap = self._snapshot
        if snap is None or sid != snap.id or not 0 <= offset <= len(snap.keys):
            offset = 0
        if snap is None:
            # one C-level copy of the index's key list, under the store's lock (~1 ms per 10^5 keys)
            snap = self._snapshot = Snapshot(uuid.uuid4().hex[:12], self.next, self.store.cached_keys(), 0.0)
        snap.used = self.clock()
        page = snap.keys[offset:offset + limit]
        out = self._answer(snap.at, offset == 0, [("+", k) for k in page])
        out["snapshot"] = {"keys": len(snap.keys), "offset": offset}
        if offset + len(page) < len(snap.keys):
            out["cursor"] = f"{snap.id}:{offset + len(page)}"
        return out

    def _answer(self, nxt: int, reset: bool, picked: list[tuple[str, bytes]]) -> dict[str, Any]:
        return {"object": "kvtier.events", "epoch": self.epoch, "first": self.first, "next": nxt, "last": self.next,
                "reset": reset, "events": [[op, bytes(k).hex()] for op, k in picked]}

    def close(self) -> None:
        self.store.watch(False, feed=FEED)
