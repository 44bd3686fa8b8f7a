"""SIGTERM (`kill`, `timeout`) and SIGHUP (a closed terminal) stop a command as Ctrl-C does:
KeyboardInterrupt is raised, so the command's own cleanup runs (temporary folders, a partial
trace file, child processes) and it ends with `kvtier: interrupted`, exit 130. Killed by the
signal's default action instead, `timeout 6 kvtier bench tiers --tier disk` left a 512 MiB
slab in /tmp. A signal set to be ignored (nohup) stays ignored."""
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
