"""kvtier.serve.http's bounds on a request's head, on a bare ASGI app (no model): a head past
MAX_HEAD_BYTES gets 431, one not complete within the head deadline gets 408, each request of a
kept-alive connection with its own budget; bodies and streams are not held to them; sockets
past twice the connection limit are closed at accept. A body arriving slower than the
minimum rate gets 408; a client that reads none of its answer is dropped."""
from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httptools")        # the head bounds hook httptools' parser
import uvicorn  # noqa: E402

from kvtier.serve.http import MAX_HEAD_BYTES, uvicorn_config  # noqa: E402


async def app(scope, receive, send) -> None:
    """Reads the whole body; /stream streams 4 ticks 0.4 s apart, anything else answers its
    body's length."""
    if scope["type"] != "http":
        return
    size = 0
    while True:
        event = await receive()
        size += len(event.get("body", b""))
        if not event.get("more_body"):
            break
    if scope["path"] == "/big":                  # 32 MiB in one write, as a big JSON answer is
        big = b"x" * (32 << 20)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(big))]})
        await send({"type": "http.response.body", "body": big})
        return
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for i in range(4):
            await send({"type": "http.response.body", "body": b"tick%d\n" % i, "more_body": True})
            await asyncio.sleep(0.4)
        await send({"type": "http.response.body", "body": b"end\n"})
        return
    body = b"got %d end\n" % size
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def serving(**kw) -> Iterator[tuple[int, uvicorn.Server]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    kw.setdefault("max_connections", 64)
    server = uvicorn.Server(uvicorn_config(app, shutdown_timeout=1, **kw))
    t = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1], server
    finally:
        server.should_exit = True
        t.join(10)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)    # 10 s: a hang's bound


