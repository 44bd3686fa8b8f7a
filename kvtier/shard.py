"""The shard part of a namespace: which slice of a parallel model a store's KV belongs to.

    ""              unsharded (one store holds every layer and head)
    "tp0/8"         tensor-parallel rank 0 of 8
    "pp1/4"         pipeline-parallel stage 1 of 4
    "tp0/8,pp1/4"   both (tensor part first)

The shard is hashed into the namespace seed as written, so "tp00/8" and "tp0/8" would be
two namespaces that never share a block: only the canonical spelling above is accepted
(ranks and sizes in plain decimal, rank < size), and a typo is an error, not a new namespace.
"""
from __future__ import annotations

import re

from kvtier.errors import ConfigError

KINDS = ("tp", "pp")        # tensor-, pipeline-parallel, in the order they are written
_PART = re.compile(r"(tp|pp)(0|[1-9][0-9]*)/([1-9][0-9]*)")
SYNTAX = "tpRANK/SIZE, ppRANK/SIZE or both as tp0/8,pp1/4 (empty: unsharded)"


def parse_shard(text: str) -> dict[str, tuple[int, int]]:
    """{"tp": (rank, size), ...} of a shard string; ConfigError naming the problem."""
    if not isinstance(text, str):
        raise ConfigError(f"a shard must be a string such as 'tp0/8', not {type(text).__name__}")
    if text == "":
        return {}
    parts: dict[str, tuple[int, int]] = {}
    for part in text.split(","):
        m = _PART.fullmatch(part)
        if m is None:
            raise ConfigError(f"shard {text!r} is not valid: write {SYNTAX}")
        kind, rank, size = m.group(1), int(m.group(2)), int(m.group(3))
        if rank >= size:
            raise ConfigError(f"shard {text!r}: rank {rank} is not below the size {size} "
                              f"(ranks count from 0, so {kind}{size - 1}/{size} is the last)")
        if kind in parts or (parts and KINDS.index(kind) < KINDS.index(next(reversed(parts)))):
            raise ConfigError(f"shard {text!r}: give each of {', '.join(KINDS)} at most once, in that order")
        parts[kind] = (rank, size)
    return parts


def check_shard(text: str) -> str:
    """`text` itself when it is a valid shard string (see parse_shard), else ConfigError."""
    parse_shard(text)
    return text
