"""The calling side of the node protocol: one blocking connection per peer, with deadlines.

Every call has a deadline: `timeout` seconds plus the time its bytes take at a floor rate
(MIN_RATE), so a peer that dies, stalls, drips bytes or sends garbage costs a PeerError
within a bounded time, which the remote tier turns into a miss. Received blocks land
straight in the caller's buffers and are verified against the MAC'd checksums. The bytes
move over a transport (transport.py): TCP by default, UCX with transport="ucx".
"""
from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import numpy as np

from kvtier.checksum import block_checksum
from kvtier.errors import KvtierError
from kvtier.net.address import parse_address
from kvtier.net.frames import Frame, FrameError, decode
from kvtier.net.transport import Channel, TcpChannel, check_transport

MIN_RATE = 100e6   # bytes/s a peer must sustain; slower counts as a stall
_VERIFY = ThreadPoolExecutor(1, thread_name_prefix="kvtier-verify")


class PeerError(KvtierError):
    """A peer could not answer in time or answered wrongly: treat its blocks as misses.
    `refused`: it answered, but refused the request or its reply was not acceptable (another
    secret or namespace, a malformed frame), rather than not answering at all."""

    def __init__(self, address: str, reason: str, refused: bool = False) -> None:
        super().__init__(f"peer {address}: {reason}")
        self.address, self.reason, self.refused = address, reason, refused


class PeerClient:
    """Talks to one node. Thread-safe (one request at a time per peer)."""

    def __init__(self, address: str, secret: bytes, ns: bytes, block_bytes: int, timeout: float = 0.5,
                 transport: str = "tcp") -> None:
        self.address = address
        self._addr = parse_address(address)
        self.transport = check_transport(transport)
        self.secret, self.ns, self.block_bytes, self.timeout = bytes(secret), ns, block_bytes, timeout
        self._chan: Channel | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._chan is not None:
            self._chan.close()
            self._chan = None

    def _channel(self) -> Channel:
        if self._chan is None:
            if self.transport == "ucx":
                from kvtier.net.ucx import UcxChannel
                self._chan = UcxChannel(self._addr)
            else:
                self._chan = TcpChannel(self._addr)
        return self._chan

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
        sums = [block_checksum(r) for r in rows]
        req = Frame("PUT", self.ns, list(keys), payload=len(keys) * self.block_bytes, sums=sums)
        return self._call(req, rows, send_rows=True)

    def _call(self, req: Frame, rows, send_rows: bool = False) -> int:
        moved = len(req.keys) * self.block_bytes if req.op in ("GET", "PUT") else 0
        deadline = time.monotonic() + self.timeout + moved / MIN_RATE
        with self._lock:
            try:
                chan = self._channel()
                body, mac = chan.request(req.encode(self.secret), rows if send_rows else None, deadline)
                reply = self._reply(body, mac)
                if req.op != "GET":
                    return reply.n
                return self._receive_blocks(chan, reply, rows, deadline)
            except (OSError, EOFError, FrameError) as e:
                self._drop()    # the connection's state is unknown now: start afresh next time
                raise PeerError(self.address, _reason(e), refused=isinstance(e, FrameError)) from None

    def ping(self) -> None:
        """One HAS of no keys: raises PeerError unless the peer answers, with this cluster's
        secret and for this namespace."""
        self.has([])

    def _reply(self, body: bytes, mac: bytes) -> Frame:
        reply = decode(body, mac, self.secret)
        if reply.op == "ERR":
            raise FrameError(f"refused: {reply.error}")
        if reply.op != "OK" or reply.ns != self.ns:
            raise FrameError(f"unexpected reply {reply.op} for another namespace" if reply.ns != self.ns
                             else f"unexpected reply {reply.op}")
        return reply

    def _receive_blocks(self, chan: Channel, reply: Frame, rows, deadline: float) -> int:
        n, bb = reply.n, self.block_bytes
        if not 0 <= n <= len(rows) or reply.payload != n * bb or len(reply.sums) != n:
            raise FrameError(f"GET reply of {n} blocks with {reply.payload} bytes does not add up")
        # Speed: each block is verified on a helper thread while the next one arrives
        # (the receive releases the GIL; hashing holds it), straight in the caller's buffers.
        checks: list[Future[int]] = [None] * n    # type: ignore[list-item]

        def landed(i: int) -> None:
            checks[i] = _VERIFY.submit(block_checksum, rows[i])

        chan.recv_rows(rows[:n], deadline, landed)
        good = 0
        while good < n and checks[good].result() == reply.sums[good]:
            good += 1
        return good


def _reason(e: BaseException) -> str:
    """A short reason for a failed call: "connection refused", "timed out", the frame error."""
    if isinstance(e, FrameError):
        return str(e)
    if isinstance(e, socket.timeout):
        return "no answer within the deadline"
    if isinstance(e, EOFError):
        return str(e) or "the peer closed the connection"
    if isinstance(e, socket.gaierror):
        return f"cannot resolve the host name ({e.strerror})"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror[:1].lower() + e.strerror[1:]
    return f"{type(e).__name__}: {e}"
