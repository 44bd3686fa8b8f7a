"""Open a trace (plain or gzip-compressed JSON Lines) and tell its format from its first
record, reading the input once, so a pipe (`<(zcat t.jsonl.gz)`, a FIFO) works as a file does.
"""
from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import os
import zlib
from typing import Any, BinaryIO, Iterator

from kvtier.errors import TraceError
from kvtier.traces.jsonl import json_records
from kvtier.traces.model import Trace
from kvtier.traces.mooncake import MOONCAKE_BLOCK_TOKENS, read_mooncake
from kvtier.traces.tokens import DEFAULT_BLOCK_TOKENS, read_tokens

FORMATS = ("mooncake", "tokens")
GZIP_MAGIC = b"\x1f\x8b"
UTF8_BOM = b"\xef\xbb\xbf"
#: The longest line read: a token-level record of a 2M-token prompt is ~24 MB. Lines are
#: read with this bound, so an input without line ends (/dev/zero, a stray binary) is an
#: error after at most this many bytes, never a hang or an unbounded read into memory.
MAX_LINE_BYTES = 64 << 20


class _Unread(io.RawIOBase):
    """A stream read once (a pipe) with the bytes already taken from it put back in front,
    so the gzip check can look at the first bytes of an input that cannot seek back. Closing
    it leaves `rest` open: whoever opened `rest` closes it."""

    def __init__(self, head: bytes, rest: io.BufferedReader) -> None:
        super().__init__()
        self._head, self._rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._head:
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._rest.readinto1(b)   # one read, as a raw stream does: no wait for a full buffer


@contextlib.contextmanager
def _open(path: str) -> Iterator[BinaryIO]:
    """The input's bytes, decompressed when they start with gzip's magic number (any name).
    A regular file is rewound after the check; anything else (a pipe, a device) is read once."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise TraceError(path, None, f"cannot open the trace: {e.strerror or e}") from None
    with f:
        head = f.read(2)
        if f.seekable():
            f.seek(0)
            src: BinaryIO = f
        else:
            src = io.BufferedReader(_Unread(head, f))
        if head != GZIP_MAGIC:
            yield src
            return
        with gzip.GzipFile(fileobj=src, mode="rb") as gz:   # closes neither src nor f: `with f` does
            yield gz  # type: ignore[misc]


def _numbered(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line; bytes that are not UTF-8 text, a line past
    MAX_LINE_BYTES or a damaged gzip stream are a TraceError, never a traceback."""
    line = 0
    try:
        with _open(path) as f:
            while raw := f.readline(MAX_LINE_BYTES + 1):
                line += 1
                if b"\0" in raw:
                    raise TraceError(path, line, "binary data, not text: a trace is a JSON Lines text "
                                     "file (plain or gzip-compressed); check that this is the trace you meant")
                if len(raw) > MAX_LINE_BYTES:
                    raise TraceError(path, line, f"no line end in {MAX_LINE_BYTES >> 20} MiB: a trace is JSON "
                                     "Lines, one request object a line; check that this is the trace you meant")
                if line == 1 and raw.startswith(UTF8_BOM):   # editors on Windows write one
                    raw = raw[len(UTF8_BOM):]
                text = raw.decode("utf-8")
                if text.strip():
                    yield line, text
    except UnicodeDecodeError:
        raise TraceError(path, line, "not UTF-8 text: a trace is a JSON Lines text file (plain or "
                         "gzip-compressed); check that this is the trace you meant") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise TraceError(path, None, f"damaged gzip file ({e}): check it with `gzip -t`, or give "
                         "the uncompressed trace") from None


def _format_of(first: tuple[int, str], path: str) -> str:
    """"mooncake" (has hash_ids) or "tokens" (has tokens), from the first non-blank line."""
    for line, obj in json_records([first], path):
        if isinstance(obj, dict) and "hash_ids" in obj:
            return "mooncake"
        if isinstance(obj, dict) and "tokens" in obj:
            return "tokens"
        raise TraceError(path, line, "unknown trace format: a record needs 'hash_ids' (Mooncake) "
                         "or 'tokens' (token-level)")
    raise AssertionError("unreachable: json_records yields one record per line")


def detect_format(path: str) -> str:
    """"mooncake" (has hash_ids) or "tokens" (has tokens), from the first non-blank line.
    This reads the start of the input: on a pipe, call read_trace instead, which reads once."""
    with contextlib.closing(_numbered(path)) as lines:
        first = next(lines, None)
        if first is None:
            raise TraceError(path, None, "the trace has no requests")
        return _format_of(first, path)


def trace_name(path: str) -> str:
    """The file name without its directory, '.gz' and extension: 'conversation_trace';
    'pipe-63' for a shell's process substitution (`<(zcat t.gz)` is /dev/fd/63)."""
    base = os.path.basename(path)
    if base.isdigit() and os.path.basename(os.path.dirname(path)) == "fd":
        return f"pipe-{base}"       # two of them in one command are two traces
    if base.endswith(".gz"):
        base = base[:-3]
    return os.path.splitext(base)[0] or base


def read_trace(path: str, block_tokens: int | None = None, name: str | None = None) -> Trace:
    """Read a Mooncake or token-level JSONL trace (plain or gzip), detected from the file.

    `block_tokens` keys token-level traces (default 512); Mooncake traces are fixed at
    512-token blocks and reject any other value.
    """
    if os.path.isdir(path):
        raise TraceError(path, None, "is a directory: give a JSONL trace file")
    if not os.path.exists(path):
        raise TraceError(path, None, "no such trace file: give a JSONL trace path, or "
                         "--synthetic to generate one")
    if block_tokens is not None and block_tokens < 1:
        raise TraceError(path, None, f"block_tokens must be at least 1, got {block_tokens}")
    name = name or trace_name(path)
    with contextlib.closing(_numbered(path)) as lines:   # one pass: a pipe cannot be read twice
        first = next(lines, None)
        if first is None:
            raise TraceError(path, None, "the trace has no requests")
        records = itertools.chain([first], lines)
        if _format_of(first, path) == "mooncake":
            if block_tokens not in (None, MOONCAKE_BLOCK_TOKENS):
                raise TraceError(path, None, f"Mooncake traces hash {MOONCAKE_BLOCK_TOKENS}-token blocks; "
                                 f"--block-tokens {block_tokens} applies to token-level traces only")
            return read_mooncake(records, path, name)
        return read_tokens(records, path, name, block_tokens or DEFAULT_BLOCK_TOKENS)
