"""Capacity specs as a person writes them: "5%" or "0.05" (of the trace's unique
blocks), "2000" (blocks), or "64GiB" (bytes, given a KV layout's block size).

One rule for every form: any positive size is accepted, and a size at or above the
trace's unique blocks ("150%", "1.5", a block count or a byte size larger than the
trace) is an infinite cache: nothing is ever evicted, so the replay runs it as a cache
of exactly the unique blocks (`effective_blocks`) and the CLI says so. A capacity
planner asking "what do 64 GiB give?" of a small trace gets "everything fits", not an
error and not a gigantic allocation.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.units import parse_bytes

FORMS = ("a fraction of the trace's unique blocks ('5%' or '0.05'), a block count ('2000') "
         "or bytes ('64GiB' with --layout)")


@dataclass(frozen=True, slots=True)
class Capacity:
    """One parsed spec; blocks_for(unique) resolves it for a trace (before clamping)."""

    text: str
    fraction: float | None = None
    blocks: int | None = None
    nbytes: int | None = None

    def blocks_for(self, unique_blocks: int, block_bytes: int | None) -> int:
        """Blocks this spec asks for on a trace of `unique_blocks` (may exceed it)."""
        if self.fraction is not None:
            return fraction_blocks(self.fraction, unique_blocks)
        if self.blocks is not None:
            return self.blocks
        if not block_bytes:
            raise ConfigError(f"capacity {self.text!r} is in bytes: give --layout (e.g. kimi-k2) so "
                              "kvtier knows how many bytes one block takes")
        n = self.nbytes // block_bytes
        if n < 1:
            raise ConfigError(f"capacity {self.text!r} holds no block of {block_bytes:,} bytes: "
                              "give at least one block's bytes")
        return n


def fraction_blocks(fraction: float, unique_blocks: int) -> int:
    """The traces README's capacity model: ceil(fraction * unique blocks), at least one block."""
    if not (fraction > 0 and math.isfinite(fraction)):
        raise ConfigError(f"capacity fraction must be a positive number, got {fraction}")
    return max(1, math.ceil(fraction * unique_blocks))


def effective_blocks(capacity_blocks: int, unique_blocks: int) -> int:
    """The cache the replay runs: at most the trace's unique blocks, since a larger one
    never evicts and gives the same hits (an infinite cache); at least one block."""
    return max(1, min(capacity_blocks, unique_blocks))


def parse_capacity(text: str) -> Capacity:
    """'5%', '0.05', '2000' or '64GiB' -> Capacity; anything else is a ConfigError naming the forms."""
    t = text.strip()
    if re.fullmatch(r"\d+", t):
        if int(t) < 1:
            raise ConfigError(f"capacity {text!r} is zero blocks: a cache needs at least 1 block "
                              "(or give a fraction such as '5%')")
        return Capacity(t, blocks=int(t))
    pct = t.endswith("%")
    num = t[:-1].strip() if pct else t
    if pct or re.fullmatch(r"\d*\.\d+", t):
        try:
            f = float(num) / (100.0 if pct else 1.0)
        except ValueError:
            raise ConfigError(f"cannot parse capacity {text!r}: use {FORMS}") from None
        if not (f > 0 and math.isfinite(f)):
            raise ConfigError(f"capacity {text!r} must be a positive share of the trace's unique "
                              "blocks, e.g. '5%' or '0.05' (100% or more = everything fits)")
        return Capacity(t, fraction=f)
    try:
        return Capacity(t, nbytes=parse_bytes(t))
    except ConfigError:
        raise ConfigError(f"cannot parse capacity {text!r}: use {FORMS}") from None


def parse_capacities(text: str) -> list[Capacity]:
    """A comma-separated list of specs (empty items are skipped)."""
    return [parse_capacity(p) for p in text.split(",") if p.strip()]
