"""Push a prompt's blocks to another node: the prefill side of a push hand-over.

Prefill/decode disaggregation with `kvtier router --handoff push` (docs/disaggregation.md):
the router picks the decode worker before prefill and names its node; the prefill worker
computes the prompt, then PUTs the prompt's blocks to that node (the node protocol's PUT:
authenticated, each block checksummed and verified by the receiver, bounded by the
client's deadline) before it answers. The decode worker then finds the prefix in its own
tiers, with no fetch at admission.

Blocks leave straight from the sender's slot memory (`Store.hold`, with the checksums the
store keeps per block, so nothing is hashed twice), in PUTs of at most `chunk` blocks so a
receiver never buffers a whole long prompt at once. What the receiver holds afterwards is
asked, not assumed (one HAS): a receiver whose top tier is smaller than the push evicts its
first blocks to store the last, so it may hold less than was sent. A receiver that fails or
holds less is a partial push: the caller keeps the blocks pinned so the decode worker can
still pull what is missing.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvtier.errors import ConfigError
from kvtier.net.client import PeerClient, PeerError
from kvtier.net.frames import check_secret

if TYPE_CHECKING:
    from kvtier.store import Store

log = logging.getLogger("kvtier.push")
CHUNK_BLOCKS = 256          # blocks per PUT: ~10 MiB at 40 KiB a block, the receiver's buffer at most
MAX_CLIENTS = 64            # receivers kept connected (the oldest is closed past it)


@dataclass
class Pushed:
    """One push: the leading blocks the receiver holds after it (as it answered a HAS at the
    end; 0 when it stopped answering), the blocks and bytes sent (those it held already are
    not sent again), and how long it took."""

    blocks: int = 0
    sent: int = 0
    bytes: int = 0
    seconds: float = 0.0
    error: str = ""


class Pusher:
    """Sends blocks of one store to other nodes. Thread-safe; one connection per receiver."""

    def __init__(self, secret: bytes, timeout: float = 2.0, chunk: int = CHUNK_BLOCKS) -> None:
        self.secret, self.timeout, self.chunk = check_secret(secret), timeout, chunk
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
        client: PeerClient | None = None
        try:
            client = self._client(store, address)
            # One HAS first (a round trip): blocks the receiver holds already (an earlier turn
            # of the session) are not sent again.
            out.blocks = have = client.has(keys)
            self._send(store, client, keys, have, out)
            if out.sent:
                out.blocks = client.has(keys)     # what it kept: a small top tier evicts what came first
        except (PeerError, ConfigError) as e:     # ConfigError: an address nobody can dial (port 0)
            out.error = e.reason if isinstance(e, PeerError) else str(e)
            out.blocks = self._held_after_failure(e, client, keys)
            log.warning("pushing %d blocks to %s failed after %d sent: %s", len(keys), address, out.sent, out.error)
        out.bytes = out.sent * store.layout.block_bytes
        out.seconds = time.perf_counter() - t0
        with self._lock:
            self.blocks += out.sent
            self.bytes += out.bytes
            self.seconds += out.seconds
            self.failures += bool(out.error)
        return out

    def _send(self, store: Store, client: PeerClient, keys: Sequence[bytes], start: int, out: Pushed) -> None:
        """PUT keys[start:] in chunks while this store still holds them, counting each chunk
        the receiver took in `out.sent` (so a failure part way still counts what went)."""
        for i in range(start, len(keys), self.chunk):
            part = keys[i:i + self.chunk]
            with store.hold(part) as (rows, sums):
                if rows:
                    client.put(part[:len(rows)], rows, sums=sums)
            out.sent += len(rows)
            if len(rows) < len(part):       # evicted here meanwhile: the rest is not a prefix
                break

    @staticmethod
    def _held_after_failure(e: Exception, client: PeerClient | None, keys: Sequence[bytes]) -> int:
        """What the receiver holds after a failed push: asked again (one HAS) only when it
        answered with a refusal; 0 (unknown, so nothing is released) when it did not answer."""
        if client is None or not isinstance(e, PeerError) or not e.refused:
            return 0
        try:
            return client.has(keys)
        except PeerError:
            return 0

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
