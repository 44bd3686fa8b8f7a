"""The router's routes: an OpenAI-compatible front over prefill and decode workers.

A generation request (POST /v1/completions, /v1/chat/completions):

1. the body is read (bounded: 413 past --max-body-size) and its prompt keyed (prefixes.py);
2. if prefill workers are ready and the prompt's uncached part at the best decode worker
   is at least --direct-below tokens, a prefill worker is chosen by the rule (rules.py)
   and asked to compute it: POST /kvtier/prefill answers the block keys and its node. A
   prefill worker that fails (connection lost, 5xx) is taken out of rotation and the next
   one is tried; with none left the decode worker computes the prompt itself. A 4xx (a bad
   request) is the client's answer, as one server would give it;
3. a decode worker is chosen by the rule and sent the client's body plus
   `kvtier_handoff: {node, keys, signature}` as the prefill worker signed it (the router holds
   no secret and changes none of it); it pulls the prefix from that node and streams. A decode
   worker that cannot be reached, answers 503, or goes away (or says it is full or draining)
   before its first token, is replaced by the next: a stream's answer starts only with its
   first token, and nothing is retried after that, so no request is answered twice. Prefill
   and decode workers are paired only where they share a secret (their /kvtier/load `cluster`);
   a decode worker that refuses a hand-over's signature is asked again without it;
4. the answer passes through unchanged (ids, chunks, [DONE], usage): the client sees one
   ordinary response.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator
from urllib.parse import quote

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvtier.router.blocks import MAX_ROUNDS, BlockMap
from kvtier.router.metrics import RouterMetrics
from kvtier.router.prefixes import Prompt, PrefixIndex, prompt_of
from kvtier.router.rules import Ask, Candidate, choose
from kvtier.router.workers import (POLL_TIMEOUT_S, AnswerTooLarge, LostGuard, Pools, Worker, read_capped, read_small,
                                   unless_lost)
from kvtier.serve.metrics import CONTENT_TYPE
from kvtier.serve.protocol import INTERNAL_FIELDS, ApiError
from kvtier.serve.sse import (JSON, AFFINITY, ClientGone, EventStream, http_app, read_body, read_json,
                              session_of, sse_event, unless_gone)

log = logging.getLogger("kvtier.router")
FORWARD = ("content-type", "authorization", AFFINITY)
MAX_SESSIONS = 100_000
CALIBRATION_TEXT = ("You are a coding agent. Read the repository, call the tools you need, and answer the "
                    "user's question with a short plan, the files to change and the tests to run. ") * 4
KEYS_TIMEOUT_S = 1.0                          # a prompt's keys from a worker, else the text index decides
# Bounds on what the router reads of its workers' answers to its own calls (read_small):
EVENTS_MAX_BYTES = 4 << 20    # a /kvtier/events answer: at most 4,096 events of ~40 bytes
KEYS_MAX_BYTES = 16 << 20     # a prompt's keys (/kvtier/keys, a prefill's hand-over): ~35 bytes a block;
                              # 4 MiB of prompt text is at most ~64k blocks of 16 tokens
SMALL_MAX_BYTES = 64 << 10    # /tokenize of the calibration text
ANSWER_MAX_BYTES = 256 << 20  # a non-streamed answer or /tokenize: ~1M tokens' ids, or 64 long completions
DEFAULT_MAX_TOKENS = {False: 16, True: 256}   # completions (OpenAI's default), chat (a guess for load only)


@dataclass
class RouterConfig:
    policy: str = "kvtier"
    direct_below: int = 256            # uncached prompt tokens below which a request skips prefill workers
    max_body_bytes: int = 4 << 20
    request_timeout: float = 600.0
    poll_interval: float = 0.5
    handoff: str = "pull"              # pull: the decode worker fetches; push: the prefill worker sends
    prefixes: str = "events"           # events: the workers' KV events (blocks.py), else the text index only


@dataclass
class Stats:
    requests: int = 0
    disaggregated: int = 0             # prefilled on a prefill worker, decoded on another
    direct: int = 0                    # sent straight to a decode worker
    prefill_retries: int = 0           # a prefill worker failed and another (or the decode worker) took over
    decode_retries: int = 0
    unserved: int = 0                  # answered 5xx: no worker could serve
    cut: int = 0                       # streams ended by an error chunk: the decode worker went away mid-answer
    pushed_bytes: int = 0              # KV bytes prefill workers pushed to decode workers (--handoff push)
    push_failures: int = 0             # pushes that ended early (the decode worker pulls the rest)


@dataclass
class Router:
    pools: Pools
    cfg: RouterConfig = field(default_factory=RouterConfig)
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    blocks: BlockMap = field(default_factory=BlockMap)
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    stats: Stats = field(default_factory=Stats)
    tokens_per_byte: float = 0.3       # from a worker's tokenizer, then learned from prompt_tokens
    calibrated: bool = False
    client: httpx.AsyncClient | None = None
    # Polls, KV events and calibration on a client of their own: on the requests' client a
    # full pool (every connection streaming) failed polls, and two made a worker "lost".
    poll_client: httpx.AsyncClient | None = None
    _sessions: OrderedDict[str, dict[str, str]] = field(default_factory=OrderedDict)
    _poller: asyncio.Task | None = None
    _turn: int = 0                     # round-robin over the workers asked for a prompt's keys

    # -- life --------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        self.metrics.attach(self)

    async def start(self, max_connections: int = 256) -> None:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(self.cfg.request_timeout, connect=5.0))
        self.poll_client = httpx.AsyncClient(limits=httpx.Limits(max_connections=2 * len(self.pools.all) + 2),
                                             timeout=httpx.Timeout(POLL_TIMEOUT_S))
        self._poller = asyncio.ensure_future(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            assert self.poll_client is not None
            try:
                await self.pools.poll_once(self.poll_client)
                if self.cfg.prefixes == "events":
                    await asyncio.gather(*(self._read_events(w) for w in self.pools.all if w.ready and w.kv_events))
                if not self.calibrated:
                    await self._calibrate()
            except Exception:    # a bug: logged, and the loop goes on (ended, no worker was polled again)
                log.exception("polling the workers failed; trying again in %g s", self.cfg.poll_interval)
            await asyncio.sleep(self.cfg.poll_interval)

    async def _read_events(self, w: Worker) -> None:
        """Bring the router's view of `w`'s blocks up to date from its KV events (bounded)."""
        assert self.poll_client is not None
        for _ in range(MAX_ROUNDS):
            try:
                code, body = await read_small(self.poll_client, "GET", w.url + "/kvtier/events",
                                              params=self.blocks.query(w.url), limit=EVENTS_MAX_BYTES,
                                              within=POLL_TIMEOUT_S)
                if code != 200 or not self.blocks.apply(w.url, orjson.loads(body)):
                    return
            except (httpx.HTTPError, ValueError) as e:
                log.debug("KV events of %s: %s", w.url, e)
                return

    async def _keys(self, body: dict, chat: bool, prompt: Prompt) -> None:
        """The prompt's block keys and exact token count from a worker (POST /kvtier/keys),
        when some worker's events are known; else the text index is all there is."""
        assert self.client is not None
        ask = [w for w in self.pools.all if w.ready and self.blocks.knows(w.url)]
        if self.cfg.prefixes != "events" or not ask:
            return
        self._turn += 1
        w = ask[self._turn % len(ask)]
        try:
            code, answer = await read_small(self.client, "POST", w.url + "/kvtier/keys", content=orjson.dumps(
                {"api": "chat" if chat else "completions", "request": body}), limit=KEYS_MAX_BYTES,
                within=KEYS_TIMEOUT_S, headers={"content-type": "application/json"})
            if code == 200:
                data = orjson.loads(answer)
                prompt.keys = [bytes.fromhex(k) for k in data["keys"]]
                prompt.tokens = int(data["prompt_tokens"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            log.debug("keys from %s: %s", w.url, e)

    async def _calibrate(self) -> None:
        """Tokens per byte of text, from a ready worker's tokenizer (once; then learned)."""
        assert self.poll_client is not None
        for w in [w for w in self.pools.all if w.ready]:
            try:
                _code, body = await read_small(self.poll_client, "POST", w.url + "/tokenize", limit=SMALL_MAX_BYTES,
                                               within=POLL_TIMEOUT_S, json={"prompt": CALIBRATION_TEXT,
                                                                            "add_special_tokens": False})
                count = orjson.loads(body)["count"]
                if not isinstance(count, int) or count < 1:
                    raise ValueError(f"a token count of {count!r}")
                self.tokens_per_byte = count / len(CALIBRATION_TEXT.encode())
                self.calibrated = True
                return
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                continue

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for client in (self.client, self.poll_client):
            if client is not None:
                await client.aclose()

    # -- choosing ----------------------------------------------------------------------------
    @property
    def block_tokens(self) -> int:
        ready = [w for w in self.pools.all if w.ready]
        return ready[0].block_tokens if ready else 16

    def pick(self, workers: list[Worker], prompt: Prompt, session: str | None, pool: str,
             handed_over: bool = False) -> tuple[Worker, int]:
        """The worker the rule picks from `workers`, and the prompt tokens it would compute."""
        tokens = prompt.tokens_of(prompt.size, self.tokens_per_byte)
        cands = []
        for w in workers:
            if handed_over:
                cached = tokens
            elif prompt.keys is not None and self.blocks.knows(w.url):
                cached = self.blocks.match(w.url, prompt.keys) * w.block_tokens     # what it reported it holds
            else:
                cached = prompt.tokens_of(self.prefixes.match(w.url, prompt), self.tokens_per_byte)
            cands.append(Candidate(w.url, cached, w.prefill_tokens, w.decode_blocks))
        mine = self._sessions.get(session, {}).get(pool) if session else None
        c = choose(cands, Ask(tokens, self.block_tokens, mine), self.cfg.policy)
        return next(w for w in workers if w.url == c.name), max(0, tokens - c.prefix_tokens)

    def routed(self, w: Worker, prompt: Prompt) -> None:
        """`prompt` went to `w`: it will hold its prefix (until its events or the text index say otherwise)."""
        self.prefixes.insert(w.url, prompt)
        if prompt.keys is not None:
            self.blocks.sent(w.url, prompt.keys)

    def remember(self, session: str | None, pool: str, w: Worker) -> None:
        if session:
            self._sessions.setdefault(session, {})[pool] = w.url
            self._sessions.move_to_end(session)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)

    def learn(self, prompt: Prompt, prompt_tokens: Any) -> None:
        """Tokens per byte of text prompts, from what the workers counted (a moving average)."""
        if prompt.tokens is None and isinstance(prompt_tokens, int) and prompt.size >= 64:
            self.tokens_per_byte = 0.8 * self.tokens_per_byte + 0.2 * (prompt_tokens / prompt.size)

    # -- a generation request ----------------------------------------------------------------
    async def generate(self, request: Request, chat: bool) -> Any:
        """One generation request, counted in /metrics by route and outcome."""
        route = "chat" if chat else "completions"
        try:
            answer, outcome = await self._generate(request, chat)
        except ApiError as e:
            self.metrics.request(route, "rejected" if e.status < 500 else "unserved")
            raise
        except ClientGone:
            self.metrics.request(route, "abandoned")
            raise
        self.metrics.request(route, outcome)
        return answer

    async def _generate(self, request: Request, chat: bool) -> tuple[Any, str]:
        self.stats.requests += 1
        body = await read_json(request, self.cfg.max_body_bytes, "router")
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_value")
        for name in INTERNAL_FIELDS:       # set by the router (and workers) only, never by a client
            body.pop(name, None)
        session_of(request)                # a 400 as the workers answer it: the router keeps one entry per id
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD}
        headers["content-type"] = "application/json"
        # From here the answer is being made: a client that disconnects cancels it, and with it
        # the call to the prefill or decode worker, whose connection closes, so the worker aborts.
        return await unless_gone(request.receive, self._route(request.url.path, body, headers, chat))

    async def _route(self, path: str, body: dict, headers: dict, chat: bool) -> tuple[Any, str]:
        """Prefill (if worth it) then decode `body`: the answer and its outcome."""
        session = headers.get(AFFINITY)
        prompt = prompt_of(body, chat)
        await self._keys(body, chat, prompt)
        decoders = [w for w in self.pools.decode if w.ready]
        if not decoders:
            self.stats.unserved += 1
            raise ApiError(503, "no decode worker is ready; retry later (GET /health lists the workers)",
                           code="service_unavailable")
        handoff = first = source = None
        prefillers = [w for w in self.pools.prefill if w.ready]
        if prefillers:
            target, uncached = self.pick(decoders, prompt, session, "decode")
            if uncached >= self.cfg.direct_below:
                # push: the decode worker is chosen now, and the prefill worker sends it the blocks
                push_to = {"node": target.node, "signature": target.node_signature} \
                    if self.cfg.handoff == "push" and target.node else None
                handoff, answer, source, pushed = await self._prefill(
                    body, prompt, session, headers, chat, push_to, [target] if push_to is not None else decoders)
                if answer is not None:
                    return answer, "rejected"
                first = target if pushed else None
        if handoff is not None:
            self.stats.disaggregated += 1
        else:
            self.stats.direct += 1
        answer = await self._decode(path, body, prompt, session, headers, chat, handoff, first, source)
        status = getattr(answer, "status_code", 200)          # a decode worker's own error, passed through
        if status >= 400:
            return answer, "rejected" if status < 500 else "unserved"
        return answer, "disaggregated" if handoff is not None else "direct"

    async def _prefill(self, body: dict, prompt: Prompt, session: str | None, headers: dict, chat: bool,
                       push_to: dict | None, decoders: list[Worker]
                       ) -> tuple[dict | None, Response | None, Worker | None, bool]:
        """Prefill on a prefill worker: (the hand-over, None, the prefill worker, whether it pushed
        the blocks), (None, a 4xx to answer, ...), or (None, None, None, False) when no prefill
        worker could do it (the decode worker computes). `push_to`: the decode worker's signed
        node ({node, signature} from its /kvtier/load), which the prefill worker PUTs the blocks
        to. Only prefill workers one of `decoders` trusts (the same secret) are asked: a hand-over
        signed with another secret would be refused."""
        assert self.client is not None
        tried: set[str] = set()
        outer: dict[str, Any] = {"api": "chat" if chat else "completions", "request": body}
        if push_to is not None:
            outer["push_to"] = push_to
        payload = orjson.dumps(outer)
        while True:
            workers = [w for w in self.pools.prefill if w.ready and w.url not in tried
                       and any(d.trusts(w) for d in decoders)]
            if not workers:
                return None, None, None, False
            w, uncached = self.pick(workers, prompt, session, "prefill")
            tried.add(w.url)
            w.prefill_tokens += uncached
            w.sent += 1
            try:
                code, content = await unless_lost(w, read_small(
                    self.client, "POST", w.url + "/kvtier/prefill", content=payload, headers=headers,
                    limit=KEYS_MAX_BYTES, within=None))
            except (httpx.HTTPError, ValueError) as e:      # ValueError: an answer past the bound
                w.failed(f"prefill failed: {type(e).__name__}: {e}")
                self.stats.prefill_retries += 1
                log.warning("prefill worker %s failed (%s); trying another", w.url, type(e).__name__)
                continue
            finally:
                w.prefill_tokens -= uncached
            if code >= 500 or code == 404:
                w.failed(f"prefill answered {code}")
                self.stats.prefill_retries += 1
                continue
            if code == 400 and "push_to" in outer and _refused(content, "push_to"):
                # its secret is not the decode worker's (a worker that does not tell its id): pull
                log.warning("prefill worker %s refuses the push target of %s (their secrets differ); pulling "
                            "instead", w.url, push_to["node"] if push_to else None)
                outer.pop("push_to")
                payload = orjson.dumps(outer)
                tried.discard(w.url)
                continue
            if code != 200:
                return None, Response(content, code, media_type="application/json"), None, False
            try:
                data = orjson.loads(content)
                hand = {"node": data["node"], "keys": list(data["keys"]), "signature": data.get("signature")}
                if not isinstance(hand["node"], str):
                    raise TypeError("node")
            except (ValueError, KeyError, TypeError):
                w.failed("prefill answered a body that is not a hand-over")
                self.stats.prefill_retries += 1
                continue
            self.learn(prompt, data.get("prompt_tokens"))
            self.routed(w, prompt)
            self.remember(session, "prefill", w)
            pushed = data.get("pushed")
            if isinstance(pushed, dict) and isinstance(pushed.get("bytes"), int):
                self.stats.pushed_bytes += pushed["bytes"]
                self.stats.push_failures += bool(pushed.get("error"))
            return hand, None, w, isinstance(pushed, dict)

    async def _decode(self, path: str, body: dict, prompt: Prompt, session: str | None, headers: dict,
                      chat: bool, handoff: dict | None, first: Worker | None = None,
                      source: Worker | None = None) -> Any:
        """Stream the request from a decode worker (`first` if it is ready: the one the blocks
        were pushed to). The next one takes it if the worker cannot be reached, answers 503, or
        goes away (or says it is full or draining) before its first token: the client has seen
        nothing of it yet, so nothing is answered twice. `source`: the prefill worker that
        signed `handoff`; a decode worker that does not trust it (another secret) gets the
        request without the hand-over and computes the prompt."""
        assert self.client is not None
        plain = orjson.dumps(body)
        with_hand = orjson.dumps(dict(body, kvtier_handoff=handoff)) if handoff is not None else plain
        tried: set[str] = set()
        refused: set[str] = set()          # decode workers that refused the hand-over's signature
        tokens = prompt.tokens_of(prompt.size, self.tokens_per_byte)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS[chat]
        while True:
            workers = [w for w in self.pools.decode if w.ready and w.url not in tried]
            if not workers:
                self.stats.unserved += 1
                raise ApiError(503, "no decode worker could serve this request; retry later", code="service_unavailable")
            if handoff is not None and source is not None:
                workers = [w for w in workers if w.trusts(source)] or workers
            if first is not None and first in workers:
                w, uncached = first, 0
            else:
                w, uncached = self.pick(workers, prompt, session, "decode", handed_over=handoff is not None)
            hand = handoff is not None and w.url not in refused and (source is None or w.trusts(source))
            tried.add(w.url)
            # counted up to any model's context: a client's max_tokens of 2**64 weighed on the
            # worker's load until its 400 came back
            counted = min(max_tokens, MAX_COUNTED_TOKENS) if isinstance(max_tokens, int) and max_tokens > 0 else 0
            load = _Load(w, uncached, -(-(tokens + counted) // w.block_tokens))
            try:
                resp = await unless_lost(w, self.client.send(self.client.build_request(
                    "POST", w.url + path, content=with_hand if hand else plain, headers=headers), stream=True))
            except httpx.HTTPError as e:
                load.release()
                w.failed(f"{type(e).__name__}: {e}")
                if isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout):
                    self.stats.unserved += 1       # it took the request and stayed silent: not tried twice
                    raise ApiError(502, f"the decode worker failed before answering: {type(e).__name__}",
                                   code="bad_gateway") from None
                self.stats.decode_retries += 1     # unreachable, or gone before answering: the next one
                continue
            except BaseException:            # cancelled: the client went away
                load.release()
                raise
            if resp.status_code == 503:               # not generating (draining, KV full): another may
                load.release()                        # first: a cancel during aclose() must not keep it
                await resp.aclose()
                self.stats.decode_retries += 1
                continue
            ctype = resp.headers.get("content-type", "")
            if resp.status_code == 200 and ctype.startswith("text/event-stream"):
                chunks = resp.aiter_raw()
                try:
                    head = await unless_lost(w, _head(chunks, events=2 if chat else 1))   # a chat's role chunk, then
                except httpx.HTTPError as e:                              # the first token (or its error)
                    load.release()
                    await _close(resp, chunks)
                    w.failed(f"went away before its first token: {type(e).__name__}: {e}")
                    if isinstance(e, httpx.TimeoutException):
                        self.stats.unserved += 1
                        raise ApiError(502, f"the decode worker failed before answering: {type(e).__name__}",
                                       code="bad_gateway") from None
                    self.stats.decode_retries += 1
                    continue
                except BaseException:
                    load.release()
                    await _close(resp, chunks)
                    raise
                if _busy(head):                  # full or draining before its first token: another may
                    load.release()
                    await _close(resp, chunks)
                    self.stats.decode_retries += 1
                    continue
                load.prefilled()                 # the first token is out: its prompt is computed
                self.routed(w, prompt)
                self.remember(session, "decode", w)
                w.sent += 1
                return EventStream(_relay(resp, chunks, head, load, stats=self.stats), on_close=load.release)
            try:
                data = await unless_lost(w, read_capped(resp, ANSWER_MAX_BYTES))
            except AnswerTooLarge as e:
                self.stats.unserved += 1
                raise _too_large(e) from None
            except httpx.HTTPError as e:
                w.failed(f"went away before answering: {type(e).__name__}: {e}")
                if isinstance(e, httpx.TimeoutException):
                    self.stats.unserved += 1
                    raise ApiError(502, f"the decode worker failed while answering: {type(e).__name__}",
                                   code="bad_gateway") from None
                self.stats.decode_retries += 1        # nothing reached the client: the next one
                continue
            finally:
                load.release()                        # first: a cancel during aclose() must not keep it
                await resp.aclose()
            if resp.status_code == 400 and hand and _refused(data, "kvtier_handoff"):
                # it does not take the prefill worker's signature (another secret, one that does not
                # tell its id): the same worker again, without the hand-over; it computes the prompt
                log.warning("decode worker %s refuses the hand-over signed by %s (their secrets differ); it "
                            "computes the prompt", w.url, source.url if source else handoff.get("node"))
                refused.add(w.url)
                tried.discard(w.url)
                self.stats.decode_retries += 1
                continue
            self.routed(w, prompt)
            self.remember(session, "decode", w)
            w.sent += 1
            if resp.status_code == 200:
                try:
                    self.learn(prompt, orjson.loads(data)["usage"]["prompt_tokens"])
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    pass
            return Response(data, resp.status_code, media_type=ctype or "application/json")

    # -- the other routes ------------------------------------------------------------------
    async def forward(self, request: Request) -> Response:
        """GET /v1/models, /v1/models/{id}, POST /tokenize, /detokenize: any ready decode worker answers."""
        assert self.client is not None
        raw = await read_body(request, self.cfg.max_body_bytes, "router") if request.method == "POST" else None
        path = request.url.path
        if "model" in request.path_params:   # one path segment: a decoded "../" in it reached any worker route
            path = "/v1/models/" + quote(request.path_params["model"], safe="")
        for w in [w for w in self.pools.decode if w.ready]:
            try:
                async with self.client.stream(request.method, w.url + path, content=raw,
                                              headers={"content-type": "application/json"}) as r:
                    data = await read_capped(r, ANSWER_MAX_BYTES)
            except AnswerTooLarge as e:
                raise _too_large(e) from None
            except httpx.HTTPError as e:
                w.failed(f"{type(e).__name__}: {e}")
                continue
            return Response(data, r.status_code, media_type=r.headers.get("content-type"))
        raise ApiError(503, "no decode worker is ready; retry later", code="service_unavailable")

    def health(self) -> tuple[dict, int]:
        ready = any(w.ready for w in self.pools.decode)
        # "down": every decode worker was ready once and is down now; "starting": one may
        # still come up (a refused connection cannot tell a worker starting from a dead one)
        coming = any(w.status == "starting" or not w.was_ready for w in self.pools.decode)
        return ({"status": "ready" if ready else "starting" if coming else "down", "policy": self.cfg.policy, "handoff": self.cfg.handoff,
                 "direct_below": self.cfg.direct_below, "calibrated": self.calibrated,
                 "tokens_per_byte": round(self.tokens_per_byte, 4), "stats": vars(self.stats),
                 "prefixes": self.cfg.prefixes,
                 "workers": [dict(w.view(), **({"kv_events": v} if (v := self.blocks.view(w.url)) else {}))
                             for w in self.pools.all]}, 200 if ready else 503)


@dataclass
class _Load:
    """A request's share of a decode worker's load, released once."""

    w: Worker
    prefill: int
    blocks: int
    done: bool = False

    def __post_init__(self) -> None:
        self.w.prefill_tokens += self.prefill
        self.w.decode_blocks += self.blocks
        self.w.decode_seqs += 1

    def prefilled(self) -> None:
        self.w.prefill_tokens -= self.prefill
        self.prefill = 0

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.prefilled()
            self.w.decode_blocks -= self.blocks
            self.w.decode_seqs -= 1


MAX_HEAD_BYTES = 1 << 20       # what the router reads of a stream before it starts relaying it
MAX_COUNTED_TOKENS = 1 << 20   # a request's max_tokens as the load counts it, at most
BUSY = ("kv_cache_full", "shutting_down", "service_unavailable")


async def _head(chunks: AsyncIterator[bytes], events: int) -> bytes:
    """The first `events` SSE events of a stream (fewer if it ends first), as raw bytes."""
    head = bytearray()
    seen, pos = 0, 0           # Speed: the scan goes on from the last event's end, never the whole head
    while seen < events and len(head) < MAX_HEAD_BYTES:
        try:
            head += await chunks.__anext__()
        except StopAsyncIteration:
            break
        while seen < events and (end := head.find(b"\n\n", pos)) >= 0:
            seen, pos = seen + 1, end + 2
    return bytes(head)


def _busy(head: bytes) -> bool:
    """Whether a stream's first events are an error that another worker may not give (full,
    draining), so the request can go to the next one: the client has seen nothing of it."""
    for event in head.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"error"' in event:
            try:
                return orjson.loads(event[6:])["error"].get("code") in BUSY
            except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                return False
    return False


def _too_large(e: AnswerTooLarge) -> ApiError:
    """The client's 502 for a worker's answer past ANSWER_MAX_BYTES; the worker's address goes
    to the log, not to the client."""
    log.warning("%s: answered the client with a 502", e)
    return ApiError(502, f"the decode worker's answer was larger than {ANSWER_MAX_BYTES:,} bytes", code="bad_gateway")


def _refused(content: bytes, param: str) -> bool:
    """Whether a worker's 4xx body refuses the signature of the router's `param` field."""
    try:
        error = orjson.loads(content)["error"]
        return error.get("code") == "invalid_signature" and error.get("param") == param
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return False


async def _relay(resp: httpx.Response, chunks: AsyncIterator[bytes], head: bytes, load: _Load,
                 stats: Stats) -> AsyncIterator[bytes]:
    """The decode worker's SSE bytes: `head` (read before the answer started), then the rest of
    `chunks` as they come; an error chunk and [DONE] if it dies mid-stream (the worker leaves
    the rotation until a poll finds it ready: `failures`, and the router's `cut`)."""
    guard = LostGuard(load.w)
    try:
        if head:
            yield head
        while True:
            try:
                chunk = await guard.call(chunks.__anext__())
            except StopAsyncIteration:
                break
            yield chunk
    except httpx.HTTPError as e:
        load.w.failed(f"went away mid-answer: {type(e).__name__}: {e}")
        stats.cut += 1
        yield sse_event(ApiError(502, f"the decode worker went away mid-answer: {type(e).__name__}",
                                 code="bad_gateway").body())
        yield b"data: [DONE]\n\n"
    finally:
        guard.close()
        await _close(resp, chunks)


async def _close(resp: httpx.Response, chunks: Any) -> None:
    try:
        await chunks.aclose()
    finally:
        await resp.aclose()


def build_app(router: Router) -> Any:
    async def completions(request: Request) -> Any:
        return await router.generate(request, chat=False)

    async def chat(request: Request) -> Any:
        return await router.generate(request, chat=True)

    async def health(_request: Request) -> Response:
        body, status = router.health()
        return JSON(body, status_code=status)

    async def forward(request: Request) -> Response:
        return await router.forward(request)

    async def metrics(_request: Request) -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", forward, methods=["GET"]),
        Route("/v1/models/{model:path}", forward, methods=["GET"]),
        Route("/tokenize", forward, methods=["POST"]),
        Route("/detokenize", forward, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return http_app(routes)
