"""Open a trace (plain or gzip-compressed JSON Lines) and tell its format from its first
record, reading the input once, so a pipe (`<(zcat t.jsonl.gz)`, a FIFO, `-` for standard
input) works as a file does; and name the traces of one run so that no two share a name.
"""
from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import os
import sys
import zlib
from typing import Any, BinaryIO, Iterator, Sequence

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
#: The trace path that reads standard input, and the name it goes by in tables, JSON rows
#: and error messages.
STDIN = "-"
STDIN_NAME = "stdin"


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
        f = open(sys.stdin.fileno(), "rb", closefd=False) if path == STDIN else open(path, "rb")
    except (OSError, ValueError, AttributeError) as e:   # stdin closed or None: ValueError, AttributeError
        raise TraceError(_label(path), None, f"cannot open the trace: {getattr(e, 'strerror', None) or e}") from None
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
    where = _label(path)
    line = 0
    try:
        with _open(path) as f:
            while raw := f.readline(MAX_LINE_BYTES + 1):
                line += 1
                if b"\0" in raw:
                    raise TraceError(where, line, "binary data, not text: a trace is a JSON Lines text "
                                     "file (plain or gzip-compressed); check that this is the trace you meant")
                if len(raw) > MAX_LINE_BYTES:
                    raise TraceError(where, line, f"no line end in {MAX_LINE_BYTES >> 20} MiB: a trace is JSON "
                                     "Lines, one request object a line; check that this is the trace you meant")
                if line == 1 and raw.startswith(UTF8_BOM):   # editors on Windows write one
                    raw = raw[len(UTF8_BOM):]
                text = raw.decode("utf-8")
                if text.strip():
                    yield line, text
    except UnicodeDecodeError:
        raise TraceError(where, line, "not UTF-8 text: a trace is a JSON Lines text file (plain or "
                         "gzip-compressed); check that this is the trace you meant") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise TraceError(where, None, f"damaged gzip file ({e}): check it with `gzip -t`, or give "
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
            raise TraceError(_label(path), None, "the trace has no requests")
        return _format_of(first, _label(path))


def _label(path: str) -> str:
    """How messages name an input: its path, or 'stdin' for '-'."""
    return STDIN_NAME if path == STDIN else path


def trace_name(path: str) -> str:
    """The file name without its directory, '.gz' and extension: 'conversation_trace';
    'pipe-63' for a shell's process substitution (`<(zcat t.gz)` is /dev/fd/63); 'stdin'
    for '-'."""
    if path == STDIN:
        return STDIN_NAME
    base = os.path.basename(path)
    if base.isdigit() and os.path.basename(os.path.dirname(path)) == "fd":
        return f"pipe-{base}"       # two of them in one command are two traces
    if base.endswith(".gz"):
        base = base[:-3]
    return os.path.splitext(base)[0] or base


def _folder(path: str) -> str | None:
    """The name of the folder an input is in ('/' at the root); None for stdin and a
    shell's pipe, whose name is all there is to them."""
    if path == STDIN or trace_name(path).startswith("pipe-"):
        return None
    return os.path.basename(os.path.dirname(os.path.abspath(path))) or "/"


def _with_folder(path: str) -> str:
    """The name with its folder in front ('d1/t'): tells d1/t.jsonl from d2/t.jsonl."""
    folder = _folder(path)
    return trace_name(path) if folder is None else f"{folder.rstrip('/')}/{trace_name(path)}"


def _with_file_name(path: str) -> str:
    """The folder and the whole file name ('d/t.jsonl.gz'): tells t.jsonl from t.jsonl.gz."""
    folder = _folder(path)
    return trace_name(path) if folder is None else f"{folder.rstrip('/')}/{os.path.basename(path)}"


def _clashing(names: Sequence[str], taken: Sequence[str]) -> list[int]:
    """Indices of the names another name (or a taken one) equals."""
    count: dict[str, int] = {}
    for n in [*names, *taken]:
        count[n] = count.get(n, 0) + 1
    return [i for i, n in enumerate(names) if count[n] > 1]


def trace_names(paths: Sequence[str], taken: Sequence[str] = ()) -> list[str]:
    """A distinct name for each input of one run (tables, JSON rows and --plot panels are
    keyed by it), none of them in `taken` (the generated trace's): trace_name(); where two
    clash, the folder in front ('d1/t'), then the whole file name ('d/t.jsonl.gz'); names
    that still clash (same folder name and file name in two places) get '#2', '#3'."""
    names = [trace_name(p) for p in paths]
    for widen in (_with_folder, _with_file_name):
        for i in _clashing(names, taken):
            names[i] = widen(paths[i])
    used = set(taken)
    out = []
    for n in names:
        k, name = 1, n
        while name in used:
            k += 1
            name = f"{n}#{k}"
        used.add(name)
        out.append(name)
    return out


def _identity(path: str) -> tuple[Any, ...]:
    """What an input is, beyond how it is written: its device and inode ('t.jsonl',
    './t.jsonl' and a link to it are one file; '-' is what stdin is), else the path."""
    try:
        st = os.fstat(sys.stdin.fileno()) if path == STDIN else os.stat(path)
    except (OSError, ValueError, AttributeError):
        return ("path", path)
    return ("file", st.st_dev, st.st_ino)


def distinct_inputs(paths: Sequence[str]) -> list[str]:
    """The paths in order, each input once: a file given twice (or by two names) is one
    trace, replayed once, as a policy or capacity given twice is one row."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for p in paths:
        key = _identity(p)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _check_input(path: str) -> None:
    """A TraceError now for an input that cannot be a trace: a folder, a missing file, or
    '-' when stdin is a terminal (the read would wait for typing)."""
    if path == STDIN:
        try:
            tty = os.isatty(sys.stdin.fileno())
        except (OSError, ValueError, AttributeError):
            tty = False
        if tty:
            raise TraceError(STDIN_NAME, None, "'-' reads the trace from standard input, which is a "
                             "terminal: pipe a trace in, e.g. `zcat t.jsonl.gz | kvtier bench hit-ratio -`")
        return
    if os.path.isdir(path):
        raise TraceError(path, None, "is a directory: give a JSONL trace file")
    if not os.path.exists(path):
        raise TraceError(path, None, "no such trace file: give a JSONL trace path, '-' for standard "
                         "input, or --synthetic to generate one")


def read_trace(path: str, block_tokens: int | None = None, name: str | None = None) -> Trace:
    """Read a Mooncake or token-level JSONL trace (plain or gzip), detected from the file;
    '-' reads standard input (named 'stdin').

    `block_tokens` keys token-level traces (default 512); Mooncake traces are fixed at
    512-token blocks and reject any other value.
    """
    _check_input(path)
    where = _label(path)
    if block_tokens is not None and block_tokens < 1:
        raise TraceError(where, None, f"block_tokens must be at least 1, got {block_tokens}")
    name = name or trace_name(path)
    with contextlib.closing(_numbered(path)) as lines:   # one pass: a pipe cannot be read twice
        first = next(lines, None)
        if first is None:
            raise TraceError(where, None, "the trace has no requests")
        records = itertools.chain([first], lines)
        if _format_of(first, where) == "mooncake":
            if block_tokens not in (None, MOONCAKE_BLOCK_TOKENS):
                raise TraceError(where, None, f"Mooncake traces hash {MOONCAKE_BLOCK_TOKENS}-token blocks; "
                                 f"--block-tokens {block_tokens} applies to token-level traces only")
            return read_mooncake(records, where, name)
        return read_tokens(records, where, name, block_tokens or DEFAULT_BLOCK_TOKENS)
