"""Other nodes as the store's lowest tier: blocks this node lacks are fetched, not recomputed.

Lookup asks the peers (in parallel, one round trip each) how long a prefix of the keys
they hold past what is cached here, and get fetches it from the best holder straight into
the caller's buffers, verified; fetched blocks are then copied into the local top tier
(`promote`). A peer that is down, slow or wrong costs a miss within `timeout` seconds.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from kvtier.errors import ConfigError
from kvtier.net.client import PeerClient, PeerError
from kvtier.net.address import parse_address

log = logging.getLogger("kvtier.remote")


class RemoteTier:
    """`RemoteTier(peers=["10.0.0.2:7700", ...], secret=...)`, last in a store's tier list."""

    kind = "remote"
    persistent = False

    def __init__(self, peers: Sequence[str], secret: bytes, *, timeout: float = 0.5, promote: bool = True,
                 name: str = "remote") -> None:
        if isinstance(peers, str) or not peers:
            raise ConfigError("peers must be a non-empty list of 'host:port' addresses")
        for p in peers:
            parse_address(p)
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            raise ConfigError("the cluster's shared secret must be at least 16 bytes")
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive seconds, got {timeout}")
        self.peers = list(peers)
        self.secret = bytes(secret)
        self.timeout = timeout
        self.promote = promote
        self.name = name
        self.clients: list[PeerClient] = []
        self.errors = 0            # peer calls that failed (each a miss, never an exception)
        self._pool: ThreadPoolExecutor | None = None

    def attach(self, ns: bytes, block_bytes: int) -> None:
        """Bind to a store's namespace and block size (the store calls this)."""
        if self.clients:
            raise ConfigError(f"remote tier {self.name!r} is already in use by a store")
        self.clients = [PeerClient(p, self.secret, ns, block_bytes, self.timeout) for p in self.peers]
        self._pool = ThreadPoolExecutor(len(self.clients), thread_name_prefix="kvtier-remote")

    def locate(self, keys: Sequence[bytes]) -> tuple[int, PeerClient | None]:
        """The longest prefix of `keys` some peer holds, and that peer."""
        if not keys or self._pool is None:
            return 0, None
        answers = list(self._pool.map(lambda c: self._ask(c, keys), self.clients))
        best = max(range(len(answers)), key=answers.__getitem__)
        return (answers[best], self.clients[best]) if answers[best] else (0, None)

    def _ask(self, client: PeerClient, keys: Sequence[bytes]) -> int:
        try:
            return client.has(keys)
        except PeerError as e:
            self.errors += 1
            log.warning("%s", e)
            return 0

    def fetch(self, keys: Sequence[bytes], rows: Sequence[np.ndarray]) -> int:
        """Fetch the longest prefix of `keys` any peer holds into `rows`; returns how many arrived verified."""
        n, peer = self.locate(keys)
        if peer is None:
            return 0
        try:
            return peer.get(keys[:n], rows[:n])
        except PeerError as e:
            self.errors += 1
            log.warning("%s", e)
            return 0

    def info(self) -> dict[str, Any]:
        return {"peers": self.peers, "timeout_s": self.timeout, "errors": self.errors}

    def close(self) -> None:
        for c in self.clients:
            c.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
