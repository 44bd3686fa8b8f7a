"""The HTTP server settings that `kvtier serve` and `kvtier router` share, and the read
deadlines and size bounds uvicorn lacks.

uvicorn closes a kept-alive connection 5 s after its last response, but a connection that
never sends a request, or stops half-way through its headers or body, stays open: 1,024
silent sockets filled `--max-connections` and every other client got 503 until they left.
Here a connection is closed once the client has sent nothing for `read_timeout` seconds
while the server waits on it (before a request is complete); a request being answered (a
long generation, a stream) is never cut by it. Like nginx's client_header_timeout and
client_body_timeout, that deadline is per read, not for the whole request.

A per-read deadline does not stop a client that sends a byte every few seconds, and uvicorn's
httptools protocol puts no bound on a request's head (its request line and headers: 100,000
headers, 11 MB, were taken in one request). So a request's head also has a total deadline
(`head_timeout`, 408) and a size cap (`MAX_HEAD_BYTES`, 431), each request of a kept-alive
connection its own; and uvicorn's connection limit, checked only once a head is complete,
gets a hard bound at accept (sockets past twice the limit are closed at once).

A body has a per-read deadline too, so one dripped a byte every few seconds held its slot for
as long as the client liked (16 such sockets kept every other client at 503 for minutes). So a
body must also arrive at `min_body_rate` bytes a second on average, after a grace of
BODY_GRACE_S (408 otherwise): Kestrel's MinRequestBodyDataRate. And a client that stops
reading its answer (its socket buffer full, the server's write buffer holding the rest: 18 MB
for a /tokenize answer) is dropped once its writes have waited `write_timeout` s: nginx's
send_timeout.
"""
from __future__ import annotations

import asyncio
import http
import importlib.util
import time
from typing import Any

# Seconds a client may stay silent while the server waits for (the rest of) its request.
READ_TIMEOUT_S = 15.0
# Seconds a client has to send a request's whole head, counted from accept (first request) or
# from the end of the previous answer (kept-alive): ample for any real client (headers take
# milliseconds even over slow links), and it frees a slot a slowloris drip would hold forever.
HEAD_TIMEOUT_S = 30.0
# Bytes a request's head may take: nginx reads 4 x 8 KiB, uvicorn's h11 takes 16 KiB; 64 KiB
# leaves room for big cookies or tokens and still bounds each of `--max-connections` sockets.
MAX_HEAD_BYTES = 64 * 1024
# Bytes a second a request body must arrive at, on average, once BODY_GRACE_S have passed
# since its headers: 16 KiB/s is a 128 kbit/s link; a dripping client must send that much to
# hold a slot, and no longer than the body size limit allows.
MIN_BODY_RATE = 16 * 1024
BODY_GRACE_S = 10.0
# Seconds an answer may wait for a client that reads none of it (nginx's send_timeout).
WRITE_TIMEOUT_S = 60.0
# Connections past this multiple of the limit are closed at accept: those up to it still get
# uvicorn's 503 (checked when their head is complete), those past it only cost descriptors.
ACCEPT_FACTOR = 2


def _base_protocol() -> type:
    """uvicorn's httptools protocol where httptools is installed (faster), else its h11 one."""
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    from uvicorn.protocols.http.h11_impl import H11Protocol
    return H11Protocol


def _error_response(status: int, message: str, code: str) -> bytes:
    """A whole error response with the API's JSON error body, closing the connection (written
    straight to the socket: no app answers it)."""
    import orjson

    from kvtier.serve.protocol import ApiError

    body = orjson.dumps(ApiError(status, message, code=code).body())
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status, http.HTTPStatus(status).phrase.encode(), len(body), body))


class _HeadTooLarge(Exception):
    """Raised in a parser callback to stop parsing a head past MAX_HEAD_BYTES."""


