"""SIGTERM (`kill`, `timeout`) and SIGHUP (a closed terminal) stop a command as Ctrl-C does:
KeyboardInterrupt is raised, so the command's own cleanup runs (temporary folders, a partial
trace file, child processes) and it ends with `kvtier: interrupted`, exit 130. Killed by the
signal's default action instead, `timeout 6 kvtier bench tiers --tier disk` left a 512 MiB
slab in /tmp. A signal set to be ignored (nohup) stays ignored.

`deferred()` holds such an interrupt until a store operation on a persistent tier is done."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

SIGNALS = ("SIGTERM", "SIGHUP")


def _raise(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def as_interrupts() -> Iterator[None]:
    """Within the block (on the main thread), SIGTERM and SIGHUP raise KeyboardInterrupt
    where no handler of their own is set; the handlers before it come back after."""
    saved: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for name in SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
                saved[sig] = signal.signal(sig, _raise)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextmanager
def deferred() -> Iterator[None]:
    """Within the block (on the main thread), a Ctrl-C (or a SIGTERM/SIGHUP that as_interrupts
    turns into one) waits for the block's end: a store's put, flush or close is never cut
    between its index and its bytes. Cut there, a demotion of evicted blocks failed and
    dropped them (blocks of earlier, completed puts lost in 7 of 30 random Ctrl-Cs). A second
    signal within the block raises at once, so a hung write can still be interrupted.

    Only handlers that raise KeyboardInterrupt (Python's own, as_interrupts') are deferred; a
    program's own handlers run as they would. Costs six signal.signal calls (a few us), so
    stores take it only around work that reaches a persistent tier."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def hold(signum: int, _frame: object) -> None:
        if got:
            raise KeyboardInterrupt(signal.Signals(signum).name)
        got.append(signum)

    sigs = [s for s in (getattr(signal, name, None) for name in ("SIGINT", *SIGNALS)) if s is not None]
    saved = {sig: h for sig in sigs if (h := signal.getsignal(sig)) in (signal.default_int_handler, _raise)}
    try:
        _set_all({sig: hold for sig in saved})
        yield
    except BaseException as e:
        if got and not isinstance(e, KeyboardInterrupt):
            raise KeyboardInterrupt(signal.Signals(got[0]).name) from e
        raise
    finally:
        _set_all(saved)
    if got:
        raise KeyboardInterrupt(signal.Signals(got[0]).name)


def _set_all(handlers: dict[int, Any]) -> None:
    """Set every handler of `handlers`, even when a signal raises KeyboardInterrupt midway (one
    arriving while deferred() swapped them left SIGTERM bound to a finished block's `hold`:
    a later SIGTERM swallowed); that interrupt is raised once all are set."""
    pending = list(handlers.items())
    interrupt: BaseException | None = None
    while pending:
        try:
            while pending:
                signal.signal(*pending[0])
                pending.pop(0)        # (raised between the two: that one is set again, no harm)
        except KeyboardInterrupt as e:
            interrupt = interrupt or e
    if interrupt is not None:
        raise interrupt
