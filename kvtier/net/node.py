"""A node: serves its store's blocks to peers over TCP (asyncio on a thread of its own) or UCX.

    HAS(keys)         -> OK n          the longest prefix of keys this node holds
    GET(keys)         -> OK n + blocks the bytes of that prefix, with a checksum each
    PUT(keys)+blocks  -> OK n          store them here (n: newly written)

Blocks leave straight from slot memory (the store holds them while they are sent) and
arrive by recv_into a buffer that goes to the store in one put. Every frame is
authenticated (kvtier/net/frames.py); a request for another namespace, a bad MAC, a stale
or malformed frame gets an ERR reply and the connection is closed; other peers are
served as before. The bytes move over a transport (transport.py): TCP by default,
UCX (ucx.py) with transport="ucx"; the protocol below is the same for both.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import TYPE_CHECKING

import numpy as np

from kvtier.checksum import block_checksum
from kvtier.errors import ConfigError
from kvtier.net.address import parse_address
from kvtier.net.directory import Directory
from kvtier.net.publisher import Publisher
from kvtier.net.frames import MAX_KEYS, Frame, FrameError, decode
from kvtier.net.transport import ServerConn, TcpServerConn, check_transport

if TYPE_CHECKING:
    from kvtier.store import Store

log = logging.getLogger("kvtier.node")


class Node:
    """Serves `store` to peers. `with Node(store, "127.0.0.1:0", secret) as node: node.address`."""

    def __init__(self, store: Store, listen: str = "127.0.0.1:7700", secret: bytes = b"", *,
                 directory: Directory | None = None, advertise: str | None = None,
                 request_timeout: float = 10.0, transport: str = "tcp") -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            raise ConfigError("a node needs the cluster's shared secret: at least 16 bytes")
        self.transport = check_transport(transport)
        self.store = store
        self.secret = bytes(secret)
        self.seed = store.keyer.seed
        self.block_bytes = store.layout.block_bytes
        self.request_timeout = request_timeout
        self.directory = directory      # where this node tells others what it holds (optional)
        self.advertise = advertise      # the address peers should use (default: where it listens)
        self.publisher: Publisher | None = None
        self._host, self._port = parse_address(listen)
        self.address = ""
        self.refused = 0          # frames refused (bad MAC, stale, malformed, other namespace)
        self.served = 0           # requests answered
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: socket.socket | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._ucx = None          # the UCX listener (ucx.py) when transport="ucx"

    # -- lifetime --------------------------------------------------------------------
    def start(self) -> Node:
        if self.transport == "ucx":
            from kvtier.net.ucx import UcxServer
            try:
                self._ucx = UcxServer(self, self._host, self._port)
            except Exception as e:     # ucxx raises its own types for a busy port and the like
                raise ConfigError(f"cannot listen (UCX) on {self._host}:{self._port}: {e}") from None
            self.address = self._ucx.address
            return self._start_publisher()
        self._thread = threading.Thread(target=self._run, name=f"kvtier-node-{self._port}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise ConfigError(f"cannot listen on {self._host}:{self._port}: {_why(self._error)}")
        return self._start_publisher()

    def _start_publisher(self) -> Node:
        if self.directory is not None:
            if not hasattr(self.directory, "ns"):     # not bound yet by the store's remote tier
                self.directory.bind(self.seed, lambda _addr, _keys: 0)
            self.publisher = Publisher(self.store, self.directory, self.advertise or self.address).start()
        return self

    def stop(self) -> None:
        if self.publisher is not None:
            self.publisher.stop()
            self.publisher = None
        if self._ucx is not None:
            self._ucx.close()
            self._ucx = None
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            srv = socket.create_server((self._host, self._port), reuse_port=False)
        except OSError as e:
            self._error = e
            self._ready.set()
            return
        srv.setblocking(False)
        self._server = srv
        host, port = srv.getsockname()[:2]
        self.address = f"{host}:{port}"
        loop.create_task(self._accept(srv))
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    async def _accept(self, srv: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(srv)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            loop.create_task(self.serve(TcpServerConn(conn, self.request_timeout)))

    # -- one connection ------------------------------------------------------------------
    async def serve(self, conn: ServerConn) -> None:
        """Answer one peer's requests until it goes away (any transport)."""
        try:
            while True:
                try:
                    body, mac = await conn.recv_head(first=True)
                except EOFError:
                    return
                req = decode(body, mac, self.secret, max_payload=MAX_KEYS * self.block_bytes)
                if req.ns != self.seed:
                    raise FrameError("request for another namespace: this node serves only its own")
                await asyncio.wait_for(self._answer(conn, req), self.request_timeout)
                self.served += 1
        except FrameError as e:
            self.refused += 1
            log.warning("node %s: refused a frame: %s", self.address, e)
            try:
                await asyncio.wait_for(conn.send(Frame("ERR", self.seed, error=str(e)).encode(self.secret)),
                                       self.request_timeout)
            except (OSError, EOFError, asyncio.TimeoutError):
                pass
        except (OSError, EOFError, asyncio.TimeoutError):
            pass   # the peer went away or stalled: drop the connection
        finally:
            conn.close()

    async def _answer(self, conn: ServerConn, req: Frame) -> None:
        store, bb = self.store, self.block_bytes
        if req.op == "HAS":
            if req.payload:
                raise FrameError("HAS carries no payload")
            n = store.lookup(req.keys).blocks
            await conn.send(Frame("OK", self.seed, n=n).encode(self.secret))
        elif req.op == "GET":
            if req.payload:
                raise FrameError("GET carries no payload")
            with store.hold(req.keys) as (rows, sums):
                head = Frame("OK", self.seed, n=len(rows), payload=len(rows) * bb, sums=sums)
                await conn.send(head.encode(self.secret))
                await conn.send_rows(rows)          # straight from slot memory
        elif req.op == "PUT":
            n = len(req.keys)
            if req.payload != n * bb or len(req.sums) != n:
                raise FrameError(f"PUT of {n} keys must carry {n * bb} bytes and {n} checksums")
            buf = np.empty((n, bb), dtype=np.uint8)
            await conn.recv_rows(buf)
            good = 0
            while good < n and block_checksum(buf[good]) == req.sums[good]:
                good += 1
            t = store.put(req.keys[:good], buf[:good]) if good else None
            await conn.send(Frame("OK", self.seed, n=t.blocks if t else 0).encode(self.secret))
        else:
            raise FrameError(f"a node does not answer {req.op}")


def _why(e: BaseException) -> str:
    """Why a listening socket could not be opened, and what to do."""
    import errno
    if isinstance(e, socket.gaierror):
        return f"cannot resolve the host name ({e.strerror}): give an address of this machine, e.g. 0.0.0.0"
    if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
        return "the port is in use (another node or program listens there): give another port, or 0 for any free one"
    if isinstance(e, OSError) and e.errno == errno.EADDRNOTAVAIL:
        return "that address is not one of this machine's: give one of its addresses, or 0.0.0.0 for all"
    if isinstance(e, OSError) and e.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges): give a port of 1024 or more"
    return str(e.strerror if isinstance(e, OSError) and e.strerror else e)
