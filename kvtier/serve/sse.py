"""The ASGI pieces under the routes: JSON and SSE responses, bounded bodies, disconnects,
and the session-affinity header echoed on every response to a request that carried it.

Written against ASGI directly (not Starlette's StreamingResponse) so that a client going
away is noticed the same way on every server version: a task waits for `http.disconnect`
while the stream runs and cancels it; then `on_close` aborts the request.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from kvtier.serve.protocol import ApiError

log = logging.getLogger("kvtier.serve")
AFFINITY = "x-session-affinity"
MAX_SESSION_ID = 256
_AFFINITY_B = AFFINITY.encode()
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected while its answer was being made: the work was cancelled and
    the answer goes nowhere (answered 499, nothing logged)."""


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


class JSON(Response):
    """A JSON body serialized with orjson."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


def error_response(e: ApiError) -> JSON:
    return JSON(e.body(), status_code=e.status)


async def on_api_error(_request: Request, e: Exception) -> Response:
    """Starlette exception handler for ApiError: its JSON error response."""
    assert isinstance(e, ApiError)
    return error_response(e)


_V1_ROUTES = ("/completions", "/chat/completions", "/models")


async def on_http_error(request: Request, e: Exception) -> Response:
    """Starlette's own errors (no route, wrong method, too large) as the API's JSON errors."""
    assert isinstance(e, HTTPException)
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    path = request.url.path.rstrip("/")
    no_route = ("no such route: the API is under /v1 (an OpenAI client's base_url ends in /v1, e.g. "
                "http://HOST:PORT/v1)" if path in _V1_ROUTES or path.startswith("/models/") else
                "no such route: see docs/serve.md for the API")
    message = {404: no_route, 405: "this method is not allowed on this route"}.get(e.status_code, str(e.detail))
    resp = error_response(ApiError(e.status_code, message, code=codes.get(e.status_code)))
    if e.headers:
        resp.headers.update(e.headers)
    return resp


async def on_answer_unwanted(_request: Request, _e: Exception) -> Response:
    """ClientGone: nobody reads this answer; nginx's 499 "client closed request"."""
    return Response(status_code=499)


async def on_client_gone(_request: Request, _e: Exception) -> Response:
    """The client went away before its whole request arrived (or went silent: kvtier.serve.http):
    not the server's error, so nothing is logged; the answer goes nowhere."""
    log.debug("a client disconnected before sending its whole request")
    return error_response(ApiError(400, "the client disconnected before sending its whole request",
                                   code="client_disconnected"))


# The exception handlers of every kvtier HTTP app (kvtier serve, kvtier router); anything
# else is a bug, answered by CrashGuard.
EXCEPTION_HANDLERS = {ApiError: on_api_error, HTTPException: on_http_error, ClientDisconnect: on_client_gone,
                      ClientGone: on_answer_unwanted}
MAX_TRACEBACKS = 64      # distinct crash sites whose traceback is logged (then one line each)


class CrashGuard:
    """ASGI middleware: a bug in a route is answered as one 500 JSON error and logged, its
    traceback once per crash site. (Starlette's handler for `Exception` answers and then
    re-raises, so the server logged a whole traceback per request: a log flood if a crash
    were ever reachable from outside.) An answer already under way is cut off."""

    def __init__(self, app: Callable) -> None:
        self.app = app
        self.sites: set[tuple[str, str, int]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as e:
            tb = e.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            site = (type(e).__name__, tb.tb_frame.f_code.co_filename if tb else "", tb.tb_lineno if tb else 0)
            first = site not in self.sites and len(self.sites) < MAX_TRACEBACKS
            if first:
                self.sites.add(site)
            log.error("internal error on %s %s: %s: %s%s", scope.get("method"), scope.get("path"), type(e).__name__,
                      e, "" if first else " (its traceback is logged once)", exc_info=e if first else None)
            if not started:
                await error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}",
                                              code="internal_error"))(scope, receive, send)


def http_app(routes: list) -> Callable:
    """The ASGI app of kvtier serve and kvtier router: the routes, the API's JSON errors, bugs
    answered as 500s (CrashGuard), and the affinity header echoed (EchoAffinity)."""
    return EchoAffinity(Starlette(routes=routes, middleware=[Middleware(CrashGuard)],
                                  exception_handlers=EXCEPTION_HANDLERS))


