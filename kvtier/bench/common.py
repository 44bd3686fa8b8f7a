"""Shared pieces of the benchmarks: timing, option types, progress of replays, and printing
rows as JSON lines or as a table that fits 100 columns."""
from __future__ import annotations

import argparse
import errno
import io
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

# Tables are designed to fit this many columns: a terminal's usual width, and the width
# used when the output is piped.
TABLE_WIDTH = 100
# Set (to anything but "" or "0") to make print_table raise TableTooWide instead of
# wrapping a table wider than TABLE_WIDTH: the tests do, so a new column cannot push a
# table past 100 columns unnoticed.
STRICT_ENV = "KVTIER_STRICT_TABLES"


class TableTooWide(AssertionError):
    """A table's natural width exceeds TABLE_WIDTH (raised only under KVTIER_STRICT_TABLES)."""


def quiet_threads() -> None:
    """One torch thread: on a small machine two busy threads fight and timings lie."""
    import torch
    torch.set_num_threads(1)


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python that must run this kvtier (a bench's server, a
    test's subprocess, another venv's interpreter): the folder this kvtier is imported from
    first on PYTHONPATH, ahead of what was there (a machine may bring packages on
    PYTHONPATH, as the GPU machines do), then `extra`."""
    import kvtier

    root = str(Path(kvtier.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def _check_repeat(repeat: int) -> None:
    from kvtier.errors import ConfigError
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ConfigError(f"repeat must be a whole number >= 1 (the median of that many timings), got {repeat!r}")


def timeit(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    """Median seconds of `repeat` calls of fn after `warmup` untimed ones."""
    _check_repeat(repeat)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(frozen=True)
class Paired:
    """Timings of an operation `a` and its raw baseline `b`, taken in alternation.

    `ratio` is the median over rounds of b's time / a's time in the same round (a's speed as
    a fraction of the baseline's), not a ratio of two medians: on a shared 2-core VM one
    copy or send takes 0.6-2x another's time, and a round's two timings share its
    conditions. `low`/`high` bound that median with >= 90 % confidence from 5 rounds on
    (order statistics of the rounds, no assumption about their distribution): a ratio is
    only as sure as that."""

    a: float                        # median seconds of a()
    b: float                        # median seconds of b()
    ratios: tuple[float, ...]       # b / a, round by round

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def low(self) -> float:
        return sorted(self.ratios)[_rank(len(self.ratios))]

    @property
    def high(self) -> float:
        return sorted(self.ratios)[len(self.ratios) - 1 - _rank(len(self.ratios))]

    def fields(self) -> dict[str, float]:
        """The ratio and its interval, as a row's "ratio", "ratio_low" and "ratio_high"."""
        return {"ratio": self.ratio, "ratio_low": self.low, "ratio_high": self.high}


def _rank(n: int) -> int:
    """The largest k such that the k-th smallest and k-th largest of n samples (0-based)
    bracket their population's median with probability >= 0.9 (both binomial tails);
    0 (the whole range of the rounds, a weaker bound) for fewer than 5 rounds."""
    from math import comb

    best, tail = 0, 0.0
    for k in range((n - 1) // 2 + 1):
        tail += comb(n, k) / 2 ** n         # P(at most k samples below the median)
        if 2 * tail > 0.1:
            break
        best = k
    return best


def synced(fn: Callable[[], object], device: Any) -> Callable[[], object]:
    """fn, then on a GPU a device synchronize: a timing covers the copies, not only their queueing."""
    if getattr(device, "type", device) != "cuda":
        return fn
    import torch

    def run() -> None:
        fn()
        torch.cuda.synchronize(device)
    return run


def timeit_pair(a: Callable[[], object], b: Callable[[], object], repeat: int) -> Paired:
    """Time a() and b() `repeat` times each, alternating them, so both see the same
    conditions (a virtual disk's or a shared CPU's speed drifts from second to second).
    Which one goes first swaps every round (a b, b a, a b, ...): each is timed as often
    right after the other as before it, so neither inherits more of the other's left-over
    work (a disk still flushing a write)."""
    _check_repeat(repeat)
    a()
    b()
    fns = (a, b)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(repeat):
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return Paired(statistics.median(times[0]), statistics.median(times[1]),
                  tuple(tb / ta for ta, tb in zip(*times)))


def fmt_interval(row: dict[str, Any]) -> str:
    """A row's ratio interval as "0.91-1.03" (for a table column)."""
    return f"{row['ratio_low']:.2f}-{row['ratio_high']:.2f}"


# -- option types -------------------------------------------------------------------------
def size_list(text: str) -> list[int]:
    """argparse type: comma-separated byte sizes such as "64KiB,1MiB", each > 0."""
    from kvtier.argtypes import size

    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of sizes, e.g. 64KiB,1MiB")
    return [size(p) for p in parts]


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated whole numbers >= 1, such as "1,16"."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers >= 1, e.g. 1,16")
    return values


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated subset of `choices`, in the order given."""
    def check(text: str) -> list[str]:
        parts = [p.strip() for p in text.split(",")]
        bad = [p for p in parts if p not in choices]
        if bad or not parts:
            raise argparse.ArgumentTypeError(f"{text!r}: choose a comma-separated list of {', '.join(choices)}")
        return list(dict.fromkeys(parts))
    check.__name__ = "list"
    return check


def existing_dir(option: str, path: str | None) -> Path | None:
    """`path` as a Path if it is an existing directory the benchmark can write its scratch
    files in (None stays None), else a ConfigError that names the option."""
    from kvtier.errors import ConfigError
    from kvtier.tiers.disk_dir import unwritable

    if path is None:
        return None
    p = Path(path)
    if not p.is_dir():
        what = "is not a directory" if p.exists() else "does not exist"
        raise ConfigError(f"{option} {path}: {what}: give an existing directory")
    why = unwritable(p)
    if why:
        raise ConfigError(f"{option} {path}: {why}: give a directory you can write on a disk")
    return p


def check_block_sizes(sizes: Sequence[int], total: int, multiple: int, option: str = "--block-bytes") -> None:
    """Each block size a multiple of `multiple` bytes, and `total` (bytes per timed
    operation) at least the largest block."""
    from kvtier.errors import ConfigError
    from kvtier.units import format_bytes

    for bb in sizes:
        if bb % multiple:
            raise ConfigError(f"{option}: {bb} bytes is not a multiple of {multiple} bytes: "
                              f"give sizes like 64KiB or 1MiB")
    if total < max(sizes):
        raise ConfigError(f"--total {format_bytes(total)} is smaller than one block ({format_bytes(max(sizes))}): "
                          "give a --total of at least the largest --block-bytes")


@contextmanager
def memory_hint(hint: str) -> Iterator[None]:
    """Turn running out of memory inside the block (MemoryError, or ENOMEM from mmap) into one
    error line that says which option to lower: `hint`, e.g. "give a smaller --total"."""
    from kvtier.errors import KvtierError

    try:
        yield
    except MemoryError:
        raise KvtierError(f"out of memory: {hint}") from None
    except OSError as e:
        if e.errno != errno.ENOMEM:
            raise
        raise KvtierError(f"out of memory ({e.strerror}): {hint}") from None
    except RuntimeError as e:   # torch's allocators: "can't allocate memory", "CUDA out of memory"
        text = str(e).lower()
        if "can't allocate memory" not in text and "out of memory" not in text:
            raise
        raise KvtierError(f"out of memory: {hint}") from None


@contextmanager
def replay_ticks(bar: Any, requests: int) -> Iterator[Callable[[int], None] | None]:
    """The progress(i) callback of one replay of `requests` requests (i: requests done so
    far) that advances `bar` (a kvtier.progress.Progress); on leaving, the bar is moved to
    the replay's end. None when the bar is not shown, so the replay makes no calls."""
    done = [0]

    def tick(i: int) -> None:
        bar.advance(i - done[0])
        done[0] = i
    yield tick if bar.shown else None
    bar.advance(requests - done[0])


# -- output ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    """A table column: the row's `key`, a short heading, and how to show a value."""

    key: str
    head: str
    fmt: Callable[[Any], str] | None = None
    of_row: Callable[[dict[str, Any]], str] | None = None    # shows several fields at once

    def show(self, row: dict[str, Any]) -> str:
        v = row.get(self.key)
        if v is None:
            return ""
        if self.of_row is not None:
            return self.of_row(row)
        return self.fmt(v) if self.fmt is not None else _fmt(v)


def interval_column() -> Column:
    """The column showing a Paired ratio's interval (rows with "ratio_low"/"ratio_high")."""
    return Column("ratio_low", "90% CI", of_row=fmt_interval)


def emit(rows: Sequence[dict[str, Any]], as_json: bool, title: str, columns: Sequence[str | Column],
         left: int = 0) -> None:
    """Print rows as one JSON object per line (every field), or as a table for a person
    (the given columns: a key, or a Column with a short heading and a format)."""
    if as_json:
        for r in rows:
            print(json.dumps(r), flush=True)
        return
    cols = [c if isinstance(c, Column) else Column(c, c) for c in columns]
    print_table(title, [c.head for c in cols], [[c.show(r) for c in cols] for r in rows], left=left)


def print_table(title: str, head: Sequence[str], rows: Sequence[Sequence[str]], left: int = 0) -> None:
    """A table for a person: rich when installed, plain columns otherwise. The first
    `left` columns are left-aligned (names), the rest right-aligned (numbers).

    Tables are meant to fit TABLE_WIDTH (100) columns: choose short headings and cells.
    Piped output is laid out 100 columns wide, a terminal's at its own width but never
    narrower than 100: a narrower terminal wraps the lines, and no cell is cut short
    ("lru+no…", "0.28…" at 60 columns). A table that is naturally wider raises
    TableTooWide when $KVTIER_STRICT_TABLES is set (the tests), and otherwise has its
    cells folded onto more lines by rich, never cut.

    A reader of stdout that went away (`| head -1`) raises BrokenPipeError, as print()
    does, so kvtier's handler exits 141 (rich's own handler exited 1)."""
    try:
        from rich.console import Console
        from rich.measure import Measurement
        from rich.table import Table
    except ImportError:
        _print_plain(title, head, rows, left)
        return
    table = Table(title=title)
    for i, h in enumerate(head):
        table.add_column(h, justify="left" if i < left else "right", overflow="fold")
    for row in rows:
        table.add_row(*row)
    probe = Console(width=10_000, file=io.StringIO())   # the width with nothing wrapped
    _check_width(title, Measurement.get(probe, probe.options, table).maximum)
    _stdout_console().print(table)


def _stdout_console() -> Any:
    """A rich Console on stdout, TABLE_WIDTH wide when piped and at least that on a terminal,
    that lets a broken pipe reach kvtier's handler (rich's on_broken_pipe exits 1)."""
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True          # nothing more to write
            raise BrokenPipeError(errno.EPIPE, "the reader of stdout went away")

    width = TABLE_WIDTH
    if sys.stdout.isatty():
        width = max(TABLE_WIDTH, Console(file=sys.stdout).width)
    return PipeConsole(file=sys.stdout, width=width)


def _print_plain(title: str, head: Sequence[str], rows: Sequence[Sequence[str]], left: int) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    _check_width(title, sum(widths) + 2 * (len(widths) - 1))
    print(title)
    for row in [head, *rows]:
        print("  ".join(str(x).ljust(w) if i < left else str(x).rjust(w)
                        for i, (x, w) in enumerate(zip(row, widths))))


def _check_width(title: str, width: int) -> None:
    if width > TABLE_WIDTH and os.environ.get(STRICT_ENV, "") not in ("", "0"):
        raise TableTooWide(f"table {title!r} is {width} columns wide, more than {TABLE_WIDTH}: "
                           "shorten its headings or cells, or move a column that repeats into the title")


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def fmt_size(n: int) -> str:
    """A block size for a table: "64 KiB", "1 MiB", "1.5 MiB", "96 B"."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            x = n / scale
            return f"{x:.4g} {unit}" if x < 1e4 else f"{x:,.0f} {unit}"
    return f"{n} B"


def fmt_float(digits: int) -> Callable[[Any], str]:
    """A number with `digits` decimals and thousands separators."""
    return lambda v: f"{v:,.{digits}f}"
