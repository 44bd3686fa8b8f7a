"""Other nodes behind a store: blocks this node lacks are fetched, not recomputed.

Not a tier: the index never holds remote blocks and nothing is evicted to a peer. A store
is given one as `Store(..., remote=Remote(peers, secret))`.

Lookup asks the directory which node holds each block of the prefix past what is cached
here; get fetches each run of blocks from its holder straight into the caller's buffers,
verified, and the fetched blocks are then copied into the local top tier (`promote`). A
peer or directory that is down, slow or wrong costs a miss within `timeout` seconds.

A peer that fails is retried with backoff (kvtier/net/health.py): until its next try,
asking it costs a miss at once, without a connection attempt, and its going away and
coming back are logged once each, not once per lookup.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from kvtier.errors import ConfigError
from kvtier.net.address import parse_address
from kvtier.net.client import PeerClient, PeerError
from kvtier.net.directory import Directory, DirectoryError, PeerList
from kvtier.net.frames import check_secret
from kvtier.net.health import Health
from kvtier.net.tls import Tls, check_tls
from kvtier.net.transport import check_transport

log = logging.getLogger("kvtier.remote")
# Peers whose state is kept (a health each, a client for fetches and one for lookups, each
# client a kept connection), the least recently used forgotten past it: the addresses come
# from a directory, which may name any number over time. Half a node's default
# NodeLimits.max_connections in addresses, so at most that many kept connections.
MAX_PEERS = 512


class Remote:
    """`Remote(["10.0.0.2:7700", ...], secret)` or `Remote(directory=RedisDirectory(url), secret=...)`:
    pass it as `Store(..., remote=...)`."""

    def __init__(self, peers: Sequence[str] | None = None, secret: bytes = b"", *, directory: Directory | None = None,
                 timeout: float = 0.5, promote: bool = True, name: str = "remote", transport: str = "tcp",
                 tls: Tls | None = None) -> None:
        if (peers is None) == (directory is None):
            raise ConfigError("give a Remote either peers=['host:port', ...] or directory=RedisDirectory(url)")
        secret = check_secret(secret)
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive seconds, got {timeout}")
        self.transport = check_transport(transport)    # "tcp" or "ucx": how peers are reached
        self.tls = check_tls(tls)                       # Tls(ca=FILE): peers serve TLS
        if self.tls is not None:
            if self.transport != "tcp":
                raise ConfigError("TLS is for the tcp transport; UCX brings its own transports (leave tls unset)")
            self.tls.client_context()                   # a bad CA file is an error now, not a miss per call
        self.directory = directory if directory is not None else PeerList(peers)   # type: ignore[arg-type]
        self.secret = bytes(secret)
        self.timeout = timeout
        self.promote = promote
        self.name = name
        self.errors = 0            # peer or directory calls that failed (each a miss, never an exception)
        # (address, for lookups) -> client, and address -> health: least recently used first
        self._clients: OrderedDict[tuple[str, bool], PeerClient] = OrderedDict()
        self._health: OrderedDict[str, Health] = OrderedDict()
        self._lock = threading.Lock()
        self._ns = b""
        self._block_bytes = 0

    def attach(self, ns: bytes, block_bytes: int) -> None:
        """Bind to a store's namespace and block size (the store calls this)."""
        if self._block_bytes:
            raise ConfigError(f"remote tier {self.name!r} is already in use by a store")
        self._ns, self._block_bytes = ns, block_bytes
        self.directory.bind(ns, self._ask)

    def client(self, address: str, lookup: bool = False) -> PeerClient:
        """The client for `address`: one for fetches, one for lookups (`lookup`), so a HAS
        never queues behind a long GET on the one connection (a client sends one request at
        a time: an engine's lookup, asked while its loader fetched from that peer, timed out
        and marked the peer down). PeerError for an address no node can have (a directory
        entry or a hand-over hint gone wrong): a miss, like a peer that does not answer."""
        evicted: list[PeerClient] = []
        with self._lock:
            c = self._clients.get((address, lookup))
            if c is None:
                try:
                    parse_address(address, any_port=False)
                except ConfigError as e:
                    raise PeerError(address, str(e)) from None
                c = self._clients[(address, lookup)] = PeerClient(address, self.secret, self._ns, self._block_bytes,
                                                                     self.timeout, transport=self.transport,
                                                                     tls=self.tls, wait_busy=not lookup)
                while len(self._clients) > 2 * MAX_PEERS:
                    evicted.append(self._clients.popitem(last=False)[1])
            else:
                self._clients.move_to_end((address, lookup))
        for old in evicted:     # outside the lock: closing waits for a request in flight on that client
            old.close()
        return c

    def health(self, address: str) -> Health:
        """Whether `address` answers, and when to try it next."""
        with self._lock:
            h = self._health.get(address)
            if h is None:
                h = self._health[address] = Health(f"peer {address}", log)
                while len(self._health) > MAX_PEERS:
                    self._health.popitem(last=False)
            else:
                self._health.move_to_end(address)
            return h

    def _call(self, address: str, call, lookup: bool = False) -> Any:
        """`call(client)` on the peer at `address`; PeerError at once while it is backing off."""
        h = self.health(address)
        if not h.attempt():
            self.errors += 1
            raise PeerError(address, f"not answering; next try in {h.retry_in():.1f} s")
        try:
            out = call(self.client(address, lookup))
        except PeerError as e:
            self.errors += 1
            if not e.busy:                 # our own client was busy: a miss, not the peer's fault
                h.failed(e.reason, "refusing requests" if e.refused else "unreachable")
            raise
        h.succeeded()
        return out

    def _ask(self, address: str, keys: Sequence[bytes]) -> int:
        try:
            return self._call(address, lambda c: c.has(keys), lookup=True)
        except PeerError:
            return 0        # logged by the peer's Health when it went away

    def probe(self, only_down: bool = False) -> dict[str, str | None]:
        """Ask each listed peer (or only those down and due for a retry) whether it answers,
        in parallel: {address: None if it does, else why not}. Failures are logged once, by
        the peer's Health; a node calls this at start and then now and again."""
        peers = list(getattr(self.directory, "peers", []))
        if only_down:
            peers = [p for p in peers if self.health(p).down and self.health(p).retry_in() == 0]
        if not peers:
            return {}

        def one(address: str) -> str | None:
            try:
                self._call(address, lambda c: c.ping(), lookup=True)
                return None
            except PeerError as e:
                return e.reason
        with ThreadPoolExecutor(len(peers), thread_name_prefix="kvtier-probe") as pool:
            return dict(zip(peers, pool.map(one, peers)))

    def locate(self, keys: Sequence[bytes]) -> list[str]:
        """The holder of each block of the longest prefix of `keys` some peer holds."""
        try:
            return self.directory.locate(keys)
        except DirectoryError as e:     # the directory logs when it goes away and comes back
            self.errors += 1
            log.debug("%s", e)
            return []

    def fetch(self, keys: Sequence[bytes], rows: Sequence[np.ndarray]) -> int:
        """Fetch the longest prefix of `keys` the peers hold into `rows`; returns how many
        leading blocks arrived verified (a peer that fails part way still gives those)."""
        holders = self.locate(keys)
        got = i = 0
        while i < len(holders):
            j = i
            while j < len(holders) and holders[j] == holders[i]:
                j += 1
            try:
                k = self._call(holders[i], lambda c: c.fetch(keys[i:j], rows[i:j]))
            except PeerError as e:
                got += e.loaded      # the blocks that arrived verified before it failed
                break
            got += k
            if k < j - i:
                break
            i = j
        return got

    def info(self) -> dict[str, Any]:
        with self._lock:      # every client() call reorders _clients: read it under the lock
            contacted = sorted({address for address, _ in self._clients})
        return {"directory": type(self.directory).__name__, "transport": self.transport, "tls": self.tls is not None,
                "timeout_s": self.timeout,
                "errors": self.errors,
                "peers_contacted": contacted}

    def close(self) -> None:
        with self._lock:
            clients = list(self._clients.values())
        for c in clients:
            c.close()
        self.directory.close()
