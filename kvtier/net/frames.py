"""The wire format between nodes: authenticated msgpack headers, raw block payloads.

    u32 header length | header (msgpack map) | 32-byte HMAC-SHA256(secret, header) | payload

The header names the operation, the namespace seed, the keys, the payload size and an
xxh3-64 checksum per block; the HMAC covers all of it, so a payload that does not match
its checksums is caught too without hashing the payload twice. A header older than
`max_age` seconds (or from too far in the future) is stale and refused. Sizes are bounded
before anything is allocated, so garbage on the wire costs an error reply, not memory.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvtier.errors import KvtierError

VERSION = 1
OPS = ("HAS", "GET", "PUT", "OK", "ERR")
MAC_BYTES = 32
MAX_HEADER = 4 << 20            # a 128k-token prompt at 16 tokens a block: ~200 KiB of keys
MAX_KEYS = 1 << 16
_LEN = struct.Struct("!I")


class FrameError(KvtierError):
    """A frame that is malformed, too large, unauthenticated or stale."""


@dataclass
class Frame:
    """One message. `payload` bytes follow the header on the wire (not stored here)."""

    op: str
    ns: bytes = b""
    keys: list[bytes] = field(default_factory=list)
    payload: int = 0                  # bytes that follow
    sums: list[int] = field(default_factory=list)   # xxh3-64 per block of the payload
    n: int = 0                        # HAS/GET reply: prefix length found
    error: str = ""
    ts: float = 0.0

    def encode(self, secret: bytes) -> bytes:
        """Length prefix, header and MAC (the payload is sent after it by the caller)."""
        body = msgpack.packb({"v": VERSION, "op": self.op, "ns": self.ns, "keys": self.keys,
                              "payload": self.payload, "sums": self.sums, "n": self.n,
                              "error": self.error, "ts": time.time()}, use_bin_type=True)
        return _LEN.pack(len(body)) + body + hmac.new(secret, body, hashlib.sha256).digest()


def header_length(prefix: bytes) -> int:
    """The header length from the 4-byte prefix, bounded."""
    (n,) = _LEN.unpack(prefix)
    if n == 0 or n > MAX_HEADER:
        raise FrameError(f"header of {n} bytes is out of bounds (1..{MAX_HEADER})")
    return n


def decode(body: bytes, mac: bytes, secret: bytes, max_age: float = 30.0,
           max_payload: int = 1 << 34) -> Frame:
    """Check the MAC, freshness and shape of a header; raise FrameError otherwise."""
    if not hmac.compare_digest(hmac.new(secret, body, hashlib.sha256).digest(), mac):
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
                  n=d["n"], error=d["error"], ts=d["ts"])
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
    if not isinstance(f.n, int) or not isinstance(f.error, str) or not isinstance(f.ts, (int, float)):
        raise FrameError("malformed n, error or ts")
    if abs(time.time() - f.ts) > max_age:
        raise FrameError(f"stale frame ({time.time() - f.ts:.0f} s old): clocks apart or a replay")
    return f
