"""Whether a service this node calls (Redis, a peer) answers, and when to try it again.

A service that fails is marked down and retried with exponential backoff (FIRST_S,
doubling up to CAP_S); calls in between fail fast without touching the network, so a
dead Redis or peer costs neither a connect timeout per lookup nor a log line per call.
The state is logged once per change: "X unreachable (why): retrying" when it goes down,
"X reachable again" when a call succeeds after that.
"""
from __future__ import annotations

import logging
import threading
import time

FIRST_S = 0.1
CAP_S = 5.0


class Health:
    """`if h.attempt(): try: call(); h.succeeded() except E as e: h.failed(str(e))`."""

    def __init__(self, what: str, log: logging.Logger, first_s: float = FIRST_S, cap_s: float = CAP_S) -> None:
        self.what = what              # "Redis at redis://10.0.0.9:6379", "peer 10.0.0.2:7700"
        self.log = log
        self.first_s, self.cap_s = first_s, cap_s
        self.failures = 0             # consecutive failed attempts (0: up)
        self._delay = 0.0
        self._retry_at = 0.0          # time.monotonic() when the next attempt may go out
        self._down_since = 0.0
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return self.failures > 0

    def retry_in(self) -> float:
        """Seconds until the next attempt may go out (0 when up or due)."""
        return max(0.0, self._retry_at - time.monotonic()) if self.down else 0.0

    def attempt(self) -> bool:
        """Whether to call the service now: always while it is up; while it is down, once
        per backoff interval (the caller that gets True makes the one attempt)."""
        if not self.down:
            return True
        with self._lock:
            now = time.monotonic()
            if not self.down:
                return True
            if now < self._retry_at:
                return False
            self._retry_at = now + self._delay     # the others wait for this attempt's outcome
            return True

    def succeeded(self) -> None:
        if not self.down:
            return
        with self._lock:
            if not self.down:
                return
            self.log.warning("%s reachable again (after %.1f s)", self.what, time.monotonic() - self._down_since)
            self.failures, self._delay, self._retry_at = 0, 0.0, 0.0

    def failed(self, reason: str, state: str = "unreachable") -> None:
        """A call failed; `state` words it in the log ("unreachable", "refusing requests")."""
        with self._lock:
            now = time.monotonic()
            if not self.down:
                self._down_since = now
                self._delay = self.first_s
                self.log.warning("%s %s (%s): retrying, backing off up to %g s between tries",
                                 self.what, state, reason, self.cap_s)
            else:
                self._delay = min(self._delay * 2, self.cap_s)
            self.failures += 1
            self._retry_at = now + self._delay
