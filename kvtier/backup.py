"""Copies of the blocks an engine caches in its pages, made one tier down in the background,
so that evicting them from the pages later moves no bytes.

An engine whose KV pages are kvtier's device tier asks for pages at every admission; when
the tier is full its least valuable blocks are evicted, and a block with no other copy is
first demoted (copied to the tier below) while the request waits. With a backup, each
block the engine caches (PagePool.cache) is copied down soon after, on a thread of its
own, while the engine computes; its eviction is then a drop. (SGLang's HiCache calls this
its write-through policy.) The price: the tier below holds copies of blocks the pages
hold too, and the copies run beside the engine instead of when an eviction needs them.
That price is why `backup="auto"` (the default) backs up only where the tier below holds
at least AUTO_MIN_RATIO times the top tier's blocks: with a host tier the size of the
pages, the copies filled it and the store kept half as many distinct blocks.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from contextlib import contextmanager
from time import monotonic
from typing import TYPE_CHECKING, Iterator, Sequence

from kvtier.ids import BlockKey, TierId
from kvtier.throttle import Throttle

if TYPE_CHECKING:       # kvtier.config imports this module's setting checks; moves imports tiers
    from kvtier.moves import Mover

log = logging.getLogger("kvtier.backup")

BATCH_BLOCKS = 1024     # blocks copied per pass: a pass holds them (not evictable) until it ends
IDLE_EXIT_S = 1.0       # the thread ends after this long with nothing to copy (a store dropped
                        # without close() is then not kept alive by it); submit() starts another
WARN_EVERY_S = 60.0     # failed passes are logged at most this often (a full disk fails every pass)
# backup="auto" backs up only where the tier below has this many times the top tier's slots.
# The copies hold one slot below for each block the pages hold, so the distinct blocks kept
# in all are `below` instead of `below + top`: at 2x (SGLang HiCache's default host/GPU
# ratio) a third fewer; at 1.33x (`kvtier bench serve`'s 6 + 8 MiB) 43% fewer, and its hit
# ratio fell from 0.56 to 0.36 (docs/serve.md).
AUTO_MIN_RATIO = 2.0


def valid_backup(setting: object) -> bool:
    """Whether `setting` is one of True, False, "auto" (1 is not True here)."""
    return isinstance(setting, bool) or setting == "auto"


def backup_wanted(setting: bool | str, slots: Sequence[int]) -> bool:
    """Whether a store whose tiers have `slots` (fastest first) backs its top tier up."""
    if len(slots) < 2 or setting is False:
        return False
    return setting is True or slots[1] >= AUTO_MIN_RATIO * slots[0]


class Backup:
    """A thread that copies newly cached top-tier blocks into `tier` (the next one down)."""

    def __init__(self, mover: Mover, tier: TierId, limit: int) -> None:
        self._mover, self.tier = mover, tier
        # Bounded: past `limit` keys waiting (the engine caches faster than the link copies),
        # the oldest are not backed up; they are demoted when evicted, as without a backup.
        self._pending: deque[BlockKey] = deque(maxlen=max(1, limit))
        self._cond = threading.Condition()
        self._busy = False       # a pass is copying: its blocks are held (not evictable)
        self._paused = 0         # callers that need every evictable block: no pass starts meanwhile
        self._closed = False
        self._thread: threading.Thread | None = None
        self.copied = 0          # blocks given a copy in `tier`
        self.failed = 0          # blocks whose copy failed (each is demoted when evicted instead)
        self._warn = Throttle(WARN_EVERY_S)
        self._unlogged = [0, 0]  # failed passes and blocks not logged since

    def submit(self, keys: Sequence[BlockKey]) -> None:
        """Copy these blocks down soon (the ones still cached in the top tier and not there yet)."""
        with self._cond:
            if self._closed or not keys:
                return
            self._pending.extend(keys)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvtier-backup", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                work = self._cond.wait_for(lambda: (self._pending and not self._paused) or self._closed, IDLE_EXIT_S)
                if self._closed or not work:
                    if not self._pending or self._closed:
                        self._thread = None
                        return
                    continue             # paused with work waiting: keep waiting
                batch = [self._pending.popleft() for _ in range(min(len(self._pending), BATCH_BLOCKS))]
                self._busy = True
            n, failed = 0, 0
            try:
                n = self._mover.copy_into(self.tier, batch, down_only=True)
            except Exception as e:       # best effort: a block without a copy is demoted when evicted
                failed = len(batch)
                self._log_failure(len(batch), e)
            finally:
                with self._cond:
                    self._busy = False   # whatever happened: paused() must not wait forever
                    self.copied += n
                    self.failed += failed
                    self._cond.notify_all()

    def _log_failure(self, blocks: int, e: Exception) -> None:
        """One warning for the first failed pass, then at most one per WARN_EVERY_S with the
        count since: a cause that fails every pass (a full disk) wrote a line per pass."""
        self._unlogged[0] += 1
        self._unlogged[1] += blocks
        again = self._warn.last is not None
        if not self._warn.due(monotonic()):
            return
        passes, n = self._unlogged
        since = f" ({passes} passes, {n} blocks since the last warning)" if again else ""
        log.warning("backup of %d blocks to tier %d failed: %s%s; blocks without a copy are demoted when "
                    "evicted instead (next such warning in %.0f s at the earliest)", blocks, self.tier, e, since,
                    WARN_EVERY_S)
        self._unlogged = [0, 0]

    @property
    def copying(self) -> bool:
        """Whether a pass is copying now (it holds its blocks: an eviction cannot pick them)."""
        with self._cond:
            return self._busy

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Wait for the pass in progress to end and start no other inside the block: for an
        allocation that found too few evictable pages (the engine's need comes first)."""
        with self._cond:
            self._paused += 1
            self._cond.wait_for(lambda: not self._busy)
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every block submitted so far was copied (or skipped); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or not (self._pending or self._busy), timeout)

    def close(self) -> None:
        """Stop after the pass in progress; blocks still waiting are not copied (a store's
        flush writes every block without a persistent copy down anyway)."""
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
