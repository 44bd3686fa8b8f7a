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


def emit(rows: Sequence[dict[str, Any]], as_json: bool, title: str, columns: Sequence[str]) -> None:
    """Print rows as one JSON object per line, or as a table for a person."""
    if as_json:
        for r in rows:
            print(json.dumps(r), flush=True)
        return
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print("  ".join(columns))
        for r in rows:
            print("  ".join(_fmt(r.get(c)) for c in columns))
        return
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*(_fmt(r.get(c)) for c in columns))
    Console(file=sys.stdout).print(table)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
