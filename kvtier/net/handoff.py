"""Where a handed-over prefix is: a directory that knows, per request, which peer holds it.

Prefill/decode disaggregation (docs/disaggregation.md): a prefill worker computes a
prompt's KV into its own store and answers with the block keys and its node's address.
The decode worker registers them here as hints (key -> holder) before it admits the
request; its store's lookup then asks this directory, which confirms with the holder
(HAS, one round trip) how much of the hinted prefix it still has, and the remote tier
fetches that much, verified, layer by layer into the engine's pages. A holder that has
gone away answers nothing: the decode worker computes the prompt itself.

Keys with no hint go to an optional base directory (the `--peers` list or Redis), so a
decode worker still finds blocks the ordinary cluster way.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Sequence

from kvtier.net.directory import Directory, Key

MAX_HINTS = 1 << 16      # keys remembered (oldest forgotten first): a few hundred long prompts


class HandoffDirectory(Directory):
    """Hints from prefill answers first, then `base` (may be None)."""

    def __init__(self, base: Directory | None = None, max_hints: int = MAX_HINTS) -> None:
        self.base = base
        self.max_hints = max_hints
        self._hints: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()

    def bind(self, ns: bytes, ask: Callable[[str, Sequence[Key]], int]) -> None:
        super().bind(ns, ask)
        if self.base is not None:
            self.base.bind(ns, ask)

    def hint(self, keys: Sequence[bytes], holder: str) -> None:
        """`holder` (a node's host:port) has the blocks `keys` (a prefix, in order)."""
        with self._lock:
            for k in keys:
                self._hints[bytes(k)] = holder
                self._hints.move_to_end(bytes(k))
            while len(self._hints) > self.max_hints:
                self._hints.popitem(last=False)

    def hinted(self, keys: Sequence[Key]) -> tuple[str | None, int]:
        """The holder of the leading hinted run of `keys`, and its length."""
        with self._lock:
            holder, n = None, 0
            for k in keys:
                h = self._hints.get(bytes(k))          # type: ignore[arg-type]
                if h is None or (holder is not None and h != holder):
                    break
                holder, n = h, n + 1
            return holder, n

    def locate(self, keys: Sequence[Key]) -> list[str]:
        holder, n = self.hinted(keys)
        if holder is not None:
            held = self.ask(holder, keys[:n])         # 0 when the holder is gone or evicted them
            if held:
                return [holder] * held
        return self.base.locate(keys) if self.base is not None else []

    @property
    def publishes(self) -> bool:          # type: ignore[override]
        return self.base is not None and self.base.publishes

    @property
    def peers(self) -> list[str]:
        return list(getattr(self.base, "peers", []))

    def publish(self, node: str, added: Sequence[Key], removed: Sequence[Key]) -> None:
        if self.base is not None:
            self.base.publish(node, added, removed)

    def heartbeat(self, node: str) -> bool:
        return self.base.heartbeat(node) if self.base is not None else True

    def leave(self, node: str, held: Sequence[Key] = ()) -> None:
        if self.base is not None:
            self.base.leave(node, held)

    def sweep(self) -> int:
        return self.base.sweep() if self.base is not None else 0

    def close(self) -> None:
        if self.base is not None:
            self.base.close()
