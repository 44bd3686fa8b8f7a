"""The calling side of the node protocol: one blocking connection per peer, with deadlines.

Every call has a deadline: `timeout` seconds plus the time its bytes take at a floor rate
(frames.MIN_RATE; frames.request_seconds, which the node's bound on its answer shares), so a
peer that dies, stalls, drips bytes or sends garbage costs a PeerError within a bounded time,
which the remote tier turns into a miss. Received blocks land straight in the caller's
buffers and are verified against the MAC'd checksums; a peer that fails part way through a
GET still yields the blocks that arrived verified before. The bytes move over a transport
(transport.py): TCP by default, UCX with transport="ucx".
"""
from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvtier.checksum import block_checksum, block_checksums
from kvtier.errors import ConfigError, KvtierError
from kvtier.net.address import parse_address
from kvtier.net.frames import Frame, FrameError, check_secret, decode, read_prefix, request_seconds
from kvtier.net.tls import Tls, check_tls
from kvtier.net.transport import Channel, TcpChannel, check_transport

if TYPE_CHECKING:
    from kvtier.net.ucx import Lease
    from kvtier.store import Store

_VERIFY = ThreadPoolExecutor(1, thread_name_prefix="kvtier-verify")
INLINE_VERIFY_BYTES = 256 << 10     # blocks smaller than this are verified on the receiving thread
# Speed: a helper thread verifies large blocks while the next arrives only where the process
# has cores to spare. With two, it competes with both ends' socket work: `kvtier bench
# transport` (TCP, 15 rounds, four paired runs each, 2 cores) measured 0.95-0.96 of the raw
# socket at 1 MiB and 0.92-1.00 at 4 MiB verifying inline, 0.85-0.98 and 0.89-0.95 on the thread.
VERIFY_THREAD = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) > 2


class PeerError(KvtierError):
    """A peer could not answer in time or answered wrongly: treat its blocks as misses.
    `refused`: it answered, but refused the request or its reply was not acceptable (another
    secret or namespace, a malformed frame), rather than not answering at all. `loaded`: for a
    GET, how many leading blocks had arrived verified before it failed (they are usable).
    `busy`: never sent, because this client's earlier request to the peer (one at a time)
    was still running at the deadline, or the client was closed: the peer is not at fault."""

    def __init__(self, address: str, reason: str, refused: bool = False, loaded: int = 0,
                 busy: bool = False) -> None:
        super().__init__(f"peer {address}: {reason}")
        self.address, self.reason, self.refused, self.loaded = address, reason, refused, loaded
        self.busy = busy


