"""Progress of long work (replays, benchmarks, prefaulting a large tier) for a person
watching a terminal.

Shown on stderr only when stderr is a terminal and the caller is not printing JSON, so
piped and `--json` output stay clean. Without rich installed it prints nothing.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator


class Progress:
    """One task's progress: advance() by units of work, describe() what is being done."""

    def __init__(self, bar: object | None = None, task: object | None = None) -> None:
        self._bar = bar
        self._task = task

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def advance(self, units: float = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, units)

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)


def wanted(json_output: bool = False) -> bool:
    """Whether a person is watching: stderr is a terminal and the output is not JSON."""
    return not json_output and sys.stderr.isatty()


@contextmanager
def progress(description: str, total: float | None = None, enabled: bool = True) -> Iterator[Progress]:
    """A progress bar on stderr for `total` units of work (a spinner when total is None);
    a silent stand-in when disabled, not on a terminal, or rich is missing."""
    if not (enabled and sys.stderr.isatty()):
        yield Progress()
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress as RichProgress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:
        yield Progress()
        return
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TimeElapsedColumn()] if total is not None else [SpinnerColumn(), TextColumn("{task.description}"),
                                                             TimeElapsedColumn()]
    global _console
    if _console is None:
        _console = Console(stderr=True)
    # One console for every bar: a bar started inside another (a host tier prefaulting while
    # a model loads) stacks under it instead of fighting over the same line. Lines printed
    # to a terminal stdout meanwhile go above the bars; piped stdout is left alone.
    with RichProgress(*columns, console=_console, transient=True, redirect_stdout=sys.stdout.isatty()) as bar:
        yield Progress(bar, bar.add_task(description, total=total))


_console = None    # rich's Console on stderr, made on first use


def detach_stdout() -> None:
    """Point stdout at /dev/null: its reader went away, and the next write or the interpreter's
    final flush must not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def say(text: str) -> None:
    """One status line on stdout (a server's listening, ready, draining, stopped). A reader
    that went away (a closed pipe, a gone terminal) must not stop a server mid-shutdown: the
    line is dropped and stdout detached."""
    try:
        print(text, flush=True)
    except (OSError, ValueError):
        detach_stdout()
