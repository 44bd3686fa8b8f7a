"""What a node gives peers before and after they authenticate: its bounds against hostile
or broken clients.

A connection is unauthenticated until its first frame's MAC verifies. Until then it may
hold only a few bytes (the 36-byte frame prefix; a header only once the prefix's tag has
verified, charged to `pre_auth_bytes` shared by all such connections) and must send that
first frame within the node's request timeout, counted from accept. When
`max_unauthenticated` connections are waiting for their first frame, or `max_connections`
are open and some of them are waiting, a new one closes the one that has waited longest
(only when every open connection is authenticated is a new one closed at once): strangers
that connect and say nothing cannot crowd out the cluster's own peers, which send their
first frame at once (a peer is refused only by a flood of that many new connections within
its first round trip). An
authenticated connection that sends no request for `idle_timeout` seconds is closed too, so
peers that come and go (or leak clients) cannot hold slots forever; kvtier's own client
reconnects once, transparently, when it finds its kept connection closed.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class NodeLimits:
    """Bounds of a node (`Node(..., limits=NodeLimits(...))`); the defaults suit a cluster of
    up to several hundred peers."""

    max_connections: int = 1024          # open connections in all; past it a new one evicts the longest-waiting unauthenticated one, or is closed
    max_unauthenticated: int = 128       # of them, not yet authenticated
    pre_auth_bytes: int = 16 << 20       # header bytes buffered for unauthenticated connections, in all
    replay_entries: int = 1 << 18        # nonces remembered for replay protection (~40 MiB at most)
    idle_timeout: float = 300.0          # seconds an authenticated connection may wait between requests

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_unauthenticated", "pre_auth_bytes", "replay_entries"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"NodeLimits.{name} must be a positive int, got {v!r}")
        v = self.idle_timeout
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or v == float("inf"):
            raise ConfigError(f"NodeLimits.idle_timeout must be a positive number of seconds, got {v!r}")


@dataclass(eq=False)
class Waiting:
    """One admitted connection as the gate tracks it: `close` ends it (its task's cancel),
    set by whoever runs it; `evicted` once the gate closed it to make room."""

    close: Callable[[], object] = field(default=lambda: None)
    evicted: bool = False


class Gate:
    """The node's running counts against its limits (used on the node's event loop only)."""

    def __init__(self, limits: NodeLimits) -> None:
        self.limits = limits
        self.open = 0                 # connections open
        self.pre_auth_bytes = 0       # header bytes held for unauthenticated connections
        self.closed_over_cap = 0      # connections closed at accept: over max_connections
        self.closed_idle = 0          # authenticated connections closed after idle_timeout
        self.evicted = 0              # unauthenticated connections closed to admit a newer one
        self._waiting: OrderedDict[Waiting, None] = OrderedDict()   # not yet authenticated, oldest first

    @property
    def unauthenticated(self) -> int:
        """Open connections not yet authenticated."""
        return len(self._waiting)

    def admit(self) -> Waiting | None:
        """Count a new (unauthenticated) connection in, or None: close it at once. At
        `max_unauthenticated`, or at `max_connections` with some connection not yet
        authenticated, the longest-waiting unauthenticated connection is closed instead
        (counted out here; its own closed() then changes nothing)."""
        lim = self.limits
        if self.open >= lim.max_connections or self.unauthenticated >= lim.max_unauthenticated:
            if not self._waiting:       # every slot held by authenticated peers
                self.closed_over_cap += 1
                return None
            oldest, _ = self._waiting.popitem(last=False)
            oldest.evicted = True
            self.open -= 1
            self.evicted += 1
            oldest.close()
        w = Waiting()
        self._waiting[w] = None
        self.open += 1
        return w

    def reserve(self, n: int) -> bool:
        """Buffer n header bytes for an unauthenticated connection, or False: over the budget."""
        if self.pre_auth_bytes + n > self.limits.pre_auth_bytes:
            return False
        self.pre_auth_bytes += n
        return True

    def release(self, n: int) -> None:
        self.pre_auth_bytes -= n

    def authenticated(self, w: Waiting) -> None:
        """`w`'s first frame verified: it no longer counts as unauthenticated."""
        self._waiting.pop(w, None)

    def closed(self, w: Waiting) -> None:
        """`w` is closed (whatever its state); nothing if the gate closed it itself."""
        if w.evicted:
            return
        self.open -= 1
        self._waiting.pop(w, None)
