"""UCX transport through ucxx (optional: `pip install kvtier[ucx]`): RDMA and GPUDirect RDMA
where the hardware has them, TCP or shared memory otherwise (UCX picks; UCX_TLS narrows it).

The same frames as over TCP: a frame head (prefix | header | MAC) travels as one UCX
active message (so the receiver learns its size without a length round trip), and each
block row as one tagged message, sent straight from slot memory and received straight
into the destination row. Tagged messages on one endpoint arrive in order, so rows match
the header's order; a failed or timed-out call aborts the endpoint (its pending receives
are cancelled before the caller gets its miss) and the next call connects afresh. An
endpoint whose reply never came is kept open instead, never freed (_quarantine: ucxx cannot
cancel an active-message receive, and a freed endpoint's stale receive took a later
endpoint's first reply).

ucxx keeps one worker per process whose progress is tied to one asyncio loop, so all UCX
work of a process (a node's listener and every client channel) runs on one loop thread
here; blocking callers wait on it with a deadline, never longer. That runtime (ucxx's
context and worker: 19 file descriptors and three threads here) runs while something holds
a Lease on it (a PeerClient, a channel with an endpoint, a node's listener) and is given
back when the last lets go, so closing the last UCX store leaves nothing behind; except
where ucxx itself can no longer free its worker (a receive left waiting: _left_waiting),
then it stays, once, for the process's life.

A dead peer fails a call at once, as over TCP: a request in flight is cancelled by ucxx when
its endpoint fails, and a connection is watched through its endpoint's close callback (ucxx's
own connect waited out its whole timeout when the refusal came as it posted its handshake).
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, Sequence, TypeVar

import numpy as np

from kvtier.errors import ConfigError
from kvtier.net.address import format_address, is_unspecified
from kvtier.net.frames import MAC_BYTES, MAX_HEADER, PREFIX_BYTES, FrameError

T = TypeVar("T")
log = logging.getLogger("kvtier.ucx")


def require_ucxx() -> Any:
    """The ucxx module, or a ConfigError saying how to get it."""
    # ucxx sets UCX variables its UCX build does not use, and UCX warns about them on
    # stdout, which corrupts machine-readable output: silence that one warning by default.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # UCX (and ucxx, through it) logs to stdout: a dead peer's "UCXX ERROR ... endpoint
    # error callback" line landed in `--json` output. Its log goes to stderr instead.
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    try:
        import ucxx
    except ImportError as e:
        raise ConfigError(f"transport 'ucx' needs ucxx: pip install 'kvtier[ucx]' ({e})") from None
    return ucxx


class _Runtime:
    """The process's UCX runtime: an event loop on a daemon thread of its own, and ucxx's
    context and worker, which live on that loop. Counted (Lease): started by the first
    holder, given back (ucxx reset, the loop and its thread stopped) when the last lets go,
    unless it is kept (`kept` says why) for the process's life, because ucxx cannot free its
    worker any more (keep()), or `run()` was called from outside this module (the caller may
    hold ucxx objects of its own, e.g. the transport benchmark's raw endpoints)."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _holders = 0
    kept: str | None = None

    @classmethod
    def loop(cls, pin: bool = False) -> asyncio.AbstractEventLoop:
        """The running loop, started if need be; `pin`: keep it for the process's life."""
        with cls._lock:
            if pin:
                cls.keep("ucx.run() was called from outside kvtier.net.ucx")
            return cls._start()

    @classmethod
    def keep(cls, why: str) -> None:
        """Never give the runtime back (no lock: called on the UCX loop, also while
        release() waits on it). Starting another context after it would add one per cycle."""
        if cls.kept is None:
            cls.kept = why
            log.debug("UCX runtime kept for the process: %s", why)

    @classmethod
    def acquire(cls) -> None:
        with cls._lock:
            cls._start()
            cls._holders += 1

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            cls._holders -= 1
            if cls._holders == 0 and cls.kept is None and threading.current_thread() is not cls._thread:
                cls._stop()

    @classmethod
    def _start(cls) -> asyncio.AbstractEventLoop:
        if cls._loop is None:
            require_ucxx()
            loop = asyncio.new_event_loop()
            cls._thread = threading.Thread(target=loop.run_forever, name="kvtier-ucx", daemon=True)
            cls._thread.start()
            cls._loop = loop
            # ucxx's context and worker now (0.1-0.4 s here), not in the first call's deadline.
            asyncio.run_coroutine_threadsafe(_create_context(), loop).result(STOP_SECONDS)
        return cls._loop

    @classmethod
    def _stop(cls) -> None:
        loop, thread = cls._loop, cls._thread
        if loop is None or thread is None:
            return
        cls._loop = cls._thread = None
        _settle(loop, _reset())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_SECONDS)
        if not thread.is_alive():
            loop.close()
        # ucxx's progress task and the loop reference each other (it patches loop.close with a
        # partial bound to the task): the worker, its progress thread and its descriptors would
        # wait for a garbage collection (0.1 s here, with torch loaded). Undone, they go now.
        vars(loop).pop("close", None)
        del loop


