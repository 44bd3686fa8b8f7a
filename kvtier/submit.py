"""Hand work to a thread pool, even at interpreter exit.

Python shuts every thread pool down (and a pool that ever ran work then refuses with
"cannot schedule new futures after shutdown") before atexit hooks run, and a store closed
at exit must still get its blocks to their tiers: there the work runs on the calling thread.
"""
from __future__ import annotations

from concurrent.futures import Executor, Future
from typing import Callable


def submit(pool: Executor, fn: Callable[..., object], *args: object) -> Future:
    """pool.submit(fn, *args), or fn run here when the pool was shut down."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:        # the pool was shut down: only the interpreter's exit does that
        f: Future = Future()
        try:
            f.set_result(fn(*args))
        except BaseException as e:
            f.set_exception(e)
        return f

