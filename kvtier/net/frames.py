"""The wire format between nodes (version 2): an authenticated prefix, an authenticated
msgpack header, raw block payloads.

    prefix (36 B):  u32 header length | u64 time (ns) | u64 random | 16-byte tag
    header:         msgpack map | 32-byte HMAC-SHA256(secret, prefix | header)
    payload:        the blocks' bytes (their xxh3-64 checksums are in the header)

The tag is an HMAC of the prefix's first 20 bytes under a key derived from the secret, so
a node checks it before it allocates anything for the header: a peer without the secret
costs 36 bytes, never a claimed 4 MiB. Time and random together are the frame's nonce: a
frame more than `max_age` seconds old (or ahead) is stale, and a node remembers the nonces
of the window (replay.py) to refuse a frame sent twice. The header names the operation,
the namespace seed, the keys, the payload size and a checksum per block; a reply also
names the nonce of the request it answers (`re`), so a reply cannot be replayed to answer
another request. Sizes are bounded before anything is allocated.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import os
import re
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvtier.errors import ConfigError, KvtierError

VERSION = 2
REQUESTS = ("HAS", "FIND", "GET", "PUT")
REPLIES = ("OK", "ERR")
OPS = REQUESTS + REPLIES
PREFIX_BYTES = 36
TAG_BYTES = 16
NONCE_BYTES = 16
MAC_BYTES = 32
# What a node answers a peer that does not hold the secret: a prefix no tag check passes, so
# it says "not this cluster" (read_prefix's error) and, being constant, cannot be sent back
# as a frame (a MAC'd ERR could).
REFUSAL = bytes(PREFIX_BYTES)
# How other protocols' first bytes look, to name them when they reach a node (or a client
# dials something that is not one): an operator's curl otherwise read "secret" in the log.
_HTTP_METHODS = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"CONNECT ",
                 b"TRACE ", b"PRI * HTTP/2")
# What a node answers an HTTP client instead of REFUSAL: a plain 400 its user can read.
_HTTP_BODY = b"this is a kvtier node port: it speaks kvtier's frame protocol between nodes, not HTTP\n"
HTTP_REFUSAL = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(_HTTP_BODY), _HTTP_BODY))
# What a node answers a Redis client (a --directory URL pointed at a node's port): a RESP
# error, so redis-py raises it as the server's message instead of waiting out its timeout.
RESP_NODE_PORT = "this is a kvtier node port, not Redis"
RESP_REFUSAL = b"-ERR " + RESP_NODE_PORT.encode() + b": point --directory at the Redis server\r\n"
_RESP_COMMAND = re.compile(rb"\*[0-9]{1,9}\r\n\$")       # a RESP array of bulk strings: a Redis command
MAX_HEADER = 4 << 20            # a 128k-token prompt at 16 tokens a block: ~200 KiB of keys
MAX_KEYS = 1 << 16
MAX_AGE_S = 30.0                # a frame older (or further ahead) than this is stale
_HEAD = struct.Struct("!IQ8s")  # header length, time in ns, 8 random bytes
MIN_SECRET_BYTES = 16
MIN_RATE = 100e6                # bytes/s a transfer must sustain; slower counts as a stall


def request_seconds(timeout: float, op: str, keys: int, block_bytes: int) -> float:
    """How long one request may take, the same bound on both ends: `timeout` plus the bytes
    of its blocks (a GET's or PUT's) at MIN_RATE. The client's deadline and the node's
    bound on answering are both this, so a transfer the client waits for is never cut off
    by the node at a fixed timeout (a GB-sized GET or PUT outlasted the node's 10 s)."""
    moved = keys * block_bytes if op in ("GET", "PUT") else 0
    return timeout + moved / MIN_RATE


class FrameError(KvtierError):
    """A frame that is malformed, too large, unauthenticated, stale or replayed."""


class ForeignProtocol(FrameError):
    """Bytes of another protocol (HTTP, TLS, SSH, Redis) where a frame was due; `reply` is
    what a node answers such a client in its own protocol (HTTP_REFUSAL, RESP_REFUSAL), or
    None for the plain REFUSAL."""

    def __init__(self, message: str, reply: bytes | None = None) -> None:
        super().__init__(message)
        self.reply = reply


def foreign_protocol(prefix: bytes) -> ForeignProtocol | None:
    """The protocol a failed prefix's bytes belong to, where they show one."""
    if prefix.startswith(_HTTP_METHODS):
        return ForeignProtocol("an HTTP request, not a kvtier frame: a node's port speaks kvtier's frame "
                               "protocol between nodes (the OpenAI API is on `kvtier serve`'s or the "
                               "router's port)", reply=HTTP_REFUSAL)
    if prefix.startswith(b"HTTP/"):
        return ForeignProtocol("an HTTP response, not a kvtier frame: the address dialled is an HTTP "
                               "server (`kvtier serve` or the router?), not a kvtier node")
    if prefix[:1] == b"\x16" and prefix[1:2] == b"\x03":
        return ForeignProtocol("a TLS handshake, not a kvtier frame: the peer speaks TLS to a plain node "
                               "(give both ends the same --tls setting)")
    if prefix.startswith(b"SSH-"):
        return ForeignProtocol("an SSH greeting, not a kvtier frame: the address is an SSH server")
    if _RESP_COMMAND.match(prefix):
        return ForeignProtocol("a Redis command, not a kvtier frame: a --directory URL points at this node's "
                               "port instead of the Redis server", reply=RESP_REFUSAL)
    if prefix.startswith((b"-ERR", b"-WRONGPASS", b"-NOAUTH", b"+OK", b"+PONG")):
        return ForeignProtocol("a Redis reply, not a kvtier frame: the address dialled is a Redis server "
                               "(the directory?), not a kvtier node")
    return None


def foreign_start(start: bytes) -> ForeignProtocol | None:
    """foreign_protocol of a prefix's first bytes, before all have come: only where they
    cannot begin a frame (whose first byte is 0: its header length is below 2**24)."""
    return foreign_protocol(start) if start[:1] not in (b"", b"\0") else None


assert MAX_HEADER < 1 << 24, "foreign_start takes a prefix whose first byte is not 0 for another protocol"


def check_secret(secret: object) -> bytes:
    """The cluster's shared secret as bytes, or a ConfigError that says what to pass (a str
    is refused, not encoded here: every node must MAC with the very same bytes)."""
    if isinstance(secret, str):
        raise ConfigError("the cluster's shared secret must be bytes, not str: pass secret.encode() "
                          f"(at least {MIN_SECRET_BYTES} bytes)")
    if not isinstance(secret, (bytes, bytearray)):
        raise ConfigError(f"the cluster's shared secret must be bytes (at least {MIN_SECRET_BYTES}), "
                          f"not {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the cluster's shared secret must be at least {MIN_SECRET_BYTES} bytes, "
                          f"got {len(secret)}")
    return bytes(secret)


@dataclass(frozen=True)
class Prefix:
    """A checked frame prefix: the header's length and the frame's nonce and time."""

    length: int
    nonce: bytes        # 16 bytes: time (ns) and random
    ts: float           # seconds since the epoch


@dataclass
class Frame:
    """One message. `payload` bytes follow the header on the wire (not stored here)."""

    op: str
    ns: bytes = b""
    keys: list[bytes] = field(default_factory=list)
    payload: int = 0                  # bytes that follow
    sums: list[int] = field(default_factory=list)   # xxh3-64 per block of the payload; a FIND reply: each block's tier
    n: int = 0                        # HAS/FIND/GET reply: prefix length found
    error: str = ""
    re: bytes = b""                   # a reply: the nonce of the request it answers
    nonce: bytes = b""                # set by encode() and decode()

    def encode(self, secret: bytes) -> bytes:
        """Prefix, header and MAC (the payload is sent after it by the caller); stamps the
        frame with a fresh nonce (self.nonce)."""
        body = msgpack.packb({"v": VERSION, "op": self.op, "ns": self.ns, "keys": self.keys,
                              "payload": self.payload, "sums": self.sums, "n": self.n,
                              "error": self.error, "re": self.re}, use_bin_type=True)
        head = _HEAD.pack(len(body), time.time_ns(), os.urandom(8))
        self.nonce = head[4:]
        prefix = head + hmac.new(_prefix_key(secret), head, hashlib.sha256).digest()[:TAG_BYTES]
        return prefix + body + hmac.new(secret, prefix + body, hashlib.sha256).digest()


@functools.lru_cache(maxsize=8)
def _prefix_key(secret: bytes) -> bytes:
    """The key of the prefix tag: derived from the secret, apart from the header's MAC key."""
    return hmac.new(secret, b"kvtier frame prefix v2", hashlib.sha256).digest()


def read_prefix(prefix: bytes, secret: bytes, max_age: float = MAX_AGE_S) -> Prefix:
    """Check a 36-byte prefix's tag, header length and freshness; raise FrameError otherwise.
    Costs no allocation beyond the prefix itself, whoever sent it."""
    if len(prefix) != PREFIX_BYTES:
        raise FrameError(f"frame prefix of {len(prefix)} bytes, expected {PREFIX_BYTES}")
    want = hmac.new(_prefix_key(secret), prefix[:20], hashlib.sha256).digest()[:TAG_BYTES]
    if not hmac.compare_digest(want, prefix[20:]):
        foreign = foreign_protocol(prefix)
        if foreign is not None:
            raise foreign
        raise FrameError("bad frame prefix: the peer does not share this cluster's secret "
                         "(or speaks another protocol version, or TLS to a plain node)")
    n, t_ns, _ = _HEAD.unpack(prefix[:20])
    if n == 0 or n > MAX_HEADER:
        raise FrameError(f"header of {n} bytes is out of bounds (1..{MAX_HEADER})")
    ts = t_ns / 1e9
    if abs(time.time() - ts) > max_age:
        raise FrameError(f"stale frame ({time.time() - ts:.0f} s old): clocks apart or a replay")
    return Prefix(n, prefix[4:20], ts)


def decode(prefix: bytes, body: bytes, mac: bytes, secret: bytes, max_payload: int = 1 << 34) -> Frame:
    """Check the MAC and shape of a header whose prefix passed read_prefix; raise FrameError otherwise."""
    if not hmac.compare_digest(hmac.new(secret, prefix + body, hashlib.sha256).digest(), mac):
        raise FrameError("bad MAC: the peer does not share this cluster's secret")
    try:
        d: Any = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER,
                                 max_array_len=MAX_KEYS, max_map_len=32)
    except Exception as e:   # msgpack raises several types for garbage
        raise FrameError(f"header is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(d, dict) or d.get("v") != VERSION:
        raise FrameError(f"unsupported frame version {d.get('v') if isinstance(d, dict) else None!r}")
    try:
        f = Frame(op=d["op"], ns=d["ns"], keys=d["keys"], payload=d["payload"], sums=d["sums"],
                  n=d["n"], error=d["error"], re=d["re"], nonce=prefix[4:20])
    except KeyError as e:
        raise FrameError(f"header lacks field {e.args[0]!r}") from None
    if f.op not in OPS:
        raise FrameError(f"unknown op {f.op!r}")
    if not isinstance(f.ns, bytes) or not isinstance(f.keys, list) or not all(
            isinstance(k, bytes) and len(k) == 16 for k in f.keys):
        raise FrameError("keys must be a list of 16-byte keys and ns bytes")
    if not isinstance(f.payload, int) or not 0 <= f.payload <= max_payload:
        raise FrameError(f"payload size {f.payload!r} out of bounds")
    if not isinstance(f.sums, list) or not all(isinstance(c, int) and 0 <= c < 1 << 64 for c in f.sums):
        raise FrameError("sums must be a list of 64-bit checksums")
    if not isinstance(f.n, int) or not isinstance(f.error, str) or not isinstance(f.re, bytes):
        raise FrameError("malformed n, error or re")
    return f
