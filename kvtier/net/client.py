"""The calling side of the node protocol: one blocking connection per peer, with deadlines.

Every call has a deadline: `timeout` seconds plus the time its bytes take at a floor rate
(MIN_RATE), so a peer that dies, stalls, drips bytes or sends garbage costs a PeerError
within a bounded time, which the remote tier turns into a miss. Received blocks land
straight in the caller's buffers (recv_into) and are verified against the MAC'd checksums.
"""
from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import xxhash

from kvtier.errors import KvtierError
from kvtier.net.frames import MAC_BYTES, Frame, FrameError, decode, header_length
from kvtier.net.address import parse_address

MIN_RATE = 100e6   # bytes/s a peer must sustain; slower counts as a stall
_VERIFY = ThreadPoolExecutor(1, thread_name_prefix="kvtier-verify")


class PeerError(KvtierError):
    """A peer could not answer in time or answered wrongly: treat its blocks as misses."""


class PeerClient:
    """Talks to one node. Thread-safe (one request at a time per peer)."""

    def __init__(self, address: str, secret: bytes, ns: bytes, block_bytes: int, timeout: float = 0.5) -> None:
        self.address = address
        self._addr = parse_address(address)
        self.secret, self.ns, self.block_bytes, self.timeout = bytes(secret), ns, block_bytes, timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # -- requests --------------------------------------------------------------------
    def has(self, keys: Sequence[bytes]) -> int:
        """How long a prefix of `keys` the peer holds."""
        return self._call(Frame("HAS", self.ns, list(keys)), None)

    def get(self, keys: Sequence[bytes], rows: Sequence[np.ndarray]) -> int:
        """Fetch the peer's prefix of `keys` into `rows` (one writable uint8 row per key);
        returns how many leading rows arrived and passed verification."""
        return self._call(Frame("GET", self.ns, list(keys)), rows)

    def put(self, keys: Sequence[bytes], rows: Sequence[np.ndarray]) -> int:
        """Store blocks on the peer; returns how many it newly wrote."""
        sums = [xxhash.xxh3_64_intdigest(r) for r in rows]
        req = Frame("PUT", self.ns, list(keys), payload=len(keys) * self.block_bytes, sums=sums)
        return self._call(req, rows, send_rows=True)

    def _call(self, req: Frame, rows, send_rows: bool = False) -> int:
        moved = len(req.keys) * self.block_bytes if req.op in ("GET", "PUT") else 0
        deadline = time.monotonic() + self.timeout + moved / MIN_RATE
        with self._lock:
            try:
                sock = self._connect(deadline)
                sock.settimeout(max(1e-3, deadline - time.monotonic()))
                sock.sendall(req.encode(self.secret))
                if send_rows:
                    for r in rows:
                        sock.settimeout(max(1e-3, deadline - time.monotonic()))
                        sock.sendall(memoryview(r).cast("B"))
                reply = self._reply(sock, deadline)
                if req.op != "GET":
                    return reply.n
                return self._receive_blocks(sock, reply, rows, deadline)
            except (OSError, EOFError, FrameError) as e:
                self._drop()    # the connection's state is unknown now: start afresh next time
                raise PeerError(f"peer {self.address}: {type(e).__name__}: {e}") from None

    def _connect(self, deadline: float) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection(self._addr, timeout=max(1e-3, deadline - time.monotonic()))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def _reply(self, sock: socket.socket, deadline: float) -> Frame:
        body = _recv_exact(sock, header_length(_recv_exact(sock, 4, deadline)), deadline)
        reply = decode(body, _recv_exact(sock, MAC_BYTES, deadline), self.secret)
        if reply.op == "ERR":
            raise FrameError(f"refused: {reply.error}")
        if reply.op != "OK" or reply.ns != self.ns:
            raise FrameError(f"unexpected reply {reply.op} for another namespace" if reply.ns != self.ns
                             else f"unexpected reply {reply.op}")
        return reply

    def _receive_blocks(self, sock: socket.socket, reply: Frame, rows, deadline: float) -> int:
        n, bb = reply.n, self.block_bytes
        if not 0 <= n <= len(rows) or reply.payload != n * bb or len(reply.sums) != n:
            raise FrameError(f"GET reply of {n} blocks with {reply.payload} bytes does not add up")
        # Speed: each block is verified on a helper thread while the next one arrives
        # (recv_into releases the GIL; hashing holds it), straight in the caller's buffers.
        checks = []
        for i in range(n):
            _recv_into(sock, memoryview(rows[i]).cast("B"), deadline)
            checks.append(_VERIFY.submit(xxhash.xxh3_64_intdigest, rows[i]))
        good = 0
        while good < n and checks[good].result() == reply.sums[good]:
            good += 1
        return good


def _recv_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    while got < len(view):
        sock.settimeout(max(1e-3, deadline - time.monotonic()))
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the peer closed the connection")
        got += k


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)