def sse_event(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def check_json_type(request: Request) -> None:
    """415 unless the body is declared JSON (`application/json`, any parameters): a web page
    can POST text/plain, form-encoded or untyped bodies to a local server without a CORS
    preflight, and must not be able to start generations that way (vLLM refuses them too)."""
    ctype = request.headers.get("content-type")
    if (ctype or "").split(";", 1)[0].strip().lower() != "application/json":
        got = f"got {ctype!r}" if ctype is not None else "got none"
        raise ApiError(415, f"the request body must be sent with Content-Type: application/json ({got}); "
                            "with curl: -H 'Content-Type: application/json'", param="content-type",
                       code="unsupported_media_type")


async def read_body(request: Request, limit: int, who: str = "server") -> bytes:
    """The raw JSON body: 415 unless declared JSON, 413 past `limit` bytes (checked before and
    while reading); `who` names the taker."""
    check_json_type(request)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is {length} bytes; this {who} takes at most {limit}",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


ORJSON_MAX_DEPTH = 255  # the deepest nesting orjson.dumps writes (it reads 1,024)
# The deepest body taken: the router wraps a body once for its prefill worker
MAX_JSON_DEPTH = ORJSON_MAX_DEPTH - 1


async def read_json(request: Request, limit: int, who: str = "server", depth: int = MAX_JSON_DEPTH) -> Any:
    """The body as JSON: 413 past `limit` bytes (checked before and while reading), 400 if not JSON."""
    raw = await read_body(request, limit, who)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    # What cannot be written back is refused here: orjson reads 1,024 levels of nesting but
    # writes 255, and the router writes bodies back (wrapped once); a deeper one was a 500
    # there. Speed: counting brackets is a C scan; only a body with that many is encoded
    # (inside lists up to orjson's 255 levels) to find out.
    if raw.count(b"[") + raw.count(b"{") > depth:
        probe = body
        for _ in range(ORJSON_MAX_DEPTH - depth):
            probe = [probe]
        try:
            orjson.dumps(probe)
        except orjson.JSONEncodeError:
            raise ApiError(400, f"the request body nests deeper than {depth} levels", code="invalid_json") from None
    return body


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (call after the body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_gone(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (so whatever it
    awaits, a worker's answer or the engine's tokens, is given up and its `finally` runs) and
    ClientGone is raised. Call after the body was read: until the answer starts, this is how
    a non-streamed answer (or a stream not yet started) notices that nobody waits for it."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class EventStream:
    """An SSE response from an async iterator of ready-made event bytes; stops the iterator
    (so its `finally` runs) when the client disconnects."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None] | None = None) -> None:
        self.events = events
        self.on_close = on_close       # runs once the stream ended, however it ended
        self.headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})

        async def pump() -> None:
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        streaming = asyncio.ensure_future(pump())
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({streaming, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, gone):
                task.cancel()
            await asyncio.gather(streaming, gone, return_exceptions=True)
            try:
                aclose = getattr(self.events, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()
        if streaming.done() and not streaming.cancelled() and streaming.exception() is not None:
            raise streaming.exception()       # type: ignore[misc]


class EchoAffinity:
    """ASGI middleware: a request's x-session-affinity header comes back on its response,
    whatever answers it (a route, a 404, a 405, an error)."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        value = next((v for k, v in scope.get("headers", []) if k == _AFFINITY_B), None)
        if value is None or not valid_session(value.decode("latin-1").strip()):   # (a refused one is not echoed)
            return await self.app(scope, receive, send)

        async def send_echo(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != _AFFINITY_B]
                message = {**message, "headers": [*headers, (_AFFINITY_B, value)]}
            await send(message)

        await self.app(scope, receive, send_echo)


def valid_session(value: str) -> bool:
    """Whether a (stripped) x-session-affinity value is an id this server takes."""
    return bool(value) and len(value) <= MAX_SESSION_ID and value.isprintable()


def session_of(request: Request) -> str | None:
    """The request's x-session-affinity id, None without one; a 400 unless it is printable and
    1 to MAX_SESSION_ID characters (servers and the router keep one entry per id)."""
    value = request.headers.get(AFFINITY)
    if value is None:
        return None
    value = value.strip()
    if not valid_session(value):
        raise ApiError(400, f"{AFFINITY} must be a printable id of 1 to {MAX_SESSION_ID} characters",
                       param=AFFINITY, code="invalid_value")
    return value
