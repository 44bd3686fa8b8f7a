"""Shared pieces of the benchmarks: timing and printing rows as JSON lines or a table."""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Callable, Sequence


def quiet_threads() -> None:
    """One torch thread: on a small machine two busy threads fight and timings lie."""
    import torch
    torch.set_num_threads(1)


def timeit(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    """Median seconds of `repeat` calls of fn after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timeit_pair(a: Callable[[], object], b: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Median seconds of a() and of b(), alternating them, so both see the same conditions
    (a virtual disk's speed drifts from second to second)."""
    a()
    b()
    ta, tb = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return statistics.median(ta), statistics.median(tb)


def emit(rows: Sequence[dict[str, Any]], as_json: bool, title: str, columns: Sequence[str]) -> None:
    """Print rows as one JSON object per line, or as a table for a person."""
    if as_json:
        for r in rows:
            print(json.dumps(r), flush=True)
        return
    print_table(title, columns, [[_fmt(r.get(c)) for c in columns] for r in rows])


def print_table(title: str, head: Sequence[str], rows: Sequence[Sequence[str]], left: int = 0) -> None:
    """A table for a person: rich when installed, plain columns otherwise. The first
    `left` columns are left-aligned (names), the rest right-aligned (numbers)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        print(title)
        for row in [head, *rows]:
            print("  ".join(str(x).ljust(w) if i < left else str(x).rjust(w)
                            for i, (x, w) in enumerate(zip(row, widths))))
        return
    table = Table(title=title)
    for i, h in enumerate(head):
        table.add_column(h, justify="left" if i < left else "right")
    for row in rows:
        table.add_row(*row)
    # Piped output has no terminal width: don't squeeze the table into 80 columns.
    Console(file=sys.stdout, width=None if sys.stdout.isatty() else 200).print(table)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
