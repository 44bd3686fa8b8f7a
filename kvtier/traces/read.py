"""Open a trace file (plain or gzip-compressed JSON Lines) and tell its format from its
first record."""
from __future__ import annotations

import gzip
import os
import zlib
from typing import BinaryIO, Iterator

from kvtier.errors import TraceError
from kvtier.traces.jsonl import json_records
from kvtier.traces.model import Trace
from kvtier.traces.mooncake import MOONCAKE_BLOCK_TOKENS, read_mooncake
from kvtier.traces.tokens import DEFAULT_BLOCK_TOKENS, read_tokens

FORMATS = ("mooncake", "tokens")
GZIP_MAGIC = b"\x1f\x8b"


def _open(path: str) -> BinaryIO:
    """The file's bytes, decompressed when it starts with gzip's magic number (any name)."""
    with open(path, "rb") as f:
        gz = f.read(2) == GZIP_MAGIC
    return gzip.open(path, "rb") if gz else open(path, "rb")


def _numbered(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line; bytes that are not UTF-8 text or a damaged
    gzip stream are a TraceError, never a traceback."""
    line = 0
    try:
        with _open(path) as f:
            for line, raw in enumerate(f, 1):
                if b"\0" in raw:
                    raise TraceError(path, line, "binary data, not text: a trace is a JSON Lines text "
                                     "file (plain or gzip-compressed); check that this is the trace you meant")
                text = raw.decode("utf-8")
                if text.strip():
                    yield line, text
    except UnicodeDecodeError:
        raise TraceError(path, line, "not UTF-8 text: a trace is a JSON Lines text file (plain or "
                         "gzip-compressed); check that this is the trace you meant") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise TraceError(path, None, f"damaged gzip file ({e}): check it with `gzip -t`, or give "
                         "the uncompressed trace") from None


def detect_format(path: str) -> str:
    """"mooncake" (has hash_ids) or "tokens" (has tokens), from the first non-blank line."""
    for line, obj in json_records(_numbered(path), path):
        if isinstance(obj, dict) and "hash_ids" in obj:
            return "mooncake"
        if isinstance(obj, dict) and "tokens" in obj:
            return "tokens"
        raise TraceError(path, line, "unknown trace format: a record needs 'hash_ids' (Mooncake) "
                         "or 'tokens' (token-level)")
    raise TraceError(path, None, "the trace has no requests")


def trace_name(path: str) -> str:
    """The file name without its directory, '.gz' and extension: 'conversation_trace'."""
    base = os.path.basename(path)
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
    if not os.path.isfile(path):
        raise TraceError(path, None, "no such trace file: give a JSONL trace path, or "
                         "--synthetic to generate one")
    if block_tokens is not None and block_tokens < 1:
        raise TraceError(path, None, f"block_tokens must be at least 1, got {block_tokens}")
    name = name or trace_name(path)
    fmt = detect_format(path)
    if fmt == "mooncake":
        if block_tokens not in (None, MOONCAKE_BLOCK_TOKENS):
            raise TraceError(path, None, f"Mooncake traces hash {MOONCAKE_BLOCK_TOKENS}-token blocks; "
                             f"--block-tokens {block_tokens} applies to token-level traces only")
        return read_mooncake(_numbered(path), path, name)
    return read_tokens(_numbered(path), path, name, block_tokens or DEFAULT_BLOCK_TOKENS)
