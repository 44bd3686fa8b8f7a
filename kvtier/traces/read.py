"""Open a trace file and tell its format from its first record."""
from __future__ import annotations

import os
from typing import Iterator

from kvtier.errors import TraceError
from kvtier.traces.jsonl import json_records
from kvtier.traces.model import Trace
from kvtier.traces.mooncake import MOONCAKE_BLOCK_TOKENS, read_mooncake
from kvtier.traces.tokens import DEFAULT_BLOCK_TOKENS, read_tokens

FORMATS = ("mooncake", "tokens")


def _numbered(path: str) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for i, text in enumerate(f, 1):
            if text.strip():
                yield i, text


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


def read_trace(path: str, block_tokens: int | None = None, name: str | None = None) -> Trace:
    """Read a Mooncake or token-level JSONL trace, detected from the file.

    `block_tokens` keys token-level traces (default 512); Mooncake traces are fixed at
    512-token blocks and reject any other value.
    """
    if not os.path.isfile(path):
        raise TraceError(path, None, "no such trace file: give a JSONL trace path, or "
                         "--synthetic to generate one")
    name = name or os.path.splitext(os.path.basename(path))[0]
    fmt = detect_format(path)
    if fmt == "mooncake":
        if block_tokens not in (None, MOONCAKE_BLOCK_TOKENS):
            raise TraceError(path, None, f"Mooncake traces hash {MOONCAKE_BLOCK_TOKENS}-token blocks; "
                             f"--block-tokens {block_tokens} applies to token-level traces only")
        return read_mooncake(_numbered(path), path, name)
    return read_tokens(_numbered(path), path, name, block_tokens or DEFAULT_BLOCK_TOKENS)
