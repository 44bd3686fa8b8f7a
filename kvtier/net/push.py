"""Push a prompt's blocks to another node: the prefill side of a push hand-over.

Prefill/decode disaggregation with `kvtier router --handoff push` (docs/disaggregation.md):
the router picks the decode worker before prefill and names its node; the prefill worker
computes the prompt, then PUTs the prompt's blocks to that node (the node protocol's PUT:
authenticated, each block checksummed and verified by the receiver, bounded by the
client's deadline) before it answers. The decode worker then finds the prefix in its own
tiers, with no fetch at admission.

Blocks leave straight from the sender's slot memory (`Store.hold`, with the checksums the
store keeps per block, so nothing is hashed twice), in PUTs of at most `chunk` blocks so a
receiver never buffers a whole long prompt at once. A receiver that fails is a partial push:
the caller keeps the blocks pinned so the decode worker can still pull what is missing.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvtier.net.client import PeerClient, PeerError

if TYPE_CHECKING:
    from kvtier.store import Store

log = logging.getLogger("kvtier.push")
CHUNK_BLOCKS = 256          # blocks per PUT: ~10 MiB at 40 KiB a block, the receiver's buffer at most
MAX_CLIENTS = 64            # receivers kept connected (the oldest is closed past it)


@dataclass
class Pushed:
    """One push: the leading blocks the receiver holds after it, the blocks and bytes sent
    (those it held already are not sent again), and how long it took."""

    blocks: int = 0
    sent: int = 0
    bytes: int = 0
    seconds: float = 0.0
    error: str = ""


class Pusher:
    """Sends blocks of one store to other nodes. Thread-safe; one connection per receiver."""

    def __init__(self, secret: bytes, timeout: float = 2.0, chunk: int = CHUNK_BLOCKS) -> None:
        self.secret, self.timeout, self.chunk = bytes(secret), timeout, chunk
        self.blocks = 0             # totals sent, for /kvtier/load
        self.bytes = 0
        self.seconds = 0.0
        self.failures = 0
        self._clients: OrderedDict[str, PeerClient] = OrderedDict()
        self._lock = threading.Lock()

    def _client(self, store: Store, address: str) -> PeerClient:
        with self._lock:
            c = self._clients.get(address)
            if c is None:
                c = self._clients[address] = PeerClient.for_store(store, address, self.secret, timeout=self.timeout)
                while len(self._clients) > MAX_CLIENTS:
                    self._clients.popitem(last=False)[1].close()
            self._clients.move_to_end(address)
            return c

    def push(self, store: Store, keys: Sequence[bytes], address: str) -> Pushed:
        """PUT the longest cached prefix of `keys` to the node at `address` (blocking: run it
        off the event loop). Never raises for the receiver's faults: they end the push early."""
        out = Pushed()
        t0 = time.perf_counter()
        bb = store.layout.block_bytes
        try:
            client = self._client(store, address)
            # One HAS first (a round trip): blocks the receiver holds already (an earlier turn
            # of the session) are not sent again.
            out.blocks = have = client.has(keys)
            for i in range(have, len(keys), self.chunk):
                part = keys[i:i + self.chunk]
                with store.hold(part) as (rows, sums):
                    if rows:
                        client.put(part[:len(rows)], rows, sums=sums)
                out.blocks += len(rows)
                out.sent += len(rows)
                if len(rows) < len(part):       # evicted here meanwhile: the rest is not a prefix
                    break
        except PeerError as e:
            out.error = e.reason
            log.warning("pushing %d blocks to %s failed after %d: %s", len(keys), address, out.blocks, e.reason)
        out.bytes = out.sent * bb
        out.seconds = time.perf_counter() - t0
        with self._lock:
            self.blocks += out.sent
            self.bytes += out.bytes
            self.seconds += out.seconds
            self.failures += bool(out.error)
        return out

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
