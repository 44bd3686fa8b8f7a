"""The engine in its own thread: requests in through a command queue, tokens out per request.

The HTTP front end is asyncio; the engine's step is seconds of blocking compute at worst.
So one thread owns the LLM (nothing else touches it: no locks around the engine) and runs

    take commands (add, abort, fail all) -> llm.step() -> each request's new tokens

and hands each request's events to its `deliver` callback, which the front end makes
thread-safe (loop.call_soon_threadsafe into the request's asyncio queue): one call per
request per step. Continuous batching is the engine's own: every step runs whatever the
scheduler admits. An abort (a client that went away) frees the request's pages before
the next step; a failure inside a step fails the requests it belongs to, not the server.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Union

from kvtier.engine.request import Status
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError
from kvtier.serve.protocol import sampling_param

log = logging.getLogger("kvtier.serve")


@dataclass
class Tokens:
    """New tokens of a request, in order."""
    ids: list[int]


@dataclass
class Finished:
    """The request ended; `cached_by_tier` is prompt tokens loaded from each tier."""
    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_by_tier: dict[str, int]


@dataclass
class Failed:
    """The request cannot go on; answered as an OpenAI error with this status."""
    status: int
    message: str
    code: str
    param: str | None = None           # the request's field it blames, where one is to blame


Event = Union[Tokens, Finished, Failed]


@dataclass
class Submission:
    """One request for the engine thread. `deliver` runs on that thread."""
    id: str
    prompt: list[int]
    params: SamplingParams
    session: str | None
    deliver: Callable[[list[Event]], None]
    arrival: float = field(default_factory=time.perf_counter)


class Observer(Protocol):
    """What the loop reports to metrics (metrics.py implements it)."""

    def first_token(self, seconds: float) -> None: ...
    def token_gap(self, seconds: float) -> None: ...
    def finished(self, seconds: float, prompt_tokens: int, cached_by_tier: dict[str, int]) -> None: ...


@dataclass
class _Live:
    sub: Submission
    engine_id: str
    sent: int = 0
    last: float | None = None


class EngineLoop:
    """Owns the LLM that `make_llm` builds (on the loop's thread, so loading does not block
    the HTTP server: /health says 503 until `ready`)."""

    def __init__(self, make_llm: Callable[[], Any], observer: Observer | None = None,
                 before_close: Callable[[], Any] | None = None) -> None:
        self._make_llm = make_llm
        self._before_close = before_close     # e.g. stop serving the store to peers
        self._observer = observer
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[str, _Live] = {}
        self._queued = 0
        self._count_lock = threading.Lock()
        self._stopping = False
        self.llm: Any = None
        self.error: BaseException | None = None       # why the model did not load
        self.ready = threading.Event()                # set when the model loaded (or failed to)
        self.closed = threading.Event()               # set when the store is flushed and closed
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)

    # -- any thread ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, sub: Submission) -> None:
        with self._count_lock:
            self._queued += 1
        self._send("add", sub)

    def abort(self, request_id: str) -> None:
        """Drop a request (its client went away); its pages are freed before the next step."""
        self._send("abort", request_id)

    def fail_all(self, message: str) -> None:
        """End every request in flight with a 503 `message` (the shutdown deadline passed)."""
        self._send("fail_all", message)

    def stop(self, timeout: float | None = None) -> None:
        """Fail what is left, flush and close the store, end the thread."""
        self._stopping = True
        self._send("stop", None)
        self._thread.join(timeout)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests, for metrics; waiting includes those not yet taken in."""
        llm = self.llm
        if llm is None:
            return 0, self._queued
        s = llm.scheduler
        return len(s.running), len(s.waiting) + self._queued

    def _send(self, kind: str, arg: Any) -> None:
        self._commands.put((kind, arg))
        self._wake.set()

    # -- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.llm = self._make_llm()
        except BaseException as e:     # reported by the front end, which exits
            self.error = e
            self.ready.set()
            self._drain_rejecting("the model failed to load")
            self.closed.set()
            return
        self.ready.set()
        try:
            while True:
                self._wake.clear()
                self._take_commands()
                if self._stopping:
                    break
                if not self._live:
                    self._wake.wait()
                    continue
                try:
                    finished = self.llm.step()
                except Exception as e:      # noqa: BLE001 - the server survives a failed step
                    self._step_failed(e)
                    continue
                self._emit(finished)
        finally:
            self._fail_live(503, "the server stopped before this request finished", "shutting_down")
            self._drain_rejecting("the server is shutting down")
            try:
                if self._before_close is not None:
                    self._before_close()
                self.llm.close()            # flushes the store's blocks down to disk, releases the tiers
            finally:
                self.closed.set()

    def _queued_commands(self) -> Iterator[tuple[str, Any]]:
        """The commands sent so far, until the queue is empty; each "add" taken leaves the queued count."""
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                with self._count_lock:
                    self._queued -= 1
            yield kind, arg

    def _take_commands(self) -> None:
        for kind, arg in self._queued_commands():
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                live = self._live.pop(arg, None)
                if live is not None:
                    self.llm.abort(live.engine_id)
            elif kind == "fail_all":
                self._fail_live(503, arg, "shutting_down")
            elif kind == "stop":
                self._stopping = True

    def _add(self, sub: Submission) -> None:
        if self._stopping:
            sub.deliver([Failed(503, "the server is shutting down", "shutting_down")])
            return
        try:
            engine_id = self.llm.add_request(sub.prompt, sub.params, sub.session)
        except ConfigError as e:           # (the prompt was checked before: a sampling setting)
            sub.deliver([Failed(400, str(e), "invalid_value", sampling_param(str(e)))])
            return
        self._live[sub.id] = _Live(sub, engine_id)

    def _emit(self, finished: list) -> None:
        now = time.perf_counter()
        done = {o.id: o for o in finished}
        bt = self.llm.adapter.block_tokens
        obs = self._observer
        for rid, live in list(self._live.items()):
            out = done.get(live.engine_id)
            if out is not None:
                ids = out.token_ids
            else:
                req = self.llm.request(live.engine_id)
                if req is None:
                    continue
                ids = req.output
            events: list[Event] = []
            if len(ids) > live.sent:
                events.append(Tokens(list(ids[live.sent:])))
                if obs is not None:
                    if live.last is None:
                        obs.first_token(now - live.sub.arrival)
                    else:
                        for _ in range(len(ids) - live.sent):
                            obs.token_gap(now - live.last)
                live.sent, live.last = len(ids), now
            if out is not None:
                by_tier = {t: n * bt for t, n in out.cached_by_tier.items()}
                events.append(Finished(out.finish_reason, len(out.prompt_token_ids), len(ids), by_tier))
                del self._live[rid]
                if obs is not None:
                    obs.finished(now - live.sub.arrival, len(out.prompt_token_ids), by_tier)
            if events:
                live.sub.deliver(events)

    def _step_failed(self, e: Exception) -> None:
        """Fail the requests the scheduler gave up on; after an unknown error, all of them."""
        gone = [rid for rid, live in self._live.items()
                if (r := self.llm.request(live.engine_id)) is None or r.status is Status.FINISHED]
        if isinstance(e, ConfigError) and gone:
            status, code, message = 503, "kv_cache_full", str(e)
        else:
            log.error("engine step failed: %s: %s", type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
            gone = list(self._live)
            status, code, message = 500, "internal_error", f"the engine failed: {type(e).__name__}: {e}"
        for rid in gone:
            live = self._live.pop(rid)
            self.llm.abort(live.engine_id)
            live.sub.deliver([Failed(status, message, code)])

    def _fail_live(self, status: int, message: str, code: str) -> None:
        for rid in list(self._live):
            live = self._live.pop(rid)
            if self.llm is not None:
                self.llm.abort(live.engine_id)
            live.sub.deliver([Failed(status, message, code)])

    def _drain_rejecting(self, message: str) -> None:
        for kind, arg in self._queued_commands():
            if kind == "add":
                arg.deliver([Failed(503, message, "shutting_down")])
