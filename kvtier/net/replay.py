"""Replay protection: the nonces a node has accepted within the freshness window.

A frame older than the window is refused as stale (frames.read_prefix), so only the
window's nonces need remembering; older entries are evicted as time passes. The table is
also capped: when it is full, the oldest entry goes and the table's horizon moves up to
its time, and frames from before the horizon are refused as stale too, so a nonce is
never forgotten while a frame carrying it could still be accepted. Only requests whose MAC
verified reach the table (never a reply sent back to the node), so strangers cannot fill it.

"Oldest" is by the frame's time, not its arrival: a peer whose clock runs ahead (within
the window) dates its frames in the future. Kept in arrival order, such an entry stopped
the older ones behind it from expiring, and when the full table forgot it the horizon
jumped into the future: every peer's frames were refused for up to the skew. Forgetting
the earliest-dated entry instead keeps the horizon at or before now unless the whole
table is dated in the future. (Not clamped to now: a forgotten future-dated nonce could
then be replayed.)
"""
from __future__ import annotations

import heapq

from kvtier.net.frames import MAX_AGE_S, FrameError


class ReplayGuard:
    """`guard.check(nonce, ts, now)` raises FrameError for a nonce seen before (or too old to tell)."""

    def __init__(self, window: float = MAX_AGE_S, capacity: int = 1 << 18) -> None:
        self.window, self.capacity = window, capacity
        self.horizon = 0.0                          # frames at or before this time are refused
        self._seen: set[bytes] = set()
        self._order: list[tuple[float, bytes]] = []   # (frame time, nonce): a heap, earliest first
        self.refused = 0

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, nonce: bytes, ts: float, now: float) -> None:
        """Accept (and remember) a fresh nonce; FrameError for a replayed one."""
        self._evict(now - self.window)
        if ts <= self.horizon:
            self.refused += 1
            raise FrameError("stale frame: older than this node's replay table reaches (a replay, "
                             "or a peer's clock behind)")
        if nonce in self._seen:
            self.refused += 1
            raise FrameError("replayed frame: this frame's nonce was already accepted")
        self._seen.add(nonce)
        heapq.heappush(self._order, (ts, nonce))
        if len(self._order) > self.capacity:
            self._forget()

    def _evict(self, before: float) -> None:
        order = self._order
        while order and order[0][0] < before:
            self._forget()

    def _forget(self) -> None:
        ts, nonce = heapq.heappop(self._order)
        self._seen.discard(nonce)
        if ts > self.horizon:
            self.horizon = ts