def deadline_protocol(read_timeout: float = READ_TIMEOUT_S, head_timeout: float = HEAD_TIMEOUT_S,
                      min_body_rate: float = MIN_BODY_RATE, write_timeout: float = WRITE_TIMEOUT_S) -> type:
    """A uvicorn HTTP protocol class that closes a connection silent for `read_timeout` s
    while no complete request of it is being answered, one whose request head is not complete
    `head_timeout` s after the server began waiting for it (408), or past MAX_HEAD_BYTES (431),
    one whose body arrives slower than `min_body_rate` bytes/s after BODY_GRACE_S (408), one
    whose answer has waited `write_timeout` s for the client to read, and connections
    accepted past ACCEPT_FACTOR times the server's connection limit."""
    base: Any = _base_protocol()
    # The head bounds hook httptools' parser callbacks; h11 bounds a head itself (16 KiB) and
    # calls none of them, so under it they stay off (_head_since stays None).
    bounds_heads = base.__name__ == "HttpToolsProtocol"

    class DeadlineProtocol(base):
        def connection_made(self, transport: asyncio.Transport) -> None:   # type: ignore[override]
            super().connection_made(transport)
            self._last_read = time.monotonic()
            # When the server began waiting for the head now due (None: none is due, its
            # headers came), and the bytes counted against MAX_HEAD_BYTES: those httptools
            # handed to uvicorn (url, headers: exact), and whole reads that came while the head
            # was unfinished, which bound what httptools buffers of a header not yet complete.
            self._head_since: float | None = self._last_read if bounds_heads else None
            self._head_fields = self._head_reads = 0
            self._head_too_large = False
            # The request whose body is arriving (its cycle), since when, and the bytes read
            # since then: the body rate is per request (a kept-alive connection's earlier
            # request and the time it was answered in are no part of it). `_headers_at`: when
            # the last head completed (httptools tells; h11 does not: its clock starts at the
            # first deadline check that finds the body arriving). When writes began waiting
            # for the client to read.
            self._body_cycle: Any = None
            self._body_paused = False
            self._body_since = 0.0
            self._body_bytes = 0
            self._headers_at: float | None = None
            self._write_paused_since: float | None = None
            self._deadline = self.loop.call_later(min(read_timeout, head_timeout), self._check_deadline)
            limit = self.limit_concurrency
            if limit is not None and len(self.connections) > ACCEPT_FACTOR * limit:
                transport.close()    # unanswered: a 503 would mean reading its request first

        def data_received(self, data: bytes) -> None:
            self._last_read = time.monotonic()
            self._body_bytes += len(data)        # (zeroed when a head completes in this read)
            if self._head_since is not None:
                self._head_reads += len(data)    # zeroed again if the head completes in this read
            super().data_received(data)
            if (self._head_since is not None and self._head_reads > MAX_HEAD_BYTES
                    and not self.transport.is_closing()):
                self._reject_too_large()

        def connection_lost(self, exc: Exception | None) -> None:
            self._deadline.cancel()
            super().connection_lost(exc)

        def pause_writing(self) -> None:      # the transport's buffer is full: the client is not reading
            if self._write_paused_since is None:
                self._write_paused_since = time.monotonic()
            super().pause_writing()

        def resume_writing(self) -> None:
            self._write_paused_since = None
            super().resume_writing()

        # httptools parser callbacks (uvicorn's, extended): a head runs from the end of the
        # previous message (or accept) to on_headers_complete.
        def on_message_begin(self) -> None:
            self._head_fields = 0            # uvicorn starts a new url and header list
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count_head_field(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_head_field(len(name) + len(value) + 4)    # ": " and CRLF
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._headers_at = time.monotonic()   # the body's clock starts here
            self._body_bytes = 0
            self._head_since = None
            self._head_reads = 0
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._head_since = time.monotonic()      # what comes next is the next request's head
            self._head_reads = 0
            super().on_message_complete()

        def _count_head_field(self, size: int) -> None:
            self._head_fields += size
            if self._head_fields > MAX_HEAD_BYTES:
                self._head_too_large = True
                raise _HeadTooLarge     # httptools stops; uvicorn answers it with send_400_response

        def send_400_response(self, msg: str) -> None:
            if self._head_too_large:
                self._reject_too_large()
            else:
                super().send_400_response(msg)

        def on_response_complete(self) -> None:
            self._last_read = time.monotonic()     # idle from here: the client's next request may come
            if self._head_since is not None:
                self._head_since = self._last_read     # and the next head's clock starts again
            super().on_response_complete()

        def _reject_too_large(self) -> None:
            self._reject(431, f"the request headers exceed {MAX_HEAD_BYTES} bytes", "request_header_fields_too_large")

        def _reject(self, status: int, message: str, code: str) -> None:
            """Answer `status` unless an answer is under way on this connection (a pipelined
            head), then close."""
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                self.transport.write(_error_response(status, message, code))
            self.transport.close()

        def _waiting_on_client(self) -> bool:
            """Whether the server is waiting for the client's bytes: not while it answers a
            request read whole (or the client has yet to read the answer), not while a
            pipelined request waits behind another's answer, not while it paused reading
            itself (flow control)."""
            if self.flow.read_paused or getattr(self, "pipeline", None) or self._write_paused_since is not None:
                return False
            cycle = self.cycle
            return cycle is None or cycle.response_complete or cycle.more_body

        def _check_deadline(self) -> None:
            now = time.monotonic()
            write_left = write_timeout
            if (self._write_paused_since is None and self.transport.is_closing()
                    and self.transport.get_write_buffer_size()):
                self._write_paused_since = now     # closed with the end of its answer unread
            if self._write_paused_since is not None:
                write_left -= now - self._write_paused_since
                if write_left <= 0:
                    self.transport.abort()   # close() waits to send what the client does not read
                    return
            if self.transport.is_closing():
                if self._write_paused_since is not None:
                    self._deadline = self.loop.call_later(write_left, self._check_deadline)
                return
            waiting = self._waiting_on_client()
            if not waiting:
                self._last_read = now      # the silence counts from when it waits again,
                if self._head_since is not None:
                    self._head_since = now     # and so does the time a pipelined head takes
            cycle = self.cycle
            in_body = waiting and cycle is not None and cycle.more_body and not cycle.response_started
            body_left = read_timeout
            if not in_body:
                if cycle is not self._body_cycle or cycle is None:
                    self._body_cycle = None
                elif cycle.more_body:
                    self._body_paused = True     # the server paused reading: its count restarts after
            elif cycle is not self._body_cycle or self._body_paused:
                new, self._body_cycle, self._body_paused = cycle is not self._body_cycle, cycle, False
                if new and self._headers_at is not None:
                    self._body_since = self._headers_at          # its head's end (httptools)
                else:
                    self._body_since, self._body_bytes = now, 0  # h11, or after a pause: from here
            if in_body:
                body_left = self._body_since + BODY_GRACE_S + self._body_bytes / min_body_rate - now
                if body_left <= 0:
                    self.transport.write(_error_response(
                        408, f"the request body arrived slower than {min_body_rate / 1024:g} KiB/s",
                        "request_timeout"))
                    self.transport.close()
                    return
            silent = now - self._last_read
            if silent >= read_timeout:
                if in_body:            # its headers came, its body stalled
                    self.transport.write(_error_response(
                        408, f"the request body stalled: nothing arrived for {read_timeout:g} s",
                        "request_timeout"))
                self.transport.close()       # an app reading the body sees a disconnect
                return
            # Wake again by the next deadline; with no head due, within head_timeout all the
            # same, as the next one may be due from any moment (a message completes).
            head_left = head_timeout
            if self._head_since is not None:
                head_left -= now - self._head_since
                if head_left <= 0:
                    self._reject(408, f"the request headers took longer than {head_timeout:g} s",
                                 "request_timeout")
                    return
            self._deadline = self.loop.call_later(min(read_timeout - silent, head_left, max(body_left, 0.05),
                                                      write_left), self._check_deadline)

    return DeadlineProtocol


def uvicorn_config(app: Any, *, max_connections: int, shutdown_timeout: float,
                   read_timeout: float = READ_TIMEOUT_S, head_timeout: float = HEAD_TIMEOUT_S,
                   min_body_rate: float = MIN_BODY_RATE, write_timeout: float = WRITE_TIMEOUT_S) -> Any:
    """The uvicorn.Config of a kvtier HTTP server: at most `max_connections` connections
    (uvicorn answers 503 past it, and closes at once those past twice it), kept-alive ones
    closed 5 s after their last answer, silent clients after `read_timeout` s, request heads
    due within `head_timeout` s and MAX_HEAD_BYTES, bodies at `min_body_rate` bytes/s, clients
    that read nothing of an answer for `write_timeout` s dropped, no access log, uvicorn's own
    logging quiet.
    Raises the process's open-files limit to its hard limit, as a node does: each client (and,
    for the router, each connection to a worker) is a descriptor, and the usual soft limit of
    1,024 is below `--max-connections` in and out."""
    import uvicorn

    from kvtier.net.accept import raise_open_files_limit

    raise_open_files_limit()
    return uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                          http=deadline_protocol(read_timeout, head_timeout, min_body_rate, write_timeout),
                          limit_concurrency=max_connections,
                          timeout_keep_alive=5, timeout_graceful_shutdown=shutdown_timeout)