STOP_SECONDS = 5.0


def _settle(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` on `loop` for at most STOP_SECONDS; its failure is logged, not raised."""
    try:
        asyncio.run_coroutine_threadsafe(coro, loop).result(STOP_SECONDS)
    except Exception as e:
        log.debug("stopping the UCX runtime: %s", e)


async def _create_context() -> None:
    """Have ucxx make its context and worker, bound to this (the running) loop."""
    require_ucxx().get_ucp_worker()


async def _reset() -> None:
    """Have ucxx drop its context and worker (it raises if endpoints still reference them:
    then they live as long as those do, and the next start makes new ones)."""
    require_ucxx().reset()


async def _am_recv(conn: Any) -> Any:
    """The next active message on `conn.ep`. The receive's ucxx request is kept in
    `conn.pending` until the message lands, so close() knows whether one is left waiting
    (ucxx's Endpoint.am_recv, made with the request in hand: an awaiting coroutine's
    cancellation leaves it queued, and only its request tells when it was taken out)."""
    ep = conn.ep
    raw = getattr(ep, "_ep", ep)        # ucxx's low-level endpoint (None once aborted)
    if raw is None or (not raw.alive and not raw.am_probe()):
        # Closed and nothing arrived: ucxx raises as well, but fail here, sure that nothing
        # is queued (a message that did arrive before the close is still received).
        raise _endpoint_error(ep) or ConnectionResetError(
            errno.ECONNRESET, "Connection reset by peer (UCX: the endpoint closed)")
    req = conn.pending = raw.am_recv()
    await _io(req.wait(), ep)
    conn.pending = None
    return req.recv_buffer


def _waiting(req: Any) -> bool:
    """Whether active-message receive `req` (None: none posted) may still sit in ucxx's
    worker queue: it has not taken a message. One that failed (its endpoint closed or
    failed) has not either, and stays queued (_left_waiting)."""
    return req is not None and not (req.completed and req.status == 0)     # 0: UCS_OK


@dataclass
class _Kept:
    """An endpoint closed while a receive on it waited, kept open (see _quarantine)."""
    ep: Any
    req: Any                            # its receive, still queued when it was kept
    addr: tuple[str, int] | None        # the node it was connected to (None: a node's own)
    since: float                        # time.monotonic() when it was kept

    def live(self) -> bool:
        """Whether it still holds the connection's descriptors: its peer lives and has not
        sent the awaited message (a peer that died closed them; then ucxx never frees its
        handle, so nothing reuses it)."""
        raw = getattr(self.ep, "_ep", self.ep)
        return raw is not None and raw.alive and _waiting(self.req)


# Endpoints closed while a receive on them waited (see _quarantine), until their message
# lands or their peer dies. Touched on the UCX loop only.
_QUARANTINED: list[_Kept] = []
SWEEP_SECONDS = 0.05        # how soon a kept endpoint is freed after its message lands
MAX_KEPT_BY_NODE = 256      # a node's kept endpoints with a live peer (three descriptors each here)
_sweeper: asyncio.Task[None] | None = None


def _quarantine(ep: Any, req: Any, addr: tuple[str, int] | None) -> None:
    """Keep `ep` open while its receive `req` is queued (on the UCX loop). ucxx queues an
    active-message receive by the endpoint's UCP handle and a cancelled one stays queued;
    once the endpoint is freed UCX hands that handle to the next endpoint, whose first
    message the stale receive then takes and drops. Measured: after one request to a frozen
    node timed out, every later request of the process, to healthy nodes too, timed out;
    and a node that closed an idle connection took every later client's first request, so
    it answered none. The endpoint is freed once its message lands (_sweep: a peer that
    answers late, a client that sends its next request); one whose peer died stays failed
    (UCX closed its descriptors). A calling side does not connect to a node while an
    endpoint kept for it waits (_connect), so a peer cannot pile them up (each holds three
    descriptors while its peer lives, over TCP here)."""
    global _sweeper
    _QUARANTINED.append(_Kept(ep, req, addr, time.monotonic()))
    if addr is None:
        # A node's: a peer that connects and never sends could pile them up past the node's
        # connection limit. Past the bound the oldest is freed: its receive may then take one
        # later connection's first request (that call fails; the node keeps that connection
        # in turn, so it does not cascade).
        serving = [k for k in _QUARANTINED if k.addr is None]
        if len(serving) > MAX_KEPT_BY_NODE:
            _QUARANTINED.remove(serving[0])
            _abort(serving[0].ep)
            log.warning("more than %d UCX connections closed while their next request was awaited are still "
                        "open: freed the oldest (one later request may go unanswered)", MAX_KEPT_BY_NODE)
    n = len(_QUARANTINED)
    if n in (1, 10, 100, 1000) or n % 10_000 == 0:
        log.info("%d UCX endpoint(s) kept open after a receive on them was left waiting (ucxx cannot cancel "
                 "an active-message receive; freeing the endpoint would lose another's message)", n)
    if _sweeper is None or _sweeper.done():
        _sweeper = asyncio.get_running_loop().create_task(_sweep_while_kept())


async def _sweep_while_kept() -> None:
    """Sweep now and again while endpoints are kept."""
    while _QUARANTINED:
        await asyncio.sleep(SWEEP_SECONDS)
        _sweep()


def _sweep() -> None:
    """Free the kept endpoints whose message has landed (their receive is out of ucxx's
    queue: nothing stale is left to take another endpoint's message), and forget those whose
    peer died (ucxx never frees a failed endpoint's handle)."""
    for k in [k for k in _QUARANTINED if not k.live()]:
        _QUARANTINED.remove(k)
        if not _waiting(k.req):
            _abort(k.ep)


def _left_waiting() -> None:
    """An endpoint closes with an active-message receive it never got. ucxx keeps that
    receive in its worker's queue of receives waiting for a message, and the queued request
    holds the worker (ucxx 0.52, Worker::getAmRecv: only a message arriving for that endpoint
    takes it out), so that worker can never be freed: keep the runtime for the process then,
    rather than start another beside it on the next use."""
    _Runtime.keep("an endpoint closed with an active-message receive pending (a peer failed or timed out "
                  "mid-request, or a node stopped with peers connected): ucxx's worker cannot be freed")


class Lease:
    """A hold on the process's UCX runtime: it runs while any lease is held. `release()`
    once done (later calls do nothing)."""

    def __init__(self) -> None:
        _Runtime.acquire()
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            _Runtime.release()


def run(coro: Coroutine[Any, Any, T], deadline: float | None) -> T:
    """Run `coro` on the UCX loop and wait for it until `deadline` (time.monotonic());
    past it the coroutine is cancelled and TimeoutError (an OSError) raised. For callers
    outside this module: the runtime then stays up for the process (see _Runtime)."""
    return _run(coro, deadline, _Runtime.loop(pin=True))


def _run(coro: Coroutine[Any, Any, T], deadline: float | None,
         loop: asyncio.AbstractEventLoop | None = None) -> T:
    """run() for this module's own calls, made under a Lease: they do not pin the runtime."""
    fut = asyncio.run_coroutine_threadsafe(coro, loop or _Runtime.loop())
    try:
        return fut.result(None if deadline is None else max(1e-3, deadline - time.monotonic()))
    except FutureTimeout:
        fut.cancel()
        raise TimeoutError("the UCX peer did not answer in time") from None


# ucxx's errors for a peer that went away, as the OSError a socket raises for the same
# event, so a client's reason reads as over TCP ("connection refused") and the remote tier
# marks the peer unreachable: errno and message by ucxx's exception name.
_PEER_GONE = {
    "UCXXConnectionResetError": (errno.ECONNRESET, "Connection reset by peer"),
    "UCXXNotConnectedError": (errno.ECONNREFUSED, "Connection refused (UCX: endpoint not connected)"),
    "UCXXRejectedError": (errno.ECONNREFUSED, "Connection refused (UCX: rejected)"),
    "UCXXUnreachableError": (errno.EHOSTUNREACH, "No route to host (UCX: unreachable)"),
    "UCXXEndpointTimeoutError": (errno.ETIMEDOUT, "Connection timed out (UCX: endpoint timeout)"),
}


def _as_oserror(e: Exception) -> OSError:
    """A ucxx exception as an OSError (its errno where it says the peer went away)."""
    known = _PEER_GONE.get(type(e).__name__)
    if known is not None:
        return OSError(*known)      # ConnectionResetError, ConnectionRefusedError, ...
    return OSError(f"UCX: {type(e).__name__}: {e}")


def _refused(e: Exception) -> OSError:
    """A connection whose handshake failed (not timed out): the node did not take it."""
    return ConnectionRefusedError(errno.ECONNREFUSED, f"Connection refused (UCX: {e})")


def _endpoint_error(ep: Any) -> OSError | None:
    """Why `ep` (a ucxx Endpoint or its low-level UCXEndpoint) failed, if it did: ucxx
    reports a request cancelled by its endpoint's failure only as "Request canceled"."""
    raw = getattr(ep, "_ep", ep)
    if raw is None:
        return None
    try:
        raw.raise_on_error()
    except Exception as e:
        return _as_oserror(e)
    if not raw.alive:       # closed by its error callback before the error was recorded
        return ConnectionResetError(errno.ECONNRESET, "Connection reset by peer (UCX: the endpoint closed)")
    return None


async def _io(aw: Awaitable[T], ep: Any = None) -> T:
    """Await a ucxx operation on endpoint `ep`, its errors (own exception types) turned into
    OSError: the endpoint's own error where it has one (the peer went away)."""
    try:
        return await aw
    except (FrameError, OSError, EOFError, asyncio.CancelledError):
        raise
    except Exception as e:      # UCXXError and its subclasses, RuntimeError from ucxx's handshake
        raise (_endpoint_error(ep) if ep is not None else None) or _as_oserror(e) from None


def _split_head(msg: Any, check: Callable[[bytes], int]) -> tuple[bytes, bytes, bytes]:
    """(prefix, header, MAC) from one active message holding prefix | header | MAC.
    ucxx has allocated the message (its size the sender's choice) before it is handed over,
    and its API takes no bound on that: the size is checked here before anything is copied."""
    size = memoryview(msg).nbytes
    if size < PREFIX_BYTES or size > PREFIX_BYTES + MAX_HEADER + MAC_BYTES:
        raise FrameError(f"frame head of {size} bytes is out of bounds")
    data = bytes(msg)
    n = check(data[:PREFIX_BYTES])
    if len(data) != PREFIX_BYTES + n + MAC_BYTES:
        raise FrameError(f"frame head of {len(data)} bytes does not match its prefix's length {n}")
    return data[:PREFIX_BYTES], data[PREFIX_BYTES:PREFIX_BYTES + n], data[PREFIX_BYTES + n:]


# -- node side --------------------------------------------------------------------------
class UcxServerConn:
    """A node's side of one UCX endpoint (runs on the UCX loop)."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.pending: Any = None    # the active-message receive posted (see _am_recv)

    async def recv_head(self, deadline: float | None, check: Callable[[bytes], int]) -> tuple[bytes, bytes, bytes]:
        # A head is one message: its deadline (if any) bounds all of it.
        loop = asyncio.get_running_loop()
        try:
            msg = await _am_recv(self) if deadline is None else \
                await asyncio.wait_for(_am_recv(self), max(0.0, deadline - loop.time()))
        except OSError:
            if deadline is None:
                raise EOFError from None     # the peer closed between requests
            raise
        return _split_head(msg, check)

    async def send(self, head: bytes) -> None:
        await _io(self.ep.am_send(head), self.ep)

    async def send_rows(self, rows: Sequence[np.ndarray]) -> None:
        # Speed: every row is posted at once (straight from slot memory) so UCX pipelines them.
        await asyncio.gather(*(_io(self.ep.send(r), self.ep) for r in rows))

    async def recv_rows(self, buf: np.ndarray) -> None:
        # Bounded by the node's deadline per request (frames.request_seconds: it grows with the
        # bytes), as over TCP; a fixed request timeout here cut off PUTs of over ~1 GB.
        await asyncio.gather(*(_io(self.ep.recv(buf[i]), self.ep) for i in range(len(buf))))

    def discard_unread(self) -> None:
        pass        # messages, not a byte stream: nothing unread makes close() a reset

    def close(self) -> None:
        # Closed with its receive for the next request queued (the idle timeout, a first
        # request's deadline, the connection gate): kept until that request comes or its peer
        # goes, never freed under it (_quarantine).
        if _waiting(self.pending):
            _left_waiting()
            raw = getattr(self.ep, "_ep", self.ep)
            if raw is not None and raw.alive:
                _quarantine(self.ep, self.pending, None)
                return
        _abort(self.ep)


def every_interface_warning(host: str, port: int) -> str | None:
    """What to tell a user who asked a UCX node to listen on `host` only: ucxx's listener takes
    a port, not an address, so it listens on every interface (None where `host` asked for that)."""
    if is_unspecified(host):
        return None
    return (f"UCX listens on every interface at port {port}, not only on {host}: ucxx cannot bind one "
            "address, so restrict the port with a firewall where other hosts must not reach it")


class UcxServer:
    """A UCX listener that hands each connecting peer to `node.serve` (on the UCX loop).
    UCX listens on every interface at `port` (logged as a warning); `host` is only the
    advertised address. Holds the UCX runtime until closed."""

    def __init__(self, node: Any, host: str, port: int) -> None:
        self.node = node
        self.conns: set[UcxServerConn] = set()     # being served; touched on the UCX loop only
        self._lease = Lease()
        try:
            self.listener = _run(self._listen(port), time.monotonic() + 30)
        except BaseException:
            self._lease.release()
            raise
        self.address = format_address(host, self.listener.port)
        warning = every_interface_warning(host, self.listener.port)
        if warning:
            log.warning("%s", warning)

    async def _listen(self, port: int) -> Any:
        ucxx = require_ucxx()

        async def handler(ep: Any) -> None:
            conn = UcxServerConn(ep)
            self.conns.add(conn)
            try:
                await self.node.serve(conn)
            finally:
                self.conns.discard(conn)

        return ucxx.create_listener(handler, port=port)

    def close(self) -> None:
        async def stop() -> None:
            self.listener.close()
            if self.conns:      # still served on the UCX loop (each waits for its peer's next frame)
                _left_waiting()
        try:
            _run(stop(), time.monotonic() + 5)
        finally:
            self._lease.release()


# -- calling side -----------------------------------------------------------------------
class UcxChannel:
    """The calling side over one UCX endpoint, connected on first use (holding the UCX
    runtime from then until closed). Its endpoint is touched on the UCX loop only: close()
    runs there too, so it sees whether a request's receive is posted, and a connect that
    finishes after close() frees its endpoint. Closed is final."""

    def __init__(self, addr: tuple[str, int]) -> None:
        self.addr = addr
        self.ep: Any = None
        self.pending: Any = None    # the active-message receive posted (see _am_recv)
        self.closed = False
        self._lease: Lease | None = None
        self._state = threading.Lock()     # closed and _lease, set by callers' threads

    def request(self, head: bytes, rows: Sequence[np.ndarray] | None, deadline: float,
                check: Callable[[bytes], int]) -> tuple[bytes, bytes, bytes]:
        with self._state:
            if self.closed:
                raise _closed_error()
            if self._lease is None:
                self._lease = Lease()
        return _run(self._request(head, rows, deadline, check), deadline)

    async def _request(self, head: bytes, rows: Sequence[np.ndarray] | None, deadline: float,
                       check: Callable[[bytes], int]) -> tuple[bytes, bytes, bytes]:
        if self.ep is None:
            ep = await _io(_connect(self.addr, max(1e-3, deadline - time.monotonic())))
            if self.closed:         # closed while it connected: nobody else would free it
                _abort(ep)
                raise _closed_error()
            self.ep = ep
        ep = self.ep
        await _io(ep.am_send(head), ep)
        if rows is not None:
            await asyncio.gather(*(_io(ep.send(r), ep) for r in rows))
        return _split_head(await _am_recv(self), check)

    def recv_rows(self, rows: Sequence[np.ndarray], deadline: float, on_row: Callable[[int], None]) -> None:
        _run(self._recv_rows(rows, on_row), deadline)

    async def _recv_rows(self, rows: Sequence[np.ndarray], on_row: Callable[[int], None]) -> None:
        # Speed: every receive is posted at once, straight into the destination rows;
        # each row is handed to verification as it lands.
        ep = self.ep
        if ep is None:
            raise _closed_error()

        async def one(i: int) -> None:
            await _io(ep.recv(rows[i]), ep)
            on_row(i)
        await asyncio.gather(*(one(i) for i in range(len(rows))))

    def close(self) -> None:
        with self._state:
            if self.closed:
                return
            self.closed = True
            lease, self._lease = self._lease, None
        if lease is None:           # never used: no endpoint, no runtime held
            return
        try:
            _run(self._stop(), time.monotonic() + STOP_SECONDS)
        except TimeoutError:
            # The loop is stuck: _stop runs when it moves on, maybe keeping the endpoint, and
            # the runtime must still be there then.
            _Runtime.keep("closing a UCX channel timed out (the UCX loop did not answer)")
        lease.release()

    async def _stop(self) -> None:
        ep, self.ep = self.ep, None
        if ep is None:
            return
        if _waiting(self.pending):      # its reply never came: never free this endpoint (_left_waiting)
            _left_waiting()
            _quarantine(ep, self.pending, self.addr)
        else:
            _abort(ep)


def _closed_error() -> OSError:
    return ConnectionAbortedError(errno.ECONNABORTED, "Connection aborted (UCX: the channel was closed)")


async def _connect(addr: tuple[str, int], seconds: float) -> Any:
    """An endpoint to the node at `addr` (ucxx's Endpoint), made as ucxx.create_endpoint makes
    it, but failing as soon as UCX reports the connection failed. ucxx's own waited out its
    whole `connect_timeout` whenever the refusal came as it posted its handshake receive (2 to
    6 of 8 connects to a dead port, here): every call to a dead node cost its deadline.
    ucxx's connect itself where its internals are not the ones this was written against.
    Refused while an endpoint kept for a request to that node still waits (_quarantine)."""
    for k in _QUARANTINED:
        if k.addr == addr and k.live():
            raise ConnectionRefusedError(
                errno.ECONNREFUSED, f"Connection refused (UCX: not connecting again: the node has not answered "
                f"a request made {time.monotonic() - k.since:.0f} s ago, whose connection is kept until it does)")
    parts = _ucxx_internals()
    if parts is None:
        return await require_ucxx().create_endpoint(addr[0], addr[1], connect_timeout=seconds)
    api, endpoint_class, exchange_peer_info, hash64bits, get_ctx = parts
    ctx = get_ctx()
    ctx.continuous_ucx_progress()
    raw = api.UCXEndpoint.create(ctx.worker, addr[0], addr[1], True)
    tag = hash64bits("msg_tag", os.urandom(16), raw.handle)
    handshake: asyncio.Future[Any] | None = None
    try:
        gone = _closed(raw)
        handshake = asyncio.ensure_future(exchange_peer_info(endpoint=raw, msg_tag=tag, listener=False,
                                                             connect_timeout=seconds))
        await asyncio.wait([handshake, gone], return_when=asyncio.FIRST_COMPLETED)
        if not handshake.done():
            raise ConnectionError("the endpoint closed")
        info = handshake.result()
    except BaseException as e:
        if handshake is not None:
            handshake.cancel()
            handshake.add_done_callback(_retrieve)
        error = _endpoint_error(raw)
        _abort_raw(raw)
        if isinstance(e, asyncio.TimeoutError):
            raise TimeoutError("the UCX peer did not complete its handshake in time") from None
        if not isinstance(e, Exception):     # cancelled (the caller's deadline)
            raise
        raise error or _refused(e) from None     # the endpoint closed under the handshake
    raw.remove_close_callback()
    return endpoint_class(endpoint=raw, ctx=ctx, tags={"msg_send": info["msg_tag"], "msg_recv": tag})


def _ucxx_internals() -> tuple[Any, ...] | None:
    """The ucxx pieces its create_endpoint is made of (ucxx 0.52), or None where they moved."""
    try:
        from ucxx._lib import libucxx as api
        from ucxx._lib_async.endpoint import Endpoint
        from ucxx._lib_async.exchange_peer_info import exchange_peer_info
        from ucxx._lib_async.utils import hash64bits
        from ucxx.core import _get_ctx
    except ImportError:
        return None
    return api, Endpoint, exchange_peer_info, hash64bits, _get_ctx


def _closed(raw: Any) -> asyncio.Future[None]:
    """A future done when UCX closes endpoint `raw` (its error callback: the peer refused,
    reset or is unreachable). ucxx calls the callback on its progress thread."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not fut.done():
            fut.set_result(None)

    def closed() -> None:
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:        # the loop is closed: nobody waits any more
            pass

    raw.set_close_callback(closed, None, None)
    if not raw.alive:       # it failed before the callback was set
        settle()
    return fut


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Read a dropped handshake's outcome, so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def _abort_raw(raw: Any) -> None:
    """Close a low-level endpoint (one not yet wrapped in ucxx's Endpoint) at once."""
    try:
        raw.close_blocking(period=200_000_000, max_attempts=1)
        raw.remove_close_callback()
    except Exception:   # already closed: nothing left to cancel
        pass


def _abort(ep: Any) -> None:
    """Close an endpoint at once: pending sends and receives are cancelled."""
    try:
        ep.abort(period=200_000_000)   # ns: never hold the UCX loop long on a dying peer
    except Exception:   # already closed or its peer gone: nothing left to cancel
        pass
