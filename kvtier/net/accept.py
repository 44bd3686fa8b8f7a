"""Accepting TCP connections in a way no burst of clients can stop.

`accept()` fails when the process is out of file descriptors (EMFILE), the system is
(ENFILE) or the kernel is short of memory (ENOBUFS, ENOMEM), and for a connection reset
before it was accepted (ECONNABORTED). None of these ends the loop: it backs off briefly
(10 ms doubling to 0.5 s, while the failures last), logs once per burst and goes on; the
pending connections wait in the listen backlog meanwhile. A node also raises its soft
open-files limit to the hard limit at start (`raise_open_files_limit`).
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable

BACKOFF_S = (0.01, 0.5)         # first and longest pause after a failed accept


async def accept_forever(srv: socket.socket, on_conn: Callable[[socket.socket], None],
                         log: logging.Logger, name: str) -> None:
    """Hand each accepted (non-blocking) socket to on_conn until cancelled."""
    loop = asyncio.get_running_loop()
    pause, failures = 0.0, 0
    while True:
        try:
            conn, _ = await loop.sock_accept(srv)
        except OSError as e:
            if failures == 0:
                log.warning("%s: accept failed (%s): backing off and retrying; raise the open-files limit "
                            "(ulimit -n) or lower NodeLimits.max_connections if this repeats", name,
                            e.strerror or e)
            failures += 1
            pause = min(BACKOFF_S[1], max(BACKOFF_S[0], pause * 2))
            await asyncio.sleep(pause)
            continue
        if failures:
            log.warning("%s: accepting again after %d failed accepts", name, failures)
            pause, failures = 0.0, 0
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:         # reset by the peer already
            conn.close()
            continue
        on_conn(conn)


def raise_open_files_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (each peer is a file descriptor);
    returns the soft limit now in force (0 where the platform has none)."""
    try:
        import resource
    except ImportError:      # not a POSIX system
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (OSError, ValueError):    # e.g. above the kernel's nr_open: keep what there is
            pass
    return soft
