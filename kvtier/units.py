"""Parsing of human-readable sizes ("8GiB", "512MB", 4096) used in capacities."""
from __future__ import annotations

import re

from kvtier.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """Return a byte count from an int or a string such as "8GiB", "1.5 GB" or "4096"."""
    if isinstance(value, bool):
        raise ConfigError(f"size must be a number of bytes or a string like '8GiB', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"size must be >= 0 bytes, got {value}")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"size must be an int or a string like '8GiB', not {type(value).__name__}")
    if value.strip().startswith("-"):
        raise ConfigError(f"size must be >= 0 bytes, got {value!r}")
    m = _SIZE.match(value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(
            f"cannot parse size {value!r}: use a number with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '8GiB'"
        )
    n = float(m.group(1)) * _UNITS[unit]
    if 0 < n < 1:       # not 0 (0 means "none" where a tier may be left out)
        raise ConfigError(f"size {value!r} is less than one byte: give a whole number of bytes or a unit, e.g. '512MiB'")
    return int(n)


def format_bytes(n: float) -> str:
    """Format a byte count with a binary unit, e.g. 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
