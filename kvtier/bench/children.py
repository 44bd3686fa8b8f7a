"""The child processes a bench starts (servers, routers, another engine), owned so that no
child outlives the bench, whatever ends it."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import ExitStack
from typing import Any

from kvtier.interrupts import as_interrupts


class Children:
    """The child processes a bench starts, owned for the length of a `with` block: whatever
    ends it (the run's end, an error, a server that does not start, Ctrl-C, SIGTERM) stops
    every child still running: SIGTERM, up to `grace` seconds, then SIGKILL. Inside the block
    SIGTERM (and SIGHUP, a closed terminal) raise KeyboardInterrupt as Ctrl-C does, so the
    bench ends as an interrupted kvtier command does (`kvtier: interrupted`, exit 130), unless
    the signal was set to be ignored (nohup). On Linux each child also gets SIGTERM if the
    bench dies without stopping it (SIGKILL): PR_SET_PDEATHSIG, set by a small trampoline
    before the child's command is exec'd (not preexec_fn: unsafe with threads). That signal
    follows the thread that started the child: start children from the main thread."""

    # PR_SET_PDEATHSIG (1) = SIGTERM, kept across exec; exit at once if the bench is already gone
    _GUARD = ("import os, sys\n"
              "try:\n"
              "    import ctypes; ctypes.CDLL(None).prctl(1, 15)\n"
              "except Exception:\n"
              "    pass\n"
              "if os.getppid() != int(sys.argv[1]):\n"
              "    sys.exit(1)\n"
              "os.execvp(sys.argv[2], sys.argv[2:])")
    def __init__(self, grace: float = 10.0) -> None:
        self.grace = grace              # on the way out after an error or a signal
        self.procs: list[subprocess.Popen] = []
        self._signals: ExitStack | None = None

    def __enter__(self) -> Children:
        self._signals = ExitStack()
        self._signals.enter_context(as_interrupts())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._signals is not None:
                self._signals.close()
                self._signals = None

    def start(self, cmd: list[str], **popen: Any) -> subprocess.Popen:
        """Popen(cmd, **popen), owned from here on."""
        if sys.platform == "linux":
            cmd = [sys.executable, "-c", self._GUARD, str(os.getpid()), *cmd]
        proc = subprocess.Popen(cmd, **popen)
        self.procs.append(proc)
        return proc

    def stop(self, procs: list[subprocess.Popen] | None = None, grace: float | None = None) -> int:
        """Stop `procs` (default: every child still owned): SIGTERM to each (a kvtier server
        drains), up to `grace` seconds (default: the constructor's) for all of them, then
        SIGKILL; Ctrl-C or SIGTERM meanwhile kills them at once. The exit status furthest
        from 0 (a killed child's is negative)."""
        procs = list(self.procs if procs is None else procs)
        deadline = time.monotonic() + (self.grace if grace is None else grace)
        try:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        finally:                        # interrupted too: no child outlives this
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
                if p in self.procs:
                    self.procs.remove(p)
        return max((p.returncode for p in procs), key=abs, default=0)

