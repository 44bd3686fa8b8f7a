"""The router's workers: their state (from polling GET /kvtier/load, and from what the
router itself sent them), and the bookkeeping of a request's load while it runs.

A worker is `ready` when its /kvtier/load answers with status ready; `down` after a failed
call or poll, until a poll succeeds again; `starting` while it loads its model; `unknown`
before the first poll (the router may start before its workers). The loads the rules use
are the router's own counts (exact for the traffic this router sends): outstanding prefill
tokens (added when a prompt is sent, removed when its prefill answer or first token comes
back) and decode blocks (a request's prompt + max_tokens in blocks, while it streams).

A worker that stops answering its polls (LOST_AFTER_POLLS in a row: a hung process, SIGSTOP,
a deadlock) is `lost`: the calls the router has in flight to it give up at once (`unless_lost`)
instead of waiting out --request-timeout, and go to another worker where nothing reached the
client yet. A busy worker still answers its polls (its HTTP front reads counts without the
engine).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

import httpx
import orjson

log = logging.getLogger("kvtier.router")
POLL_TIMEOUT_S = 2.0
LOAD_MAX_BYTES = 64 << 10  # a /kvtier/load answer is a few hundred bytes
LOST_AFTER_POLLS = 2       # polls in a row a worker left unanswered before its calls give up
T = TypeVar("T")


class WorkerLost(httpx.TransportError):
    """A call given up because its worker stopped answering polls (handled as a transport error)."""


@dataclass
class Worker:
    url: str
    pool: str                          # "prefill" or "decode" (a `both` worker is listed with --decode)
    status: str = "unknown"            # unknown, starting, ready, down
    role: str | None = None            # what it reports: both, prefill, decode
    node: str | None = None            # its kvtier node, host:port, as it reports it
    node_signature: str | None = None  # decode workers: their signature of `node`, passed on as a push target
    cluster: str | None = None         # the id of the secret it signs with (serve/roles.py); None: not told
    foreign: bool = False              # a prefill worker whose secret no ready decode worker shares
    miscast: bool = False              # it runs a role its pool cannot use (--role prefill among --decode)
    answered_ready: bool = False       # its last /kvtier/load said ready (a foreign one stays down)
    block_tokens: int = 16
    kv_events: bool = False            # it publishes GET /kvtier/events (router/blocks.py)
    pulled_bytes: int = 0              # KV it handed over, as it reports it (decode: pulled, prefill: pushed)
    pushed_bytes: int = 0
    prefill_tokens: int = 0            # router-side counts (see the module docstring)
    decode_blocks: int = 0
    decode_seqs: int = 0
    sent: int = 0                      # requests (or prefills) sent
    failures: int = 0
    error: str = ""
    was_ready: bool = False            # found ready at least once (down since then: not "starting up")
    polled_at: float = 0.0
    unanswered: int = 0                # polls in a row it did not answer
    lost: asyncio.Event = field(default_factory=asyncio.Event, repr=False)   # set: it hangs (see above)

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def failed(self, why: str) -> None:
        """A call to it failed: out of rotation until a poll finds it ready again."""
        if self.status != "down":
            log.warning("worker %s (%s): %s -> down (%s)", self.url, self.pool, self.status, why)
        self.status, self.error = "down", why
        self.failures += 1

    def trusts(self, other: Worker) -> bool:
        """Whether what `other` signs (a hand-over, a push target) checks here: the same secret,
        as far as both tell (a worker that does not say is given the benefit of the doubt)."""
        return self.cluster is None or other.cluster is None or self.cluster == other.cluster

    def view(self) -> dict[str, Any]:
        return {"url": self.url, "pool": self.pool, "status": self.status, "role": self.role, "node": self.node,
                **({"cluster": self.cluster} if self.cluster else {}),
                "prefill_tokens": self.prefill_tokens, "decode_seqs": self.decode_seqs,
                "decode_blocks": self.decode_blocks, "sent": self.sent, "failures": self.failures,
                **({"error": self.error} if self.error and not self.ready else {})}


# A worker not reached this long after the router started is warned of, once: a typo in its
# URL showed only in /health ("starting"), the router having printed that it was ready.
UNREACHED_WARN_S = 60.0


@dataclass
class Pools:
    prefill: list[Worker] = field(default_factory=list)
    decode: list[Worker] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)     # when polling began
    # Told when the router starts or stops being able to answer (a decode worker ready or
    # none): `kvtier router` prints it, as serve prints that it is ready.
    announce: Callable[[str], None] = log.info
    _announced: bool = False       # whether it last said it answers (polls and failed calls both move workers)
    _unreached_warned: set[str] = field(default_factory=set)

    @property
    def answering(self) -> bool:
        return any(w.ready for w in self.decode)

    @property
    def all(self) -> list[Worker]:
        return self.prefill + self.decode

    async def poll_once(self, client: httpx.AsyncClient) -> None:
        was = {w.url: (w.status, w.foreign, w.was_ready) for w in self.all}
        await asyncio.gather(*(_poll(client, w) for w in self.all))
        self._check_secrets()
        if self.answering != self._announced:
            self._announced = self.answering
            ready = lambda pool: f"{sum(w.ready for w in pool)} of {len(pool)}"   # noqa: E731
            self.announce(f"ready: {ready(self.decode)} decode and {ready(self.prefill)} prefill workers are "
                          "ready; answering" if self._announced else
                          "no decode worker is ready: answering 503 until one is")
        for w in self.all:
            status, foreign, had_been_ready = was[w.url]
            if w.status != status or w.foreign > foreign:     # down, and now we know why
                # A worker not up yet (the router started beside it) is no warning; one that
                # was up goes down, and comes back, at the same level; a misconfigured one
                # (a secret or a role its pool cannot use) is a warning at once.
                loud = had_been_ready and (w.status == "down" or status == "down")
                change = f"{status} -> {w.status}" if w.status != status else w.status
                (log.warning if loud or w.foreign > foreign or (w.miscast and w.status != status) else log.info)(
                    "worker %s (%s): %s%s", w.url, w.pool, change,
                    f" ({w.error})" if w.status == "down" and w.error else "")
        waited = time.monotonic() - self.since
        for w in self.all:
            if (not w.was_ready and w.status == "down" and not (w.miscast or w.foreign)   # (warned of already)
                    and waited >= UNREACHED_WARN_S and w.url not in self._unreached_warned):
                self._unreached_warned.add(w.url)
                log.warning("worker %s (%s) has not been ready in the %.0f s since the router started (%s): "
                            "check its URL and that it runs", w.url, w.pool, waited, w.error or "no answer")

    def _check_secrets(self) -> None:
        """A prefill worker whose secret no ready decode worker shares is down: every hand-over
        it signed would be refused (400 invalid_signature), and every push target it was given
        too. It comes back when a poll finds a decode worker with its secret."""
        ids = {w.cluster for w in self.decode if w.ready and w.cluster}
        for w in self.prefill:
            w.foreign = bool(w.answered_ready and w.cluster and ids and w.cluster not in ids)
            if w.foreign:
                w.status = "down"
                w.error = (f"its secret (--secret-file, $KVTIER_SECRET) differs from every decode worker's (id "
                           f"{w.cluster}, theirs {', '.join(sorted(ids))}): they would refuse its hand-overs")
            elif w.answered_ready:
                w.status = "ready"



class AnswerTooLarge(ValueError):
    """A worker's answer to one of the router's own small calls passed its bound."""


async def read_small(client: httpx.AsyncClient, method: str, url: str, *, limit: int,
                     within: float | None, **kwargs: Any) -> tuple[int, bytes]:
    """(status, body) of a call whose answer is small (a worker's load, events, keys, a
    prefill's hand-over): at most `limit` bytes, `within` seconds in all (None: the client's
    timeout per read only). httpx bounds each read, not the whole answer, nor its size: a
    worker trickling bytes held the poll (and every worker's poll, gathered behind it), one
    answering without end the router's memory."""
    try:
        async with asyncio.timeout(within):
            async with client.stream(method, url, timeout=httpx.USE_CLIENT_DEFAULT if within is None else within,
                                     **kwargs) as r:
                return r.status_code, await read_capped(r, limit)
    except TimeoutError:
        raise httpx.ReadTimeout(f"{url} gave no whole answer in {within:g} s") from None


async def read_capped(r: httpx.Response, limit: int) -> bytes:
    """The body of a streamed answer, raising AnswerTooLarge past `limit` bytes (a worker
    answering without end would fill the router's memory)."""
    body = bytearray()
    async for chunk in r.aiter_bytes():
        body += chunk
        if len(body) > limit:
            raise AnswerTooLarge(f"{r.request.url} answered more than {limit:,} bytes")
    return bytes(body)


def _count(v: Any, default: int = 0) -> int:
    """A count a worker reports, `default` where it is missing or not a whole number >= 0."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default


async def _poll(client: httpx.AsyncClient, w: Worker) -> None:
    """Read `w`'s /kvtier/load into it (the caller logs a change of status). Whatever it
    answers, this returns: a value that raised here ended the router's poll loop for good."""
    try:
        code, body = await read_small(client, "GET", w.url + "/kvtier/load", limit=LOAD_MAX_BYTES,
                                      within=POLL_TIMEOUT_S)
        w.unanswered = 0                       # it answered: not hung, whatever the answer says
        w.lost.clear()
        data = orjson.loads(body) if code != 404 else {}
        if not isinstance(data, dict):
            raise ValueError("its /kvtier/load answer is not a JSON object")
        status = data.get("status", "down")
        if code == 404:                        # a server without the P/D routes: an older kvtier serve
            status = "down"
            w.error = "no /kvtier/load: not a kvtier serve worker of this version"
    except (httpx.HTTPError, ValueError) as e:
        status, data = "down", {}
        w.error = f"{type(e).__name__}: {e}" or type(e).__name__
        if isinstance(e, httpx.HTTPError):
            w.unanswered += 1
            if w.unanswered >= LOST_AFTER_POLLS and not w.lost.is_set():
                if w.sent:
                    log.warning("worker %s (%s) answered none of its last %d polls: giving up its calls in flight",
                                w.url, w.pool, w.unanswered)
                w.lost.set()
    w.status = status if status in ("ready", "starting") else "down"
    w.was_ready |= w.status == "ready"
    w.polled_at = time.monotonic()
    if data:
        w.role, w.node, w.node_signature = (v if isinstance(v, str) else None for v in
                                            (data.get("role"), data.get("node"), data.get("node_signature")))
        w.cluster = data["cluster"] if isinstance(data.get("cluster"), str) else None
        w.block_tokens = _count(data.get("block_tokens"), w.block_tokens) or w.block_tokens
        w.kv_events = data.get("kv_events") is True
        w.pulled_bytes = _count(data.get("pulled_bytes"))
        w.pushed_bytes = _count(data.get("pushed_bytes"))
        want = ("prefill", "both") if w.pool == "prefill" else ("decode", "both")
        w.miscast = w.role not in (None, *want)
        if w.miscast:       # (a prefill worker among --decode answered every request itself: no hand-over)
            w.status, w.error = "down", (f"it runs --role {w.role}, not {w.pool}: give it to --{w.role}"
                                         if w.role in ("prefill", "decode") else f"it runs --role {w.role}")
        elif w.pool == "prefill" and not w.node:
            w.status, w.error = "down", "it has no kvtier node to hand KV over from (start it with --role prefill)"
    w.answered_ready = w.ready
    if w.foreign and w.ready:                  # not in rotation before Pools._check_secrets says it may be
        w.status = "down"


class LostGuard:
    """Awaits calls to worker `w` (its requests, reads of its answer) in the calling task,
    giving each up once `w` is lost (see the module docstring): the call is cancelled and
    WorkerLost raised. The call stays in the calling task (httpx's streams and connection
    locks belong to it): one watcher cancels this task, as asyncio.timeout() does, while a
    call is under way, and the cancel is taken back. One watcher serves any number of calls
    (speed: a stream's every chunk; a watcher task per call cost 8 us a chunk)."""

    def __init__(self, w: Worker) -> None:
        me = asyncio.current_task()
        assert me is not None
        self.w, self._me = w, me
        self._armed = self._fired = False
        self._dog = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        await self.w.lost.wait()
        self._fired = True
        if self._armed:
            self._me.cancel()

    async def call(self, call: Awaitable[T]) -> T:
        if self._fired:
            close = getattr(call, "close", None)
            if close is not None:
                close()                        # never awaited: no "coroutine was never awaited"
            raise self._lost()
        self._armed = True
        try:
            return await call
        except asyncio.CancelledError:
            if self._fired and self._me.uncancel() == 0:    # ours, not a cancel from outside (the client left)
                raise self._lost() from None
            raise
        finally:
            self._armed = False

    def _lost(self) -> WorkerLost:
        return WorkerLost(f"worker {self.w.url} stopped answering (no answer to {self.w.unanswered} polls)")

    def close(self) -> None:
        self._dog.cancel()


async def unless_lost(w: Worker, call: Awaitable[T]) -> T:
    """Await one call to `w`, given up once `w` is lost (LostGuard)."""
    guard = LostGuard(w)
    try:
        return await guard.call(call)
    finally:
        guard.close()
