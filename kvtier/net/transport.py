"""Transports behind one interface: how frames and block payloads cross between nodes.

A transport moves three things: an encoded frame head (prefix | header | MAC, see
frames.py), and block rows, sent straight from slot memory and received straight into
the destination rows. The protocol (node.py, client.py) is written once against these
two small interfaces; "tcp" (asyncio/blocking sockets, the embedded default; TLS over it
with kvtier.net.Tls) is here, "ucx" (ucxx: RDMA and GPUDirect where the hardware has them) is in ucx.py.
"""
from __future__ import annotations

import asyncio
import socket
import ssl
import sys
import time
from typing import Awaitable, Callable, Protocol, Sequence, TypeVar

import numpy as np

from kvtier.errors import ConfigError
from kvtier.net.frames import MAC_BYTES, PREFIX_BYTES, foreign_start

T = TypeVar("T")

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

    async def recv_head(self, deadline: float | None, check: Callable[[bytes], int]) -> tuple[bytes, bytes, bytes]:
        """The next request's (prefix, header, MAC). `check(prefix)` validates the 36-byte
        prefix and returns the header's length (or raises FrameError) before the header is
        allocated. `deadline` (the loop's time) bounds the whole head; None: wait for its
        first byte without limit (between an authenticated peer's requests), then the request
        timeout from that byte. EOFError when the peer closed between requests."""

    async def send(self, head: bytes) -> None:
        """An encoded frame head."""

    async def send_rows(self, rows: Sequence[np.ndarray]) -> None:
        """Block payloads, straight from the given (slot) memory."""

    async def recv_rows(self, buf: np.ndarray) -> None:
        """Fill `buf` (n, block_bytes) with the payload that follows a PUT head."""

    def discard_unread(self) -> None:
        """Drop what the peer sent that is already here (at most 64 KiB), so the close that
        follows is a FIN its client reads the answer before, not a reset."""

    def close(self) -> None: ...


Check = Callable[[bytes], int]


class Channel(Protocol):
    """The calling side's connection to one peer: blocking, every call bounded by `deadline`
    (a time.monotonic() value); any failure raises OSError, EOFError or FrameError."""

    def request(self, head: bytes, rows: Sequence[np.ndarray] | None, deadline: float,
                check: Check) -> tuple[bytes, bytes, bytes]:
        """Send a frame head (and `rows` after it for a PUT); return the reply's (prefix,
        header, MAC), the prefix passed through `check` (which returns the header length)."""

    def recv_rows(self, rows: Sequence[np.ndarray], deadline: float,
                  on_row: Callable[[int], None]) -> None:
        """Receive the reply's payload into `rows`, calling on_row(i) as row i lands."""

    def close(self) -> None: ...


if sys.version_info >= (3, 11):
    async def within(aw: Awaitable[T], seconds: float) -> T:
        """`await aw`, cancelled with TimeoutError after `seconds`. Speed: asyncio.timeout
        runs it in the caller's task; wait_for (3.10) starts a task per call, a few event-loop
        turns that showed in every request's round trip."""
        async with asyncio.timeout(seconds):
            return await aw
else:                                  # pragma: no cover - Python 3.10
    within = asyncio.wait_for


