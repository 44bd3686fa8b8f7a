"""The token-level trace format: each request's token ids, keyed by kvtier's own keys.

    {"timestamp": 1200, "tokens": [101, 7, ...], "output_length": 80, "session": "s17"}

Keys are kvtier's chained block keys (kvtier.keys.chain_keys) from a fixed trace seed,
and, like the store, only full blocks are keyed: a partial trailing block is never
cached. So replaying a token-level trace gives the store's own hit/miss sequence.
"""
from __future__ import annotations

from typing import Any, Iterable

import xxhash

from kvtier.keys import chain_keys
from kvtier.errors import TraceError
from kvtier.traces.jsonl import json_records, non_negative_number, session_field, token_count
from kvtier.traces.model import Request, Trace

#: key_{-1} of every token-level trace chain (a constant, so files replay identically).
TRACE_SEED = xxhash.xxh3_128_digest(b"kvtier-trace-v1")
DEFAULT_BLOCK_TOKENS = 512


def token_request(tokens: Any, block_tokens: int, *, timestamp: float = 0.0, output_length: int = 0,
                  session: str | None = None) -> Request:
    """Key one prompt's tokens into a Request (full blocks only, as the store does)."""
    keys = chain_keys(tokens, block_tokens, TRACE_SEED)
    return Request(keys=list(keys), input_length=len(tokens), output_length=output_length,
                   timestamp=timestamp, session=session)


def parse_token_line(obj: Any, path: str, line: int, block_tokens: int) -> Request:
    """One decoded line -> Request; raises TraceError naming the line if it is malformed."""
    if not isinstance(obj, dict):
        raise TraceError(path, line, f"expected a JSON object, got {type(obj).__name__}")
    toks = obj.get("tokens")
    if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                             and 0 <= t < 2**32 for t in toks):
        raise TraceError(path, line, "field 'tokens' must be a list of token ids in [0, 2**32)")
    out = token_count(obj.get("output_length", 0), "output_length", path, line)
    ts = non_negative_number(obj.get("timestamp", 0), "timestamp", path, line)
    return token_request(toks, block_tokens, timestamp=float(ts), output_length=out,
                         session=session_field(obj, path, line))


def read_tokens(lines: Iterable[tuple[int, str]], path: str, name: str,
                block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Trace:
    reqs: list[Request] = []
    for line, obj in json_records(lines, path):
        reqs.append(parse_token_line(obj, path, line, block_tokens))
    return Trace(name=name, requests=reqs, block_tokens=block_tokens, format="tokens", path=path)


def token_record(tokens: Any, timestamp: float, output_length: int, session: str | None) -> dict[str, Any]:
    d: dict[str, Any] = {"timestamp": int(timestamp), "tokens": [int(t) for t in tokens],
                         "output_length": int(output_length)}
    if session is not None:
        d["session"] = session
    return d