class PeerClient:
    """Talks to one node: `has`, `get` and `put` of blocks, authenticated with the cluster's
    secret, every block checksummed. Thread-safe (one request at a time per peer).

    `ns` is the namespace seed of the store whose blocks these are (`store.keyer.seed`, or
    use `PeerClient.for_store`); `tls=Tls(ca=FILE)` reaches a node that serves TLS."""

    def __init__(self, address: str, secret: bytes, ns: bytes, block_bytes: int, timeout: float = 0.5,
                 transport: str = "tcp", tls: Tls | None = None, wait_busy: bool = True) -> None:
        secret = check_secret(secret)
        if not isinstance(ns, (bytes, bytearray)) or len(ns) != 16:
            raise ConfigError("ns must be the store's 16-byte namespace seed (store.keyer.seed)")
        if not isinstance(block_bytes, int) or block_bytes < 1:
            raise ConfigError(f"block_bytes must be a positive int, got {block_bytes!r}")
        self.address = address
        self._addr = parse_address(address, any_port=False)
        self.transport = check_transport(transport)
        self.tls = check_tls(tls)
        if self.tls is not None and self.transport != "tcp":
            raise ConfigError("TLS is for the tcp transport; UCX brings its own transports (leave tls unset)")
        self._ssl = self.tls.client_context() if self.tls is not None else None
        self.secret, self.ns, self.block_bytes, self.timeout = bytes(secret), bytes(ns), block_bytes, timeout
        self._chan: Channel | None = None
        # UCX: a hold on the process's UCX runtime until close() (ucx.Lease), taken now so its
        # start is not in a call's deadline, and so a connection dropped after a failure does
        # not stop and restart it.
        self._ucx: Lease | None = None
        if self.transport == "ucx":
            from kvtier.net.ucx import Lease
            self._ucx = Lease()
        self._lock = threading.Lock()
        self._closed = False
        # A request waits its turn behind this client's earlier one (pushes and fetches queue);
        # with wait_busy=False (lookups) it waits only until its own deadline, then is a
        # PeerError with busy=True (a miss that is not the peer's fault).
        self.wait_busy = wait_busy

    @classmethod
    def for_store(cls, store: Store, address: str, secret: bytes, **kw: object) -> PeerClient:
        """A client for the node at `address` that serves `store`'s namespace and layout."""
        return cls(address, secret, store.keyer.seed, store.layout.block_bytes, **kw)   # type: ignore[arg-type]

    def close(self) -> None:
        """Close the connection; over UCX, let go of the UCX runtime too: the last holder's
        close gives its threads and descriptors back. Final: a later call is a PeerError
        (`busy`: not the peer's fault), never a connection nobody would close (a client
        closed by one thread, e.g. evicted from a remote tier, while another still holds it)."""
        with self._lock:
            self._closed = True
            self._drop()
            if self._ucx is not None:
                self._ucx.release()
                self._ucx = None

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
                self._chan = TcpChannel(self._addr, self._ssl)
        return self._chan

    # -- requests --------------------------------------------------------------------
    def has(self, keys: Sequence[bytes]) -> int:
        """How long a prefix of `keys` the peer holds."""
        return self._call(Frame("HAS", self.ns, list(keys)), None)

    def find(self, keys: Sequence[bytes], tiers: list[int] | None = None) -> int:
        """How long a prefix of `keys` the peer's store can load: what it holds, then what its
        remote tier finds on its own peers (allow the peer's remote timeout in `timeout`).
        `tiers`, if given, receives each found block's tier at the peer (0 = its fastest; its
        number of local tiers = its remote), where the peer tells them (older nodes do not)."""
        return self._call(Frame("FIND", self.ns, list(keys)), None, tiers_out=tiers)

    def get(self, keys: Sequence[bytes], rows: Sequence[np.ndarray]) -> int:
        """Fetch the peer's prefix of `keys` into `rows` (one writable uint8 row per key, or a
        [n, block_bytes] uint8 array); returns how many leading rows arrived and passed
        verification. A peer that fails after some blocks arrived verified still gives those
        (the connection is dropped; the next call connects afresh); PeerError if none did."""
        try:
            return self.fetch(keys, rows)
        except PeerError as e:
            if e.loaded:
                return e.loaded
            raise

    def fetch(self, keys: Sequence[bytes], rows: Sequence[np.ndarray]) -> int:
        """get(), but a failure is always a PeerError, whose `loaded` counts the leading rows
        that arrived verified before it."""
        return self._call(Frame("GET", self.ns, list(keys)), _rows(rows, len(keys), self.block_bytes, True))

    def put(self, keys: Sequence[bytes], blocks: object, sums: Sequence[int] | None = None) -> int:
        """Store blocks on the peer (`blocks`: [n, block_bytes] uint8 numpy or CPU torch, or a
        list of rows); returns how many it newly wrote. Each block travels with its checksum
        (`sums`, the blocks' xxh3-64 as `Store.hold` gives them, else computed here); the peer
        stores the leading blocks that match theirs."""
        rows = _rows(blocks, len(keys), self.block_bytes, False)[:len(keys)]
        if sums is None or len(sums) < len(keys):
            sums = block_checksums(rows)
        sums = list(sums[:len(keys)])
        req = Frame("PUT", self.ns, list(keys), payload=len(keys) * self.block_bytes, sums=sums)
        return self._call(req, rows, send_rows=True)

    def _call(self, req: Frame, rows, send_rows: bool = False, tiers_out: list[int] | None = None) -> int:
        deadline = time.monotonic() + request_seconds(self.timeout, req.op, len(req.keys), self.block_bytes)
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic()) if not self.wait_busy else -1):
            raise PeerError(self.address, "busy: this client's earlier request to the peer was still running "
                            "at the deadline", busy=True)
        try:
            if self._closed:
                raise PeerError(self.address, "this client was closed", busy=True)
            landed: list[Future[bool] | None] = []
            try:
                reused = self._chan is not None
                try:
                    chan, (prefix, body, mac) = self._send(req, rows if send_rows else None, deadline)
                except (OSError, EOFError) as e:
                    if not reused or isinstance(e, TimeoutError):
                        raise
                    # The kept connection was closed under us (the node's idle timeout, a node
                    # restart): once more on a fresh one, with a fresh nonce. Every request is
                    # idempotent (HAS, FIND and GET read; PUT of the same bytes under the same key).
                    self._drop()
                    chan, (prefix, body, mac) = self._send(req, rows if send_rows else None, deadline)
                reply = self._reply(prefix, body, mac, req.nonce)
                # A prefix of the keys asked, never more (nor negative): callers build a list
                # of n holders from it, so a huge n was a MemoryError on the engine's thread,
                # and one past the keys reported more blocks than the prompt has.
                if not 0 <= reply.n <= len(req.keys):
                    raise FrameError(f"{req.op} reply of {reply.n} blocks for {len(req.keys)} keys asked")
                if req.op != "GET":
                    if tiers_out is not None and len(reply.sums) == reply.n:
                        tiers_out.extend(reply.sums)
                    return reply.n
                return self._receive_blocks(chan, reply, rows, deadline, landed)
            except (OSError, EOFError, FrameError) as e:
                self._drop()    # the connection's state is unknown now: start afresh next time
                raise PeerError(self.address, _reason(e), refused=isinstance(e, FrameError),
                                loaded=_verified(landed)) from None
        finally:
            self._lock.release()

    def _send(self, req: Frame, rows, deadline: float) -> tuple[Channel, tuple[bytes, bytes, bytes]]:
        """Send `req` (freshly encoded: a new nonce) and read its reply's head."""
        chan = self._channel()
        return chan, chan.request(req.encode(self.secret), rows, deadline, self._check)

    def _check(self, prefix: bytes) -> int:
        return read_prefix(prefix, self.secret).length

    def ping(self) -> None:
        """One HAS of no keys: raises PeerError unless the peer answers, with this cluster's
        secret and for this namespace."""
        self.has([])

    def _reply(self, prefix: bytes, body: bytes, mac: bytes, nonce: bytes) -> Frame:
        reply = decode(prefix, body, mac, self.secret)
        if reply.op == "ERR":
            raise FrameError(f"refused: {reply.error}")
        if reply.op != "OK" or reply.ns != self.ns:
            raise FrameError(f"unexpected reply {reply.op} for another namespace" if reply.ns != self.ns
                             else f"unexpected reply {reply.op}")
        if reply.re != nonce:
            raise FrameError("a reply to another request (replayed?)")
        return reply

    def _receive_blocks(self, chan: Channel, reply: Frame, rows, deadline: float,
                        landed: list[Future[bool] | None]) -> int:
        n, bb = reply.n, self.block_bytes
        if not 0 <= n <= len(rows) or reply.payload != n * bb or len(reply.sums) != n:
            raise FrameError(f"GET reply of {n} blocks with {reply.payload} bytes does not add up")
        # Speed: a large block is verified on a helper thread while the next one arrives
        # (receiving and hashing both release the GIL), straight in the caller's buffers, on
        # machines with cores to spare (VERIFY_THREAD); a small one right here: hashing 64 KiB
        # takes microseconds, less than a hand-off to the thread. `landed` is the caller's, so
        # a failure part way still counts the verified prefix.
        landed.extend([None] * n)
        sums = reply.sums

        def on_row(i: int) -> None:
            if VERIFY_THREAD and bb >= INLINE_VERIFY_BYTES:
                landed[i] = _VERIFY.submit(_matches, rows[i], sums[i])
            else:
                done: Future[bool] = Future()
                done.set_result(_matches(rows[i], sums[i]))
                landed[i] = done

        chan.recv_rows(rows[:n], deadline, on_row)
        return _verified(landed)


