"""The Mooncake FAST'25 trace format: one JSON object per line,

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

with one prefix-chained id per 512-token block of the prompt (the last block may be
partial). A `session` field, when present, is kept for session-affinity routing.
"""
from __future__ import annotations

from typing import Any, Iterable

from kvtier.errors import TraceError
from kvtier.traces.jsonl import json_records, non_negative_number, session_field, token_count
from kvtier.traces.model import Request, Trace

#: Mooncake's traces hash prompts in blocks of this many tokens.
MOONCAKE_BLOCK_TOKENS = 512


def _int_field(obj: dict[str, Any], name: str, path: str, line: int, required: bool = True) -> int:
    """obj[name] as a whole number (a float is truncated); 0 when optional and absent or null.
    NaN, infinities, a length past MAX_TOKEN_COUNT and the like are a TraceError naming the line."""
    v = obj.get(name)
    if v is None and not required:
        return 0
    if v is None and name not in obj:
        raise TraceError(path, line, f"field {name!r} is missing: a Mooncake record needs it")
    if name.endswith("_length"):
        return token_count(v, name, path, line)
    return int(non_negative_number(v, name, path, line))


def parse_mooncake_line(obj: Any, path: str, line: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Request:
    """One decoded line -> Request; raises TraceError naming the line if it is malformed."""
    if not isinstance(obj, dict):
        raise TraceError(path, line, f"expected a JSON object, got {type(obj).__name__}")
    ids = obj.get("hash_ids")
    if ids is None and "hash_ids" not in obj:
        other = " (a token-level record: a trace is one format throughout, as its first line sets)" \
            if "tokens" in obj else ""
        raise TraceError(path, line, f"field 'hash_ids' is missing: a Mooncake record needs it{other}")
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise TraceError(path, line, "field 'hash_ids' must be a list of integer block ids")
    bad = next((i for i, h in enumerate(ids) if not 0 <= h < 1 << 63), None)
    if bad is not None:
        raise TraceError(path, line, f"hash_ids[{bad}] is {ids[bad]}: block ids are integers in [0, 2**63)")
    n_in = _int_field(obj, "input_length", path, line)
    expect = -(-n_in // block_tokens)
    if len(ids) != expect:
        raise TraceError(path, line, f"{len(ids)} hash_ids for input_length {n_in}: expected "
                         f"ceil({n_in}/{block_tokens}) = {expect}; is this a {block_tokens}-token-block trace?")
    rem = n_in - (len(ids) - 1) * block_tokens if ids else 0
    return Request(keys=ids, input_length=n_in,
                   output_length=_int_field(obj, "output_length", path, line, required=False),
                   timestamp=float(_int_field(obj, "timestamp", path, line, required=False)),
                   session=session_field(obj, path, line),
                   last_tokens=rem if 0 < rem < block_tokens else None)


def read_mooncake(lines: Iterable[tuple[int, str]], path: str, name: str) -> Trace:
    """Numbered JSONL lines -> Trace (blank lines are skipped)."""
    reqs: list[Request] = []
    for line, obj in json_records(lines, path):
        reqs.append(parse_mooncake_line(obj, path, line))
    return Trace(name=name, requests=reqs, block_tokens=MOONCAKE_BLOCK_TOKENS, format="mooncake", path=path)


def mooncake_record(r: Request) -> dict[str, Any]:
    """A Request as a Mooncake JSONL object (keys must be ints)."""
    d: dict[str, Any] = {"timestamp": int(r.timestamp), "input_length": r.input_length,
                         "output_length": r.output_length, "hash_ids": list(r.keys)}
    if r.session is not None:
        d["session"] = r.session
    return d
