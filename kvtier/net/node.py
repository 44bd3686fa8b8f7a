"""A node: serves its store's blocks to peers over TCP (asyncio on a thread of its own) or UCX.

    HAS(keys)         -> OK n          the longest prefix of keys this node holds
    FIND(keys)        -> OK n          ... that it holds or its remote tier finds on peers
    GET(keys)         -> OK n + blocks the bytes of that prefix, with a checksum each
    PUT(keys)+blocks  -> OK n          store them here (n: newly written)

Blocks leave straight from slot memory (the store holds them while they are sent) and
arrive by recv_into a buffer that goes to the store in one put. Every frame is
authenticated (kvtier/net/frames.py) and its nonce checked against replays (replay.py); a
request for another namespace, a bad MAC, a stale, replayed or malformed frame gets an
ERR reply and the connection is closed; other peers are served as before. Hostile or
broken clients are bounded (limits.py: connections, bytes and time before a peer
authenticates) and cannot stop the accept loop (accept.py). The bytes move over a
transport (transport.py): TCP by default, TLS over it with `tls=Tls(cert, key)`, UCX
(ucx.py) with transport="ucx"; the protocol below is the same for all.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from contextlib import AbstractContextManager, asynccontextmanager
from typing import TYPE_CHECKING, AsyncIterator, TypeVar

import numpy as np

from kvtier.checksum import block_checksum
from kvtier.errors import ConfigError, KvtierError
from kvtier.net.accept import accept_forever, raise_open_files_limit
from kvtier.net.address import format_address, is_unspecified, listen_infos, parse_address
from kvtier.net.directory import Directory
from kvtier.net.publisher import Publisher
from kvtier.net.frames import (MAX_KEYS, REFUSAL, REQUESTS, ForeignProtocol, Frame, FrameError,
                               Prefix, check_secret, decode, read_prefix, request_seconds)
from kvtier.net.limits import Gate, NodeLimits, Waiting
from kvtier.net.replay import ReplayGuard
from kvtier.net.tls import Tls, check_tls
from kvtier.net.transport import ServerConn, TcpServerConn, TlsServerConn, check_transport, within

if TYPE_CHECKING:
    from kvtier.store import Store

log = logging.getLogger("kvtier.node")
MAX_FINDS = 8       # FINDs answered at once (each fans out to the node's peers); more wait their turn
T = TypeVar("T")


class Node:
    """Serves `store` to peers. `with Node(store, "127.0.0.1:0", secret) as node: node.address`."""

    def __init__(self, store: Store, listen: str = "127.0.0.1:7700", secret: bytes = b"", *,
                 directory: Directory | None = None, advertise: str | None = None,
                 request_timeout: float = 10.0, transport: str = "tcp", tls: Tls | None = None,
                 limits: NodeLimits | None = None) -> None:
        secret = check_secret(secret)
        self.transport = check_transport(transport)
        self.tls = check_tls(tls)
        if self.tls is not None and self.transport != "tcp":
            raise ConfigError("TLS is for the tcp transport; UCX brings its own transports (leave tls unset)")
        self._ssl: ssl.SSLContext | None = self.tls.server_context() if self.tls is not None else None
        if limits is not None and not isinstance(limits, NodeLimits):
            raise ConfigError(f"limits must be a kvtier.net.NodeLimits(...), not {type(limits).__name__}")
        self.limits = limits or NodeLimits()
        self.store = store
        self.secret = bytes(secret)
        self.seed = store.keyer.seed
        self.block_bytes = store.layout.block_bytes
        self.request_timeout = request_timeout
        self.directory = directory      # where this node tells others what it holds (optional)
        self.advertise = advertise      # the address peers should use (default: where it listens)
        self.publisher: Publisher | None = None
        self._host, self._port = parse_address(listen)
        check_advertised(self._host, directory is not None and directory.publishes, advertise)
        self.address = ""
        self.refused = 0          # frames refused (bad MAC, stale, replayed, malformed, other namespace)
        # Of them, frames, logged sparsely (a stranger's loop must not flood the log) and
        # counted apart for peers without the secret and with it, so a stranger's flood
        # cannot hide a misconfigured peer's refusals from the log, nor the other way round.
        self._refused_by_kind = {"without the secret": 0, "with the secret": 0}
        self.failed_handshakes = 0    # TLS handshakes that failed (logged sparsely too)
        self.served = 0           # requests answered
        self._finds = asyncio.Semaphore(MAX_FINDS)    # (bound to the node's loop at first use)
        self.gate = Gate(self.limits)                 # connections and pre-authentication bytes
        self.replays = ReplayGuard(capacity=self.limits.replay_entries)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: socket.socket | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._ucx = None          # the UCX listener (ucx.py) when transport="ucx"

    # -- lifetime --------------------------------------------------------------------
    def start(self) -> Node:
        check_listen_host(format_address(self._host, self._port))   # for UCX too: its listener takes only a port
        raise_open_files_limit()         # every peer is a file descriptor
        if self.transport == "ucx":
            from kvtier.net.ucx import UcxServer
            try:
                self._ucx = UcxServer(self, self._host, self._port)
            except Exception as e:     # ucxx raises its own types for a busy port and the like
                busy = ": the port is in use, or still held after a node on it was killed (up to a minute): " \
                       "wait, or give another port" if "busy" in str(e).lower() else ""
                raise ConfigError(f"cannot listen (UCX) on {self._host}:{self._port}: {e}{busy}") from None
            self.address = self._ucx.address
            return self._start_publisher()
        self._thread = threading.Thread(target=self._run, name=f"kvtier-node-{self._port}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            where = format_address(self._host, self._port)
            raise ConfigError(f"cannot listen on {where}: {listen_failure(self._error)}")
        return self._start_publisher()

    def _start_publisher(self) -> Node:
        if self.directory is not None:
            if not hasattr(self.directory, "ns"):     # not bound yet by the store's remote tier
                self.directory.bind(self.seed, lambda _addr, _keys: 0)
            self.publisher = Publisher(self.store, self.directory, self.advertise or self.address).start()
        return self

    def stop(self) -> None:
        """Stop serving: in-flight requests are cut, every connection closed. Safe in any
        state (never started, failed to start, already stopped)."""
        if self.publisher is not None:
            self.publisher.stop()
            self.publisher = None
        if self._ucx is not None:
            self._ucx.close()
            self._ucx = None
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:        # the loop is closed already: the thread has ended
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
            srv = socket.create_server((self._host, self._port), family=family, reuse_port=False,
                                       backlog=min(4096, socket.SOMAXCONN))
        except Exception as e:           # (any: start() waits for _ready and raises this)
            self._error = e
            self._ready.set()
            return
        srv.setblocking(False)
        self._server = srv
        host, port = srv.getsockname()[:2]
        self.address = format_address(host, port)
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)     # this thread's loop: asyncio helpers find it even at shutdown
        self._loop = loop
        loop.create_task(accept_forever(srv, self._accepted, log, f"node {self.address}"))
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            srv.close()
            asyncio.set_event_loop(None)
            loop.close()

    def _accepted(self, sock: socket.socket) -> None:
        """A new TCP connection: closed at once over the caps, else served on its own task."""
        gate, evicted = self.gate, self.gate.evicted
        w = gate.admit()
        if gate.evicted != evicted and _sparse(gate.evicted):
            log.warning("node %s: %d connections that sent nothing closed to admit newer ones (%d waiting "
                        "at NodeLimits.max_unauthenticated)", self.address, gate.evicted, gate.unauthenticated)
        if w is None:
            sock.close()
            if _sparse(gate.closed_over_cap):
                log.warning("node %s: %d connections closed at accept: over NodeLimits (%d open, %d "
                            "unauthenticated)", self.address, gate.closed_over_cap, gate.open, gate.unauthenticated)
            return
        assert self._loop is not None
        task = self._loop.create_task(self._tcp(sock, w))
        # Cancelled (evicted by the gate, or the node stops) maybe before it ran: close it here.
        task.add_done_callback(lambda t: sock.close() if t.cancelled() else None)
        w.close = task.cancel

    async def _tcp(self, sock: socket.socket, w: Waiting) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout     # the first frame's, counted from accept
        if self._ssl is None:
            await self._serve(TcpServerConn(sock, self.request_timeout), deadline, w)
            return
        try:
            reader = asyncio.StreamReader(limit=1 << 16)
            transport, _ = await asyncio.wait_for(loop.connect_accepted_socket(
                lambda: asyncio.StreamReaderProtocol(reader), sock, ssl=self._ssl,
                ssl_handshake_timeout=self.request_timeout), max(0.0, deadline - loop.time()))
        except asyncio.CancelledError:   # closed by the gate to admit a newer one, or the node stops
            self.gate.closed(w)
            raise
        except (OSError, EOFError, asyncio.TimeoutError, ssl.SSLError) as e:
            self.gate.closed(w)
            self.refused += 1
            self.failed_handshakes += 1
            if _sparse(self.failed_handshakes):
                log.warning("node %s: refused a connection: TLS handshake failed (%s)%s", self.address,
                            _short(e), _so_far(self.failed_handshakes, "failed TLS handshakes"))
            sock.close()
            return
        writer = asyncio.StreamWriter(transport, transport.get_protocol(), reader, loop)
        await self._serve(TlsServerConn(reader, writer, self.request_timeout), deadline, w)

    # -- one connection ------------------------------------------------------------------
    async def serve(self, conn: ServerConn) -> None:
        """Answer one peer's requests until it goes away (any transport): counted against
        the node's limits, closed at once over them."""
        w = self.gate.admit()
        if w is None:
            conn.close()
            return
        task = asyncio.current_task()
        w.close = task.cancel if task is not None else conn.close
        try:
            await self._serve(conn, asyncio.get_running_loop().time() + self.request_timeout, w)
        except asyncio.CancelledError:
            if not (w.evicted and task is not None):
                raise
            task.uncancel()              # closed to admit a newer connection: a normal end here

    async def _serve(self, conn: ServerConn, first_deadline: float, w: Waiting) -> None:
        """Answer requests on an admitted connection. Until its first frame's MAC verifies it
        is unauthenticated: that frame is due by `first_deadline` and its header is charged
        to the node's pre-authentication budget."""
        gate, authenticated = self.gate, False
        reserved = 0
        if w.evicted:       # evicted as its TLS handshake or first message completed (wait_for kept the result)
            conn.close()
            return
        # An ERR reply names the requester's own namespace (never this node's seed: a peer with
        # the cluster secret but another tenant's salt would build this tenant's keys from it).
        reply_ns = b""
        # Whether the peer's prefix tag verified (it holds the secret, or replays a frame of one
        # who does): a peer whose prefix fails gets frames.REFUSAL (an HTTP or Redis client: an answer in its protocol),
        # not an ERR it could send back as a frame of its own (and a reply sent back is refused
        # before the replay table).
        holds_secret = False
        fresh: Prefix | None = None

        def check(prefix: bytes) -> int:
            nonlocal reserved, holds_secret, fresh
            fresh = p = read_prefix(prefix, self.secret)
            holds_secret = True
            if not authenticated:
                if not gate.reserve(p.length):
                    raise FrameError("too many bytes buffered for unauthenticated peers: try again later")
                reserved = p.length
            return p.length

        try:
            while True:
                try:
                    if authenticated:     # between requests: bounded by the idle timeout
                        prefix, body, mac = await within(
                            conn.recv_head(None, check), gate.limits.idle_timeout + self.request_timeout)
                    else:
                        prefix, body, mac = await conn.recv_head(first_deadline, check)
                except EOFError:
                    return
                except asyncio.TimeoutError:
                    if authenticated:
                        gate.closed_idle += 1
                    raise
                finally:
                    gate.release(reserved)
                    reserved = 0
                req = decode(prefix, body, mac, self.secret, max_payload=MAX_KEYS * self.block_bytes)
                del body
                if req.op not in REQUESTS:
                    raise FrameError(f"{req.op} is a reply, not a request")
                # Only a request whose MAC verified is remembered: a reply sent back to this node
                # (this node's own ERR, MAC'd) never enters the replay table.
                assert fresh is not None
                self.replays.check(fresh.nonce, fresh.ts, time.time())
                if not authenticated:
                    authenticated = True
                    gate.authenticated(w)
                reply_ns = req.ns
                if req.ns != self.seed:
                    raise FrameError("request for another namespace (another model, revision, shard, layout "
                                     "or tenant salt): this node serves only its own")
                try:
                    # Bounded as the client's deadline is (frames.request_seconds): the request
                    # timeout plus the blocks' bytes at the floor rate, never a fixed timeout
                    # that a large GET or PUT could not meet.
                    await within(self._answer(conn, req),
                                 request_seconds(self.request_timeout, req.op, len(req.keys), self.block_bytes))
                except FrameError:
                    raise
                except KvtierError as e:    # the store refused (closed; a PUT it cannot fit): an ERR too
                    raise FrameError(f"{req.op} refused: {e}") from None
                self.served += 1
        except FrameError as e:
            self.refused += 1
            kind = "with the secret" if holds_secret else "without the secret"
            self._refused_by_kind[kind] += 1
            n = self._refused_by_kind[kind]
            if _sparse(n):
                log.warning("node %s: refused a frame: %s%s", self.address, e,
                            _so_far(n, f"frames refused from peers {kind}"))
            try:
                if not holds_secret:
                    if isinstance(e, ForeignProtocol) and e.reply:    # curl, redis-py: an answer they show
                        await asyncio.wait_for(conn.send(e.reply), self.request_timeout)
                        conn.discard_unread()
                    else:
                        await asyncio.wait_for(conn.send(REFUSAL), self.request_timeout)
                elif not isinstance(e, _Answered):        # an _Answered one's ERR went out already
                    await asyncio.wait_for(conn.send(Frame("ERR", reply_ns, error=str(e)).encode(self.secret)),
                                           self.request_timeout)
            except (OSError, EOFError, asyncio.TimeoutError):
                pass
        except (OSError, EOFError, asyncio.TimeoutError):
            pass   # the peer went away or stalled: drop the connection
        finally:
            gate.closed(w)
            conn.close()

    async def _answer(self, conn: ServerConn, req: Frame) -> None:
        store, bb, re = self.store, self.block_bytes, req.nonce
        if req.op == "HAS":
            if req.payload:
                raise FrameError("HAS carries no payload")
            n = store.lookup(req.keys, local=True).blocks     # only its own blocks: never its peers'
            await conn.send(Frame("OK", self.seed, n=n, re=re).encode(self.secret))
        elif req.op == "FIND":
            # What a GET through this node's store would load: its own prefix, then what its
            # peers hold past it (an engine's scheduler in another process asks its worker's
            # node this). Peers are asked HAS, never FIND, so lookups cannot chain or loop;
            # the round trips run off the event loop.
            if req.payload:
                raise FrameError("FIND carries no payload")
            async with self._finds:    # each FIND asks every peer: bounded, whoever sends them
                hit = await asyncio.get_running_loop().run_in_executor(None, store.lookup, req.keys)
            # `sums` carries each found block's tier here (0 = the fastest; past the local tiers:
            # the remote), so a scheduler can tell host hits from disk hits (vLLM's metrics)
            await conn.send(Frame("OK", self.seed, n=hit.blocks, sums=list(hit.tiers[:hit.blocks]),
                                  re=re).encode(self.secret))
        elif req.op == "GET":
            if req.payload:
                raise FrameError("GET carries no payload")
            async with _off_loop(store.hold(req.keys)) as (rows, sums):
                head = Frame("OK", self.seed, n=len(rows), payload=len(rows) * bb, sums=sums, re=re)
                await conn.send(head.encode(self.secret))
                await conn.send_rows(rows)          # straight from slot memory
        elif req.op == "PUT":
            n = len(req.keys)
            if req.payload != n * bb or len(req.sums) != n:
                raise FrameError(f"PUT of {n} keys must carry {n * bb} bytes and {n} checksums")
            room = store.tiers[0].capacity_blocks
            if n > room:              # refused from its header: no buffer of its size is allocated
                why = f"PUT refused: {n} blocks cannot fit in this node's top tier of {room} blocks: put fewer at a time"
                await conn.send(Frame("ERR", req.ns, error=why).encode(self.secret))
                # Its bytes are read into one small buffer and dropped (bounded by the request's
                # deadline): closing with them unread would reset the connection, and the peer,
                # still sending, would lose the answer.
                scratch = np.empty((max(1, (1 << 20) // bb), bb), dtype=np.uint8)
                left = n
                while left:
                    k = min(left, len(scratch))
                    await conn.recv_rows(scratch[:k])
                    left -= k
                raise _Answered(why)
            buf = np.empty((n, bb), dtype=np.uint8)
            await conn.recv_rows(buf)
            stored = await asyncio.get_running_loop().run_in_executor(None, _verified_put, store, req, buf)
            await conn.send(Frame("OK", self.seed, n=stored, re=re).encode(self.secret))
        else:
            raise FrameError(f"a node does not answer {req.op}")


class _Answered(FrameError):
    """A refusal whose ERR reply was sent already: the connection is closed, no second reply."""


# The store's side of a request (hashing, disk reads and writes, evictions) runs on a worker
# thread, never on the event loop: one peer's GET from disk or large PUT must not stall the
# answers every other peer is waiting for (a HAS has a deadline of a fraction of a second).
def _verified_put(store: Store, req: Frame, buf: np.ndarray) -> int:
    """Store the blocks of a PUT up to the first whose bytes do not match its checksum;
    the number newly written."""
    good = 0
    while good < len(req.keys) and block_checksum(buf[good]) == req.sums[good]:
        good += 1
    return store.put(req.keys[:good], buf[:good]).blocks if good else 0


@asynccontextmanager
async def _off_loop(cm: AbstractContextManager[T]) -> AsyncIterator[T]:
    """Enter a blocking context manager (a store's hold: disk reads, first checksums) on a
    worker thread; its exit (letting the hold go) is quick and runs here. If the request
    is cancelled (its deadline) while the thread is entering, the thread still finishes
    and the hold is then let go: nothing stays held for a request that is gone."""
    entering = asyncio.get_running_loop().run_in_executor(None, cm.__enter__)
    try:
        value = await asyncio.shield(entering)
    except asyncio.CancelledError:
        entering.add_done_callback(lambda f: f.cancelled() or f.exception() or cm.__exit__(None, None, None))
        raise
    try:
        yield value
    except BaseException as e:
        if not cm.__exit__(type(e), e, e.__traceback__):
            raise
    else:
        cm.__exit__(None, None, None)


def _sparse(n: int) -> bool:
    """Whether the n-th occurrence of a repeated event is logged: 1, 10, 100, 1000, then every 10,000th."""
    return n in (1, 10, 100, 1000) or (n > 0 and n % 10000 == 0)


def _so_far(n: int, what: str) -> str:
    """The count after a sparsely logged message (see _sparse): nothing the first time."""
    return "" if n == 1 else f" ({n} {what} so far; only the 1st, 10th, 100th, ... are logged)"


def check_advertised(host: str, publishes: bool, advertise: str | None) -> None:
    """A node that publishes its address (to a directory) must publish one other machines can
    dial: ConfigError when it listens on `host` = every interface (0.0.0.0, ::) with no
    `advertise`, and for an advertised address that is malformed or names port 0. The CLIs
    call it too, before a model loads."""
    if advertise is not None:
        parse_address(advertise, any_port=False)
    elif publishes and is_unspecified(host):
        shown = f"[{host}]" if ":" in host else host
        raise ConfigError(f"a node listening on {shown} (every interface) would publish {shown} to the directory, "
                          "which no other machine can reach: give --advertise HOST:PORT (advertise='HOST:PORT' "
                          "in Python), the address peers should use")


def check_listen_host(listen: str, what: str = "listen") -> None:
    """`listen`'s host must resolve to an address to listen on, else a ConfigError that names
    it and what to give; `what` is where it came from (Node's `listen`, a CLI's flag).
    Node.start calls it, the CLIs too, before any memory is taken (socket.create_server turns
    a failed lookup into a bare OSError)."""
    host, port = parse_address(listen)
    try:
        listen_infos(host, port)
    except ValueError as why:
        raise ConfigError(f"{what} {listen!r}: {host!r} is not an address this machine can listen on ({why}): "
                          "give one of its addresses, e.g. 127.0.0.1, or 0.0.0.0 for all of them") from None


def _short(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return str(getattr(e, "reason", None) or getattr(e, "strerror", None) or e) or type(e).__name__


def listen_failure(e: BaseException) -> str:
    """Why a listening socket could not be opened, and what to do."""
    import errno
    import os
    if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
        return "the port is in use (another node or program listens there): give another port, or 0 for any free one"
    if isinstance(e, OSError) and e.errno == errno.EADDRNOTAVAIL:
        return "that address is not one of this machine's: give one of its addresses, or 0.0.0.0 for all"
    if isinstance(e, OSError) and e.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges): give a port of 1024 or more"
    if isinstance(e, OSError) and e.errno == errno.EMFILE:
        return "too many open files: raise the limit (ulimit -n) or close other connections"
    # (os.strerror: create_server's own strerror repeats the address as a tuple)
    return os.strerror(e.errno) if isinstance(e, OSError) and e.errno and e.errno > 0 else str(e) or type(e).__name__