def _matches(row: np.ndarray, want: int) -> bool:
    return block_checksum(row) == want


def _verified(landed: list[Future[bool] | None]) -> int:
    """How many leading rows landed and matched their checksums."""
    good = 0
    for f in landed:
        if f is None or not f.result():
            break
        good += 1
    return good


def _rows(blocks: object, n: int, bb: int, writable: bool) -> Sequence[np.ndarray]:
    """`blocks` as n uint8 rows of bb bytes: a [n, bb] numpy array or CPU tensor, or a list of rows."""
    if isinstance(blocks, (list, tuple)):
        if len(blocks) < n:
            raise ConfigError(f"{len(blocks)} rows for {n} keys: give one row per key")
        return blocks
    try:
        import torch
        if isinstance(blocks, torch.Tensor):
            if blocks.device.type != "cpu":
                raise ConfigError("blocks for a peer must be in host memory: give a CPU tensor")
            blocks = blocks.numpy()
    except ImportError:
        pass
    if not isinstance(blocks, np.ndarray) or blocks.dtype != np.uint8 or blocks.ndim != 2 \
            or blocks.shape[0] < n or blocks.shape[1] != bb or not blocks.flags.c_contiguous:
        shape = getattr(blocks, "shape", None)
        raise ConfigError(f"blocks must be C-contiguous uint8 [{n}, {bb}] (numpy or CPU torch), "
                          f"or a list of such rows; got {type(blocks).__name__} {tuple(shape) if shape else ''}")
    if writable and not blocks.flags.writeable:
        raise ConfigError("the output array is read-only: give a writable one")
    return blocks


def _reason(e: BaseException) -> str:
    """A short reason for a failed call: "connection refused", "timed out", the frame error."""
    if isinstance(e, FrameError):
        return str(e)
    if isinstance(e, ssl.SSLCertVerificationError):
        return (f"TLS: the node's certificate does not verify ({e.verify_message}): give the CA that signed it "
                "(Tls(ca=...), --tls-ca), and a certificate that names the address dialled")
    if isinstance(e, ssl.SSLError):
        why = getattr(e, "reason", None) or e     # an SSLError made by kvtier has no reason
        return (f"TLS failed ({why}): is the node serving TLS (--tls-cert), and this client "
                "given tls=Tls(ca=...) (--tls-ca)?")
    if isinstance(e, socket.timeout):
        return "no answer within the deadline"
    if isinstance(e, EOFError):
        return str(e) or "the peer closed the connection"
    if isinstance(e, socket.gaierror):
        return f"cannot resolve the host name ({e.strerror})"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror[:1].lower() + e.strerror[1:]
    return f"{type(e).__name__}: {e}"
