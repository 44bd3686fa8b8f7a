"""Keeps a directory told what a node's store holds: batched changes and a renewed lease.

Every `every` seconds the keys that entered or left the store since the last batch go to
the directory in one pipelined call, and the node's lease is renewed. If the lease had
lapsed, or the directory could not be reached, the next round publishes everything the
store holds again (so a restarted Redis is refilled) instead of keeping an unbounded backlog.
While the directory is down its calls fail fast (it retries with backoff and logs each
change of state itself), so the rounds cost nothing and log nothing more. On stop the node
leaves: its lease goes, and it is taken off the entries of every block it may have published.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from kvtier.errors import KvtierError
from kvtier.net.directory import Directory, DirectoryError

if TYPE_CHECKING:
    from kvtier.store import Store

log = logging.getLogger("kvtier.publisher")
MAX_UNSENT_REMOVALS = 1 << 16   # removals kept for the next round while the directory fails
# Seconds between a node's steps of the directory's sweep. A step costs Redis about 1 ms
# (1,000 entries, half of them rewritten: 1.2 ms): with 100 nodes, 1 % of its time.
SWEEP_EVERY = 10.0


class Publisher:
    def __init__(self, store: Store, directory: Directory, address: str, every: float = 0.05) -> None:
        self.store, self.directory, self.address, self.every = store, directory, address, every
        self.resync = True          # publish everything at the next round
        self.errors = 0
        # Blocks that left the store and are not yet off the directory: a failed round (or a
        # lapsed lease's publish of everything) must still remove them, or a live node stays
        # listed beside the real holders for blocks it no longer has (and lookups prefer it).
        self._removed: dict[bytes, None] = {}
        self._stop = threading.Event()
        self._next_sweep = time.monotonic() + SWEEP_EVERY
        self._thread = threading.Thread(target=self._run, name="kvtier-publisher", daemon=True)
        store.watch()

    def start(self) -> Publisher:
        self.round()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop publishing and leave the directory, taking this node off every entry it
        published (others that hold those blocks stay listed)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.directory.leave(self.address, self._listed())
        self.store.watch(False)

    def _listed(self) -> list[bytes]:
        """The keys the directory may list under this node: what the store holds, and what
        entered or left it since the last round (not yet published)."""
        try:
            keys = dict.fromkeys(self.store.cached_keys())
            keys.update(dict.fromkeys(k for _, k in self.store.changes() or ()))
        except KvtierError:       # a store closed first: lookups prune what is left once the lease is gone
            return []
        return list(keys)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.round()
            if time.monotonic() >= self._next_sweep:
                self._next_sweep = time.monotonic() + SWEEP_EVERY
                try:       # every node takes a step in turn: dead holders leave entries nobody reads
                    self.directory.sweep()
                except DirectoryError:
                    pass   # the directory logs its outages itself

    def round(self) -> None:
        """Publish what changed (or everything, after a lapse) and renew the lease."""
        batch = self.store.changes()
        if batch is None:               # more changed than the feed keeps: publish everything
            self.resync, batch = True, []
        last: dict[bytes, str] = {}
        for op, key in batch:            # a key added then dropped in one batch: dropped
            last[key] = op
        for key, op in last.items():
            if op == "-":
                self._removed[key] = None
            else:
                self._removed.pop(key, None)
        while len(self._removed) > MAX_UNSENT_REMOVALS:      # bounded: the oldest go unsent
            del self._removed[next(iter(self._removed))]
        everything = self.store.cached_keys() if self.resync else None
        try:
            if not self.directory.heartbeat(self.address):
                everything = everything if everything is not None else self.store.cached_keys()
            if everything is not None:
                held = set(everything)
                self.directory.publish(self.address, everything, [k for k in self._removed if k not in held])
            else:
                self.directory.publish(self.address, [k for k, op in last.items() if op == "+"], list(self._removed))
            self._removed.clear()
            self.resync = False
        except DirectoryError as e:   # the directory logs when it goes away and comes back
            self.errors += 1
            self.resync = True
            log.debug("node %s: %s; will publish everything once it answers", self.address, e)
