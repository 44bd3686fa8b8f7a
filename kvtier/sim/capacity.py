"""Capacity specs as a person writes them: "5%" or "0.05" (of the trace's unique
blocks), "2000" (blocks), or "64GiB" (bytes, given a KV layout's block size)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.units import parse_bytes


@dataclass(frozen=True, slots=True)
class Capacity:
    """One parsed spec; blocks_for(unique) resolves it for a trace."""

    text: str
    fraction: float | None = None
    blocks: int | None = None
    nbytes: int | None = None

    def blocks_for(self, unique_blocks: int, block_bytes: int | None) -> int:
        if self.fraction is not None:
            return fraction_blocks(self.fraction, unique_blocks)
        if self.blocks is not None:
            return self.blocks
        if not block_bytes:
            raise ConfigError(f"capacity {self.text!r} is in bytes: give --layout (e.g. kimi-k2) so "
                              "kvtier knows how many bytes one block takes")
        n = self.nbytes // block_bytes
        if n < 1:
            raise ConfigError(f"capacity {self.text!r} holds no block of {block_bytes} bytes: give more")
        return n


def fraction_blocks(fraction: float, unique_blocks: int) -> int:
    """The traces README's capacity model: ceil(fraction * unique blocks), at least one block."""
    if not fraction > 0:
        raise ConfigError(f"capacity fraction must be positive, got {fraction}")
    return max(1, math.ceil(fraction * unique_blocks))


def parse_capacity(text: str) -> Capacity:
    t = text.strip()
    try:
        if t.endswith("%"):
            f = float(t[:-1]) / 100.0
        elif re.fullmatch(r"\d+", t):
            n = int(t)
            if n < 1:
                raise ValueError
            return Capacity(t, blocks=n)
        elif re.fullmatch(r"\d*\.\d+", t):
            f = float(t)
        else:
            return Capacity(t, nbytes=parse_bytes(t))
    except ValueError:
        raise ConfigError(f"cannot parse capacity {text!r}: use a fraction of the trace's unique "
                          "blocks ('5%' or '0.05'), a block count ('2000') or bytes ('64GiB' with --layout)") from None
    if not 0.0 < f <= 1.0 and not (t.endswith("%") and 0.0 < f):
        raise ConfigError(f"capacity fraction {text!r} must be in (0, 1] (or a percentage like '5%')")
    return Capacity(t, fraction=f)


def parse_capacities(text: str) -> list[Capacity]:
    return [parse_capacity(p) for p in text.split(",") if p.strip()]
