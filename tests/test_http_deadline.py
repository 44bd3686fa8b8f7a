"""kvtier.serve.http's read deadline on a bare ASGI app (no model): silent clients are cut,
answers are not, whether long, pipelined behind another, or followed by a kept-alive request."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

pytest.importorskip("uvicorn")
import uvicorn  # noqa: E402

from kvtier.serve.http import uvicorn_config  # noqa: E402

TIMEOUT = 0.5        # the read deadline under test


async def app(scope, receive, send) -> None:
    """Reads the whole body, then streams 4 ticks 0.3 s apart (1.2 s: past the deadline)."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for i in range(4):
        await send({"type": "http.response.body", "body": b"tick%d\n" % i, "more_body": True})
        await asyncio.sleep(0.3)
    await send({"type": "http.response.body", "body": b"end\n"})


@pytest.fixture(scope="module")
def port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = uvicorn.Server(uvicorn_config(app, max_connections=64, shutdown_timeout=1, read_timeout=TIMEOUT))
    t = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    t.join(10)


def read_until(s: socket.socket, count: int) -> bytes:
    """Bytes until `count` complete answers ("end\\n" each) arrived or the server closed."""
    data = b""
    while data.count(b"end\n") < count:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_a_silent_connection_is_closed_after_the_deadline(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        assert s.recv(10) == b""
        assert time.monotonic() - t0 > TIMEOUT * 0.9      # not before the deadline (a hang: the socket's timeout)


def test_a_long_answer_and_a_pipelined_request_behind_it_are_not_cut(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)
        s.sendall(b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n")   # waits behind /a
        time.sleep(0.1)
        s.sendall(b"abcd")                # its body, long before /a's answer ends
        data = read_until(s, 2)
    assert data.count(b"HTTP/1.1 200") == 2 and data.count(b"end\n") == 2 and b"408" not in data


def test_a_kept_alive_connection_counts_its_silence_from_the_last_answer(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for _ in range(2):                # each answer outlasts the deadline; the next request follows it
            s.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_until(s, 1).count(b"end\n") == 1
            time.sleep(TIMEOUT / 3)


def test_a_stalled_body_gets_408(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    assert data.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in data