# -- TCP --------------------------------------------------------------------------------
class TcpServerConn:
    """A node's side of a TCP connection (non-blocking socket on the node's event loop)."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock, self.timeout = sock, timeout
        self.loop = asyncio.get_running_loop()

    async def recv_head(self, deadline: float | None, check: Check) -> tuple[bytes, bytes, bytes]:
        prefix = bytearray(PREFIX_BYTES)
        got = 0
        if deadline is None:        # idle between requests: no limit until the first byte
            got = await self.loop.sock_recv_into(self.sock, prefix)
            if got == 0:
                raise EOFError
            deadline = self.loop.time() + self.timeout
        # The whole head within one deadline: a peer dripping bytes is dropped when it passes.
        return await within(self._head(prefix, got, check), max(0.0, deadline - self.loop.time()))

    async def _head(self, prefix: bytearray, got: int, check: Check) -> tuple[bytes, bytes, bytes]:
        view = memoryview(prefix)
        while got < PREFIX_BYTES:
            # A Redis client's first command (HELLO 3: 23 bytes) is shorter than a prefix: name
            # it as soon as its bytes show it, instead of waiting out the client's timeout.
            foreign = foreign_start(bytes(prefix[:got]))
            if foreign is not None:
                raise foreign
            k = await self.loop.sock_recv_into(self.sock, view[got:])
            if k == 0:
                raise EOFError
            got += k
        head = bytes(prefix)
        body = bytearray(check(head))       # allocated only once the prefix's tag verified
        await self._fill(memoryview(body))
        mac = bytearray(MAC_BYTES)
        await self._fill(memoryview(mac))
        return head, bytes(body), bytes(mac)

    async def _fill(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            k = await self.loop.sock_recv_into(self.sock, view[got:])
            if k == 0:
                raise EOFError
            got += k

    async def send(self, head: bytes) -> None:
        await self.loop.sock_sendall(self.sock, head)

    async def send_rows(self, rows: Sequence[np.ndarray]) -> None:
        for r in rows:                      # straight from slot memory
            await self.loop.sock_sendall(self.sock, memoryview(r).cast("B"))

    async def recv_rows(self, buf: np.ndarray) -> None:
        await self._fill(memoryview(buf).cast("B"))     # bounded by the node's deadline per request

    def discard_unread(self) -> None:
        for _ in range(16):
            try:
                if not self.sock.recv(4096, socket.MSG_DONTWAIT):
                    return
            except OSError:     # nothing more buffered (BlockingIOError), or gone
                return

    def close(self) -> None:
        self.sock.close()


class TlsServerConn:
    """A node's side of a TLS connection (asyncio streams over the node's event loop). The
    payload is encrypted, so it is copied on its way anyway: rows go out one at a time
    (drained after each, so at most about one row is buffered) and come in row by row."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float) -> None:
        self.reader, self.writer, self.timeout = reader, writer, timeout
        self.loop = asyncio.get_running_loop()

    async def recv_head(self, deadline: float | None, check: Check) -> tuple[bytes, bytes, bytes]:
        first = b""
        if deadline is None:
            first = await self.reader.read(PREFIX_BYTES)
            if not first:
                raise EOFError
            deadline = self.loop.time() + self.timeout
        return await within(self._head(first, check), max(0.0, deadline - self.loop.time()))

    async def _head(self, first: bytes, check: Check) -> tuple[bytes, bytes, bytes]:
        head = first + await self.reader.readexactly(PREFIX_BYTES - len(first))
        body = await self.reader.readexactly(check(head))
        return head, body, await self.reader.readexactly(MAC_BYTES)

    async def send(self, head: bytes) -> None:
        self.writer.write(head)
        await self.writer.drain()

    async def send_rows(self, rows: Sequence[np.ndarray]) -> None:
        for r in rows:
            self.writer.write(memoryview(r).cast("B"))     # encrypted (copied) as it is written
            await self.writer.drain()

    async def recv_rows(self, buf: np.ndarray) -> None:
        for i in range(len(buf)):
            buf[i] = np.frombuffer(await self.reader.readexactly(buf.shape[1]), dtype=np.uint8)

    def discard_unread(self) -> None:
        pass        # close() aborts a TLS connection anyway

    def close(self) -> None:
        self.writer.transport.abort()


class TcpChannel:
    """The calling side over one blocking TCP socket (TLS with `ssl_ctx`), opened on first use."""

    def __init__(self, addr: tuple[str, int], ssl_ctx: ssl.SSLContext | None = None) -> None:
        self.addr = addr
        self.ssl_ctx = ssl_ctx
        self.sock: socket.socket | None = None

    def _connect(self, deadline: float) -> socket.socket:
        sock = socket.create_connection(self.addr, timeout=_left(deadline))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.ssl_ctx is not None:
            try:
                sock.settimeout(_left(deadline))
                sock = self.ssl_ctx.wrap_socket(sock, server_hostname=self.addr[0])   # handshake, verified
            except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as e:
                sock.close()   # a plain node closes on a ClientHello (it answers strangers nothing)
                raise ssl.SSLError(f"the node closed the connection during the handshake ({e.strerror or e})") from None
            except BaseException:
                sock.close()
                raise
        return sock

    def request(self, head: bytes, rows: Sequence[np.ndarray] | None, deadline: float,
                check: Check) -> tuple[bytes, bytes, bytes]:
        if self.sock is None:
            self.sock = self._connect(deadline)
        sock = self.sock
        try:
            sock.settimeout(_left(deadline))
            sock.sendall(head)
            for r in (rows if rows is not None else ()):
                sock.settimeout(_left(deadline))
                sock.sendall(memoryview(r).cast("B"))
        except (BrokenPipeError, ConnectionResetError) as e:
            # A node refuses a PUT (another namespace or secret) without reading its payload and
            # closes: the send breaks, but the refusal that says why is here to read.
            try:
                prefix = _recv_exact(sock, PREFIX_BYTES, min(deadline, time.monotonic() + 1.0))
            except (OSError, EOFError):
                raise e from None
        else:
            try:
                prefix = _recv_exact(sock, PREFIX_BYTES, deadline)
            except EOFError:
                raise EOFError("the peer closed the connection without answering (a node with another cluster "
                               "secret, one that wants TLS, or another protocol version?)") from None
        body = _recv_exact(sock, check(prefix), deadline)
        return prefix, body, _recv_exact(sock, MAC_BYTES, deadline)

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