def read_answers(s: socket.socket, count: int = 1, end: bytes = b"end\n") -> bytes:
    """Bytes until `count` answers (each ending in `end`) arrived or the server closed (a reset
    once the server closed on bytes it did not read counts as closed)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while data.count(end) < count:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


def get(port: int) -> bytes:
    with connect(port) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        return read_answers(s)


def send_until_closed(s: socket.socket, pieces: Iterator[bytes], pause: float = 0.0) -> bool:
    """Sends `pieces` until the server answers or closes; whether it did before they ran out."""
    for piece in pieces:
        try:
            s.sendall(piece)
        except OSError:          # closed (reset) under us
            return True
        if select.select([s], [], [], pause)[0]:
            return True
    return False


LINE = b"GET / HTTP/1.1\r\nHost: x\r\n"
HEADER = b"X-Pad: " + b"a" * 1000 + b"\r\n"
HEADS = {   # heads past MAX_HEAD_BYTES, sent in the shapes a client may choose
    "whole, in one send": [LINE + HEADER * (2 * MAX_HEAD_BYTES // len(HEADER)) + b"\r\n"],
    "header by header": [LINE] + [HEADER] * (2 * MAX_HEAD_BYTES // len(HEADER)) + [b"\r\n"],
    "one endless header": [LINE + b"X-Pad: "] + [b"a" * 4096] * (4 * MAX_HEAD_BYTES // 4096),
    "an endless url": [b"GET /"] + [b"a" * 4096] * (4 * MAX_HEAD_BYTES // 4096),
}


@pytest.mark.parametrize("shape", HEADS)
def test_a_head_past_the_cap_gets_431_and_the_server_goes_on(shape):
    with serving() as (port, _):
        with connect(port) as s:
            send_until_closed(s, iter(HEADS[shape]))
            data = read_answers(s)
        assert data.startswith(b"HTTP/1.1 431") and b'"request_header_fields_too_large"' in data
        assert get(port).startswith(b"HTTP/1.1 200")


GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
DRIPS = {   # (a request answered first, the drip: 20 s of it at 0.1 s a piece, a hang's bound)
    "first request": (b"", [LINE] + [b"X-%d: y\r\n" % i for i in range(200)]),
    "kept-alive": (GET, [LINE] + [b"X-%d: y\r\n" % i for i in range(200)]),
    "blank lines": (GET, [b"\r\n"] * 200),     # skipped before a request line: no request begins
}


@pytest.mark.parametrize("drip", DRIPS)
def test_a_dripping_head_is_cut_at_the_head_deadline(drip):
    first, pieces = DRIPS[drip]
    # The drip (a piece every 0.1 s) beats the read deadline (60 s), not the head's (1 s).
    with serving(read_timeout=60, head_timeout=1) as (port, _):
        with connect(port) as s:
            if first:
                s.sendall(first)
                assert read_answers(s).startswith(b"HTTP/1.1 200")
            assert send_until_closed(s, iter(pieces), pause=0.1)
            data = read_answers(s)
    assert data.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in data


def test_a_kept_alive_connection_gets_a_budget_per_request_and_bodies_do_not_count():
    big = b"b" * (4 * MAX_HEAD_BYTES)
    post = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big)
    head = LINE + HEADER * (MAX_HEAD_BYTES // 2 // len(HEADER)) + b"\r\n"    # half the cap: twice is over it
    with serving(read_timeout=5, head_timeout=1) as (port, _):
        with connect(port) as s:
            for request in (head, post, head):
                s.sendall(request)
                assert read_answers(s).startswith(b"HTTP/1.1 200")
            s.sendall(post + head)                       # pipelined: a body, then a head in the same reads
            data = read_answers(s, 2)
    assert data.count(b"HTTP/1.1 200") == 2 and b"got %d end" % len(big) in data


def test_a_stream_longer_than_the_head_deadline_is_not_cut():
    with serving(read_timeout=0.5, head_timeout=0.5) as (port, _):
        with connect(port) as s:
            for _ in range(2):                           # the stream (1.6 s), then the next request
                s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
                data = read_answers(s, end=b"end\n\r\n0\r\n\r\n")    # to the last chunk
                assert data.startswith(b"HTTP/1.1 200") and b"tick3\n" in data
                assert data.endswith(b"end\n\r\n0\r\n\r\n")


def test_sockets_past_twice_the_connection_limit_are_closed_at_accept():
    with serving(max_connections=2, read_timeout=30) as (port, server):
        held = [connect(port) for _ in range(4)]         # twice the limit: kept (503 once they ask)
        try:
            while len(server.server_state.connections) < 4:
                time.sleep(0.01)
            with connect(port) as s:
                assert read_answers(s) == b""            # closed unasked
            assert len(server.server_state.connections) == 4
        finally:
            for s in held:
                s.close()
        while server.server_state.connections:
            time.sleep(0.01)
        assert get(port).startswith(b"HTTP/1.1 200")


def test_a_dripping_body_is_cut_below_the_minimum_rate_and_a_slow_steady_one_is_not(monkeypatch):
    """A byte every 0.1 s beats the read deadline (1 s) for ever: it held the slot as long as
    the client liked. 100 B/s is under the minimum (2,000 B/s here); 5,000 B/s is not."""
    import kvtier.serve.http as http_module
    monkeypatch.setattr(http_module, "BODY_GRACE_S", 0.5)
    size = 12_000
    head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size
    with serving(read_timeout=1, min_body_rate=2000) as (port, _):
        with connect(port) as s:
            s.sendall(head)
            t = time.monotonic()
            assert send_until_closed(s, iter([b"d" * 10] * 200), pause=0.1)      # 20 s of drip at most
            data = read_answers(s)
            assert data.startswith(b"HTTP/1.1 408") and b"arrived slower than" in data, data[:300]
            assert time.monotonic() - t < 6
        with connect(port) as s:                                              # steady: 12 KB in 2.4 s
            s.sendall(head)
            for _ in range(size // 500):
                s.sendall(b"s" * 500)
                time.sleep(0.1)
            assert read_answers(s).startswith(b"HTTP/1.1 200")


def test_a_kept_alive_connections_earlier_body_gives_no_credit_to_the_next(monkeypatch):
    """The rate is per request: a fast first body (200 KB, 100 s of credit at 2,000 B/s if bytes
    were counted per connection) must not let the next request's body drip."""
    import kvtier.serve.http as http_module
    monkeypatch.setattr(http_module, "BODY_GRACE_S", 0.5)
    big, size = 200_000, 12_000
    with serving(read_timeout=1, min_body_rate=2000) as (port, _):
        with connect(port) as s:
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % big + b"f" * big)
            assert read_answers(s).startswith(b"HTTP/1.1 200")
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
            t = time.monotonic()
            assert send_until_closed(s, iter([b"d" * 10] * 200), pause=0.1)      # 20 s of drip at most
            data = read_answers(s)
            assert data.startswith(b"HTTP/1.1 408") and b"arrived slower than" in data, data[:300]
            assert time.monotonic() - t < 6


def test_a_client_that_reads_none_of_its_answer_is_dropped():
    """A 32 MiB answer the client never reads sat in the server's write buffer for as long as
    the connection lived (18 MB a /tokenize answer); it goes once writes waited write_timeout."""
    with serving(read_timeout=0.5, write_timeout=1) as (port, _):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(10)
        s.connect(("127.0.0.1", port))
        with s:
            s.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(3)                                  # reads nothing: dropped meanwhile
            got = 0
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(1 << 20):
                    got += len(chunk)
            assert got < 32 << 20                          # the rest was dropped, and the socket closed
        assert get(port).startswith(b"HTTP/1.1 200")       # and the server serves on
