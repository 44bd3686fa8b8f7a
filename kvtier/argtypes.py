"""Option types for the `kvtier` command: each checks its value where argparse reads it,
so a bad value is a one-line usage error naming the option, never a traceback later."""
from __future__ import annotations

import argparse
from typing import Callable

from kvtier.errors import ConfigError
from kvtier.units import parse_bytes


def _number(cast: Callable[[str], float], low: float, inclusive: bool, what: str) -> Callable[[str], float]:
    def check(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value < low or (value == low and not inclusive) or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    check.__name__ = what   # argparse names the type in its messages
    return check


positive_int = _number(int, 0, False, "a whole number >= 1")
non_negative_int = _number(int, 0, True, "a whole number >= 0")
positive_float = _number(float, 0.0, False, "a finite number > 0")
non_negative_float = _number(float, 0.0, True, "a finite number >= 0")


def int_between(low: int, high: int, unit: str) -> Callable[[str], int]:
    """A whole number in [low, high] `unit` (e.g. "tokens a block"): the message states both
    bounds, so a value past any sane size is a usage error, not an overflow deep in a run."""
    what = f"a whole number from {low:,} to {high:,} ({unit})"

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    check.__name__ = what
    return check


#: A seed: torch and numpy take 64 bits (a larger one failed deep in a run, the flag unnamed).
seed_arg = int_between(0, 2**64 - 1, "a seed")


def size(text: str) -> int:
    """A byte count such as 8GiB, 512MB or 4096 (> 0)."""
    if text.strip().startswith("-"):         # said as 0 is (a negative one said ">= 0", a 0 "> 0")
        raise argparse.ArgumentTypeError(f"{text!r} is not a size > 0 bytes")
    try:
        n = parse_bytes(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size > 0 bytes")
    return n
