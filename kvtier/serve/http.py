"""The HTTP server settings that `kvtier serve` and `kvtier router` share, and a read deadline
uvicorn lacks.

uvicorn closes a kept-alive connection 5 s after its last response, but a connection that
never sends a request, or stops half-way through its headers or body, stays open: 1,024
silent sockets filled `--max-connections` and every other client got 503 until they left.
Here a connection is closed once the client has sent nothing for `read_timeout` seconds
while the server waits on it (before a request is complete); a request being answered (a
long generation, a stream) is never cut by it. Like nginx's client_header_timeout and
client_body_timeout, the deadline is per read, not for the whole request.
"""
from __future__ import annotations

import asyncio
import importlib.util
import time
from typing import Any

# Seconds a client may stay silent while the server waits for (the rest of) its request.
READ_TIMEOUT_S = 15.0


def _base_protocol() -> type:
    """uvicorn's httptools protocol where httptools is installed (faster), else its h11 one."""
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    from uvicorn.protocols.http.h11_impl import H11Protocol
    return H11Protocol


def _timed_out(read_timeout: float) -> bytes:
    """A whole 408 response with the API's JSON error body (written straight to the socket:
    the app is still waiting for the body)."""
    import orjson

    from kvtier.serve.protocol import ApiError

    body = orjson.dumps(ApiError(408, f"the request body stalled: nothing arrived for {read_timeout:g} s",
                                 code="request_timeout").body())
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


def deadline_protocol(read_timeout: float = READ_TIMEOUT_S) -> type:
    """A uvicorn HTTP protocol class that closes a connection silent for `read_timeout` s
    while no complete request of it is being answered."""
    base: Any = _base_protocol()

    class DeadlineProtocol(base):
        def connection_made(self, transport: asyncio.Transport) -> None:   # type: ignore[override]
            super().connection_made(transport)
            self._last_read = time.monotonic()
            self._deadline = self.loop.call_later(read_timeout, self._check_deadline)

        def data_received(self, data: bytes) -> None:
            self._last_read = time.monotonic()
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self._deadline.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            self._last_read = time.monotonic()     # idle from here: the client's next request may come
            super().on_response_complete()

        def _waiting_on_client(self) -> bool:
            """Whether the server is waiting for the client's bytes: not while it answers a
            request read whole, not while a pipelined request waits behind another's answer,
            not while it paused reading itself (flow control)."""
            if self.flow.read_paused or getattr(self, "pipeline", None):
                return False
            cycle = self.cycle
            return cycle is None or cycle.response_complete or cycle.more_body

        def _check_deadline(self) -> None:
            if self.transport.is_closing():
                return
            if not self._waiting_on_client():
                self._last_read = time.monotonic()  # the silence counts from when it waits again
            silent = time.monotonic() - self._last_read
            if silent >= read_timeout:
                cycle = self.cycle
                if cycle is not None and cycle.more_body and not cycle.response_started:
                    self.transport.write(_timed_out(read_timeout))     # its headers came, its body stalled
                self.transport.close()       # an app reading the body sees a disconnect
                return
            wait = read_timeout - silent if silent < read_timeout else read_timeout
            self._deadline = self.loop.call_later(wait, self._check_deadline)

    return DeadlineProtocol


def uvicorn_config(app: Any, *, max_connections: int, shutdown_timeout: float,
                   read_timeout: float = READ_TIMEOUT_S) -> Any:
    """The uvicorn.Config of a kvtier HTTP server: at most `max_connections` connections
    (uvicorn answers 503 past it), kept-alive ones closed 5 s after their last answer, silent
    clients after `read_timeout` s, no access log, uvicorn's own logging quiet."""
    import uvicorn

    return uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                          http=deadline_protocol(read_timeout), limit_concurrency=max_connections,
                          timeout_keep_alive=5, timeout_graceful_shutdown=shutdown_timeout)
