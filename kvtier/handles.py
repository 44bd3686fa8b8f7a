"""Handles for loads and saves: what get() and put() return, to wait on or poll."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from kvtier.errors import TransferError


@dataclass
class Transfer:
    """A load (get) or save (put) of blocks. `wait()` blocks until the bytes have moved."""

    op: str                  # "get", "put" or "prefetch"
    blocks: int              # blocks moved (for put: newly written)
    nbytes: int
    present: int = 0         # put: blocks already cached (only refreshed)
    rejected: int = 0        # put: blocks not stored (admission or no room)
    loaded: int = 0          # get: leading blocks loaded and verified; recompute from here
    _future: Future | None = field(default=None, repr=False)

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> Transfer:
        """Block until the transfer is complete; re-raises its error as TransferError."""
        if self._future is not None:
            try:
                self._future.result(timeout)
            except TimeoutError:
                raise
            except Exception as e:
                raise TransferError(f"{self.op} of {self.blocks} blocks failed: {e}") from e
        return self
