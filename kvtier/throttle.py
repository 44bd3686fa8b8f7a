"""Sparse warnings for a cause that may repeat on every call (a full disk fails every put,
a bad directory entry is read on every lookup): the first line at once, then at most one
per interval, each saying how many events it stands for (the owner counts them)."""
from __future__ import annotations


class Throttle:
    """When a repeated warning is due: `due(now)` is True for the first, then at most once
    per `every` seconds (`now` from the owner's clock, so its tests can move it)."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.last: float | None = None     # when the last line was due (None: none yet)

    def due(self, now: float) -> bool:
        if self.last is not None and now - self.last < self.every:
            return False
        self.last = now
        return True
