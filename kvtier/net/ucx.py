"""UCX transport through ucxx (optional: `pip install kvtier[ucx]`): RDMA and GPUDirect RDMA
where the hardware has them, TCP or shared memory otherwise (UCX picks; UCX_TLS narrows it).

The same frames as over TCP: a frame head (prefix | header | MAC) travels as one UCX
active message (so the receiver learns its size without a length round trip), and each
block row as one tagged message, sent straight from slot memory and received straight
into the destination row. Tagged messages on one endpoint arrive in order, so rows match
the header's order; a failed or timed-out call aborts the endpoint (its pending receives
are cancelled before the caller gets its miss) and the next call connects afresh.

ucxx keeps one worker per process whose progress is tied to one asyncio loop, so all UCX
work of a process (a node's listener and every client channel) runs on one loop thread
here; blocking callers wait on it with a deadline, never longer.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
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
    try:
        import ucxx
    except ImportError as e:
        raise ConfigError(f"transport 'ucx' needs ucxx: pip install 'kvtier[ucx]' ({e})") from None
    return ucxx


class _Loop:
    """The process's UCX event loop, on a daemon thread of its own (started on first use)."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None:
                require_ucxx()
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="kvtier-ucx", daemon=True).start()
                cls._loop = loop
            return cls._loop


def run(coro: Coroutine[Any, Any, T], deadline: float | None) -> T:
    """Run `coro` on the UCX loop and wait for it until `deadline` (time.monotonic());
    past it the coroutine is cancelled and TimeoutError (an OSError) raised."""
    fut = asyncio.run_coroutine_threadsafe(coro, _Loop.get())
    try:
        return fut.result(None if deadline is None else max(1e-3, deadline - time.monotonic()))
    except FutureTimeout:
        fut.cancel()
        raise TimeoutError("the UCX peer did not answer in time") from None


async def _io(aw: Awaitable[T]) -> T:
    """Await a ucxx operation, its errors (own exception types) turned into OSError."""
    try:
        return await aw
    except (FrameError, OSError, EOFError, asyncio.CancelledError):
        raise
    except Exception as e:      # UCXXError and its subclasses, RuntimeError from ucxx's handshake
        raise OSError(f"UCX: {type(e).__name__}: {e}") from None


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

    async def recv_head(self, deadline: float | None, check: Callable[[bytes], int]) -> tuple[bytes, bytes, bytes]:
        # A head is one message: its deadline (if any) bounds all of it.
        loop = asyncio.get_running_loop()
        try:
            msg = await _io(self.ep.am_recv()) if deadline is None else \
                await asyncio.wait_for(_io(self.ep.am_recv()), max(0.0, deadline - loop.time()))
        except OSError:
            if deadline is None:
                raise EOFError from None     # the peer closed between requests
            raise
        return _split_head(msg, check)

    async def send(self, head: bytes) -> None:
        await _io(self.ep.am_send(head))

    async def send_rows(self, rows: Sequence[np.ndarray]) -> None:
        # Speed: every row is posted at once (straight from slot memory) so UCX pipelines them.
        await asyncio.gather(*(_io(self.ep.send(r)) for r in rows))

    async def recv_rows(self, buf: np.ndarray) -> None:
        # Bounded by the node's deadline per request (frames.request_seconds: it grows with the
        # bytes), as over TCP; a fixed request timeout here cut off PUTs of over ~1 GB.
        await asyncio.gather(*(_io(self.ep.recv(buf[i])) for i in range(len(buf))))

    def discard_unread(self) -> None:
        pass        # messages, not a byte stream: nothing unread makes close() a reset

    def close(self) -> None:
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
    advertised address."""

    def __init__(self, node: Any, host: str, port: int) -> None:
        self.node = node
        self.listener = run(self._listen(port), time.monotonic() + 30)
        self.address = format_address(host, self.listener.port)
        warning = every_interface_warning(host, self.listener.port)
        if warning:
            log.warning("%s", warning)

    async def _listen(self, port: int) -> Any:
        ucxx = require_ucxx()

        async def handler(ep: Any) -> None:
            await self.node.serve(UcxServerConn(ep))

        return ucxx.create_listener(handler, port=port)

    def close(self) -> None:
        async def stop() -> None:
            self.listener.close()
        run(stop(), time.monotonic() + 5)


# -- calling side -----------------------------------------------------------------------
class UcxChannel:
    """The calling side over one UCX endpoint, connected on first use."""

    def __init__(self, addr: tuple[str, int]) -> None:
        self.addr = addr
        self.ep: Any = None

    def request(self, head: bytes, rows: Sequence[np.ndarray] | None, deadline: float,
                check: Callable[[bytes], int]) -> tuple[bytes, bytes, bytes]:
        return run(self._request(head, rows, deadline, check), deadline)

    async def _request(self, head: bytes, rows: Sequence[np.ndarray] | None, deadline: float,
                       check: Callable[[bytes], int]) -> tuple[bytes, bytes, bytes]:
        if self.ep is None:
            ucxx = require_ucxx()
            self.ep = await _io(ucxx.create_endpoint(
                self.addr[0], self.addr[1], connect_timeout=max(1e-3, deadline - time.monotonic())))
        ep = self.ep
        await _io(ep.am_send(head))
        if rows is not None:
            await asyncio.gather(*(_io(ep.send(r)) for r in rows))
        return _split_head(await _io(ep.am_recv()), check)

    def recv_rows(self, rows: Sequence[np.ndarray], deadline: float, on_row: Callable[[int], None]) -> None:
        run(self._recv_rows(rows, on_row), deadline)

    async def _recv_rows(self, rows: Sequence[np.ndarray], on_row: Callable[[int], None]) -> None:
        # Speed: every receive is posted at once, straight into the destination rows;
        # each row is handed to verification as it lands.
        async def one(i: int) -> None:
            await _io(self.ep.recv(rows[i]))
            on_row(i)
        await asyncio.gather(*(one(i) for i in range(len(rows))))

    def close(self) -> None:
        if self.ep is not None:
            ep, self.ep = self.ep, None

            async def stop() -> None:
                _abort(ep)
            try:
                run(stop(), time.monotonic() + 5)
            except TimeoutError:
                pass


def _abort(ep: Any) -> None:
    """Close an endpoint at once: pending sends and receives are cancelled."""
    try:
        ep.abort(period=200_000_000)   # ns: never hold the UCX loop long on a dying peer
    except Exception:   # already closed or its peer gone: nothing left to cancel
        pass
