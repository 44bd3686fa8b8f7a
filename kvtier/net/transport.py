"""Transports behind one interface: how frames and block payloads cross between nodes.

A transport moves three things: an encoded frame head (length | header | MAC, see
frames.py), and block rows, sent straight from slot memory and received straight into
the destination rows. The protocol (node.py, client.py) is written once against these
two small interfaces; "tcp" (asyncio/blocking sockets, the embedded default) is here,
"ucx" (ucxx: RDMA and GPUDirect where the hardware has them) is in ucx.py.
"""
from __future__ import annotations

import asyncio
import socket
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from kvtier.errors import ConfigError
from kvtier.net.frames import MAC_BYTES, header_length

TRANSPORTS = ("tcp", "ucx")


def check_transport(name: str) -> str:
    """Validate a transport name; "ucx" also needs ucxx importable (`pip install kvtier[ucx]`)."""
    if name not in TRANSPORTS:
        raise ConfigError(f"transport must be one of {TRANSPORTS}, got {name!r}")
    if name == "ucx":
        from kvtier.net.ucx import require_ucxx
        require_ucxx()
    return name


class ServerConn(Protocol):
    """One peer's connection as a node's event loop sees it."""

    async def recv_head(self, first: bool) -> tuple[bytes, bytes]:
        """The next request's (header, MAC); EOFError when the peer closed between requests.
        `first`: waiting for a new request (no deadline) rather than the rest of one."""

    async def send(self, head: bytes) -> None:
        """An encoded frame head."""

    async def send_rows(self, rows: Sequence[np.ndarray]) -> None:
        """Block payloads, straight from the given (slot) memory."""

    async def recv_rows(self, buf: np.ndarray) -> None:
        """Fill `buf` (n, block_bytes) with the payload that follows a PUT head."""

    def close(self) -> None: ...


class Channel(Protocol):
    """The calling side's connection to one peer: blocking, every call bounded by `deadline`
    (a time.monotonic() value); any failure raises OSError, EOFError or FrameError."""

    def request(self, head: bytes, rows: Sequence[np.ndarray] | None, deadline: float) -> tuple[bytes, bytes]:
        """Send a frame head (and `rows` after it for a PUT); return the reply's (header, MAC)."""

    def recv_rows(self, rows: Sequence[np.ndarray], deadline: float,
                  on_row: Callable[[int], None]) -> None:
        """Receive the reply's payload into `rows`, calling on_row(i) as row i lands."""

    def close(self) -> None: ...


# -- TCP --------------------------------------------------------------------------------
class TcpServerConn:
    """A node's side of a TCP connection (non-blocking socket on the node's event loop)."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock, self.timeout = sock, timeout
        self.loop = asyncio.get_running_loop()

    async def recv_head(self, first: bool) -> tuple[bytes, bytes]:
        prefix = await self._recv(4, first)
        body = await self._recv(header_length(prefix))
        return body, await self._recv(MAC_BYTES)

    async def send(self, head: bytes) -> None:
        await self.loop.sock_sendall(self.sock, head)

    async def send_rows(self, rows: Sequence[np.ndarray]) -> None:
        for r in rows:                      # straight from slot memory
            await self.loop.sock_sendall(self.sock, memoryview(r).cast("B"))

    async def recv_rows(self, buf: np.ndarray) -> None:
        view = memoryview(buf).cast("B")
        got = 0
        while got < len(view):
            k = await asyncio.wait_for(self.loop.sock_recv_into(self.sock, view[got:]), self.timeout)
            if k == 0:
                raise EOFError
            got += k

    async def _recv(self, n: int, first: bool = False) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = await (self.loop.sock_recv_into(self.sock, view[got:]) if first and got == 0 else
                       asyncio.wait_for(self.loop.sock_recv_into(self.sock, view[got:]), self.timeout))
            if k == 0:
                raise EOFError
            got += k
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()


class TcpChannel:
    """The calling side over one blocking TCP socket, opened on first use."""

    def __init__(self, addr: tuple[str, int]) -> None:
        self.addr = addr
        self.sock: socket.socket | None = None

    def request(self, head: bytes, rows: Sequence[np.ndarray] | None, deadline: float) -> tuple[bytes, bytes]:
        if self.sock is None:
            sock = socket.create_connection(self.addr, timeout=_left(deadline))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = sock
        sock = self.sock
        sock.settimeout(_left(deadline))
        sock.sendall(head)
        for r in (rows if rows is not None else ()):
            sock.settimeout(_left(deadline))
            sock.sendall(memoryview(r).cast("B"))
        body = _recv_exact(sock, header_length(_recv_exact(sock, 4, deadline)), deadline)
        return body, _recv_exact(sock, MAC_BYTES, deadline)

    def recv_rows(self, rows: Sequence[np.ndarray], deadline: float, on_row: Callable[[int], None]) -> None:
        assert self.sock is not None
        for i, r in enumerate(rows):
            _recv_into(self.sock, memoryview(r).cast("B"), deadline)
            on_row(i)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _left(deadline: float) -> float:
    return max(1e-3, deadline - time.monotonic())


def _recv_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    while got < len(view):
        sock.settimeout(_left(deadline))
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the peer closed the connection")
        got += k


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)
