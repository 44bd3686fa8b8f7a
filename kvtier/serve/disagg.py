"""Prefill/decode disaggregation on the worker side (docs/disaggregation.md).

- `POST /kvtier/prefill` (prefill workers): `{"api": "completions"|"chat", "request": {...}}`,
  the client's own body. It is validated exactly as /v1/... would (a bad request is the same
  4xx), the prompt is computed into this server's store (one token sampled, then the
  request ends; its full blocks stay cached), and the answer says where the KV is:
  `{"prompt_tokens", "block_tokens", "keys": [hex], "node": "host:port", "cached_tokens",
  "signature"}`: the signature (roles.py: HMAC-SHA256 under the cluster secret) covers the
  node and the keys. The blocks stay pinned here for --handoff-ttl seconds (30) (in memory, not
  evicted before the decode worker pulls them; released on expiry). With `"push_to": {"node",
  "signature"}` (the router's --handoff push: a decode worker's node as its /kvtier/load signs
  it) the blocks are first PUT to that node (kvtier/net/push.py) and the answer says how many
  arrived (`"pushed"`); a complete push releases the pin at once. An unsigned or mis-signed
  push_to is a 400: nobody makes a prefill worker dial an address no decode worker signed.
- A generation request with `"kvtier_handoff": {"node", "keys", "signature"}` (decode
  workers): a hand-over whose signature is missing or wrong is a 400 (it would make this
  worker dial any address). The keys are checked against this server's own keys of the prompt
  (same model, weights and block size, or the hint is ignored) and registered as hints;
  admission then pulls that prefix from the node (verified, layer by layer) and computes only
  the rest. Nothing pulled (the prefill worker died, evicted the blocks) means the prompt is
  computed here.
- `GET /kvtier/load`: what a router balances on: role, node (and `node_signature`, what a
  push_to carries), outstanding prefill tokens, running and waiting requests, KV usage,
  handed-over bytes.
- `POST /kvtier/keys` (any role): a prompt's block keys, as admission keys it, so a router
  can match them against the `GET /kvtier/events` this server publishes (events.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError
from kvtier.net.address import parse_address
from kvtier.net.handoff import HandoffDirectory
from kvtier.net.push import Pusher
from kvtier.net.remote import Remote
from kvtier.serve import protocol as P
from kvtier.serve.engine_loop import Failed, Finished, Submission
from kvtier.serve.protocol import ApiError
from kvtier.serve.roles import HANDOFF, PUSH_TARGET, cluster_id, reachable_node, sign, signed

if TYPE_CHECKING:
    from starlette.requests import Request

    from kvtier.serve.app import Service

log = logging.getLogger("kvtier.serve")
ROLES = ("both", "prefill", "decode")
HANDOFF_FIELD = P.HANDOFF_FIELD
MAX_HANDOFF_KEYS = 1 << 14
COMPUTE_PIN_S = 600.0      # a prefill's blocks stay pinned while it computes (then for Disagg.pin_ttl)


class TimedRemote(Remote):
    """A Remote that counts what it fetched and how long that took (for GB/s figures)."""

    fetched_blocks: int = 0
    fetch_seconds: float = 0.0

    def fetch(self, keys: Sequence[bytes], rows: Sequence[Any]) -> int:
        t0 = time.perf_counter()
        got = super().fetch(keys, rows)
        self.fetch_seconds += time.perf_counter() - t0
        self.fetched_blocks += got
        return got


@dataclass
class Disagg:
    """A worker's part in P/D: its role, its node's address, and where hand-over hints go."""

    role: str = "both"
    pin_ttl: float = 30.0                         # seconds a prefill's blocks stay pinned for the pull (--handoff-ttl)
    node: str | None = None                       # set once the node listens (engine thread)
    key: bytes | None = None                      # roles.signing_key(secret): signs and checks hand-overs
    handoff: HandoffDirectory | None = None
    remote: TimedRemote | None = None
    pusher: Pusher | None = None                  # prefill workers: --handoff push sends blocks with it
    handed_over: int = 0                          # requests that arrived with a hand-over
    prefills: int = 0                             # /kvtier/prefill answered
    _started: float = field(default_factory=time.perf_counter)

    def public_node(self, request: Request) -> str | None:
        """This worker's node as a peer reaches it: a wildcard host becomes the local address
        `request` came in on (what the router reached this worker at)."""
        server = request.scope.get("server")
        return None if self.node is None else reachable_node(self.node, server[0] if server else None)

    def load(self, svc: Service, request: Request) -> dict[str, Any]:
        running, waiting = svc.engine.counts()
        node = self.public_node(request)
        out: dict[str, Any] = {"role": self.role, "node": node, "status": svc.phase,
                               "running": running, "waiting": waiting, "inflight": svc.inflight,
                               "prefill_tokens": 0, "kv_usage": 0.0, "handed_over": self.handed_over,
                               "prefills": self.prefills, "kv_events": True}
        if self.key is not None:
            out["cluster"] = cluster_id(self.key)                 # equal ids: equal secrets (roles.py)
        if node is not None and self.key is not None and self.role == "decode":
            out["node_signature"] = sign(self.key, PUSH_TARGET, node)     # what a push_to to it carries
        llm = svc.engine.llm
        if llm is not None and svc.phase == "ready":
            s = llm.scheduler
            reqs = list(s.running) + list(s.waiting)          # copies: the engine thread moves them
            out["prefill_tokens"] = sum(max(0, len(r.prompt) - r.computed) for r in reqs)
            out["block_tokens"] = llm.adapter.block_tokens
            out["block_bytes"] = llm.store.layout.block_bytes
            pool = svc.engine.llm.adapter.device_tier.capacity_blocks
            out["kv_usage"] = round(sum(len(r.pages) for r in list(s.running)) / pool, 4) if pool else 0.0
            out["pinned_blocks"] = sum(t.pinned_blocks for t in llm.store.stats().tiers)
        if self.pusher is not None:
            p = self.pusher
            out.update(pushed_blocks=p.blocks, pushed_bytes=p.bytes, push_seconds=round(p.seconds, 6),
                       push_failures=p.failures)
        if self.remote is not None:
            bb = out.get("block_bytes", 0)
            out["pulled_blocks"] = self.remote.fetched_blocks
            out["pulled_bytes"] = self.remote.fetched_blocks * bb
            out["pull_seconds"] = round(self.remote.fetch_seconds, 6)
        return out


def accept_handoff(svc: Service, body: dict, ids: list[int]) -> None:
    """Register a hand-over's hints if a prefill worker of this cluster signed it and its
    keys are this server's keys of `ids`; an unsigned or mis-signed one is a 400."""
    d = svc.disagg
    hand = body.get(HANDOFF_FIELD)
    if hand is None or d is None:
        return
    if not isinstance(hand, dict) or not isinstance(hand.get("node"), str) or not isinstance(hand.get("keys"), list) \
            or len(hand["keys"]) > MAX_HANDOFF_KEYS:
        raise P.bad(f"{HANDOFF_FIELD} must be {{'node': 'host:port', 'keys': [hex, ...], 'signature': hex}}",
                    HANDOFF_FIELD)
    try:
        theirs = [bytes.fromhex(k) for k in hand["keys"]]
    except (TypeError, ValueError):
        raise P.bad(f"{HANDOFF_FIELD}.keys must be hex block keys", HANDOFF_FIELD) from None
    if not signed(d.key, HANDOFF, hand["node"], theirs, hand.get("signature")):
        raise P.bad(f"{HANDOFF_FIELD} is not signed by a prefill worker of this cluster (its signature is missing "
                    "or wrong): it is the router's field, copied from a prefill worker's answer; leave it out",
                    HANDOFF_FIELD, "invalid_signature")
    d.handed_over += 1
    if d.handoff is None or not theirs:
        return
    mine = svc.llm.adapter.keys(ids[:len(ids) - 1])
    n = 0
    for a, b in zip(mine, theirs):
        if bytes(a) != b:
            break
        n += 1
    if n < min(len(mine), len(theirs)):
        log.warning("a hand-over's keys differ from this server's after %d blocks: the prefill worker runs "
                    "another model, weights or block size; computing the rest here", n)
    if n:
        d.handoff.hint([bytes(k) for k in mine[:n]], hand["node"])


async def _wrapped(svc: Service, request: Request) -> tuple[dict, P.GenerationRequest, list[int]]:
    """A router's `{"api": "completions" | "chat", "request": {...}}` body: the outer object, the
    client's request (validated as /v1/... validates it: the same 4xx) and its prompt's ids."""
    from kvtier.serve.sse import MAX_JSON_DEPTH, read_json

    svc.check_serving()
    outer = await read_json(request, svc.max_body_bytes, depth=MAX_JSON_DEPTH + 1)   # a client's body, wrapped once
    if not isinstance(outer, dict) or outer.get("api") not in ("completions", "chat"):
        raise P.bad("the body must be {'api': 'completions' | 'chat', 'request': {...}}", "api")
    body = outer.get("request")
    req = P.parse_chat(body) if outer["api"] == "chat" else P.parse_completion(body)
    svc.check_model(req.model)
    return outer, req, svc.prompt_ids(req)


async def block_keys(svc: Service, request: Request) -> Any:
    """POST /kvtier/keys: the block keys of a request's prompt as this server keys it (the
    blocks a cached prefix is made of), so a router can match them against KV events."""
    from kvtier.serve.sse import JSON

    _, _, ids = await _wrapped(svc, request)
    adapter = svc.llm.adapter
    keys = adapter.keys(ids[:len(ids) - 1])       # what admission looks up: the last token is computed
    return JSON({"object": "kvtier.keys", "prompt_tokens": len(ids), "block_tokens": adapter.block_tokens,
                 "keys": [bytes(k).hex() for k in keys]})


async def prefill(svc: Service, request: Request) -> Any:
    """POST /kvtier/prefill: compute the prompt's KV here and say where it is."""
    from kvtier.serve.sse import JSON, session_of, unless_gone

    d = svc.disagg
    if d is None or d.node is None:
        raise ApiError(404, "this server has no kvtier node to hand KV over from: start it with --role prefill",
                       code="not_found")
    session = session_of(request)
    outer, req, ids = await _wrapped(svc, request)
    svc.sampling(req, len(ids))                   # the same 400s the decode worker would give
    push_to = _push_target(outer.get("push_to"), d.key)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    rid = f"prefill-{uuid.uuid4().hex}"
    adapter = svc.llm.adapter
    keys = adapter.keys(ids[:len(ids) - 1])
    pin = f"kvtier-handoff:{rid}"
    # Pinned before the prompt is computed (keys not cached yet are protected when they
    # arrive), so no other request evicts them between compute and the decode worker's pull.
    adapter.pin(pin, keys, COMPUTE_PIN_S)
    t0 = time.perf_counter()
    over = False

    async def computed() -> int:
        """The prompt's tokens loaded from the store, once the engine has computed the rest."""
        nonlocal over
        while True:
            for ev in await events.get():
                if isinstance(ev, Failed):
                    over = True
                    svc.metrics.outcome("error")
                    raise ApiError(ev.status, ev.message, code=ev.code)
                if isinstance(ev, Finished):
                    over = True
                    svc.metrics.outcome(ev.reason)        # a prefill is one request of one token
                    return sum(ev.cached_by_tier.values())

    svc.begin()
    try:
        svc.engine.submit(Submission(rid, ids, params, session,
                                     lambda batch: loop.call_soon_threadsafe(events.put_nowait, batch)))
        cached = await unless_gone(request.receive, computed())    # the router gave up: ClientGone
    except BaseException:
        adapter.unpin(pin)
        raise
    finally:
        if not over:                              # the router went away (or cancelled the call)
            svc.engine.abort(rid)
            svc.metrics.outcome("abort")
        svc.end()
    adapter.pin(pin, keys, d.pin_ttl)             # now a short, bounded wait for the pull
    node = d.public_node(request)
    answer = {"object": "kvtier.prefill", "prompt_tokens": len(ids), "block_tokens": adapter.block_tokens,
              "keys": [bytes(k).hex() for k in keys], "node": node, "cached_tokens": cached,
              "prefill_s": round(time.perf_counter() - t0, 6)}
    if d.key is not None:                         # what the decode worker checks before it dials `node`
        answer["signature"] = sign(d.key, HANDOFF, node, [bytes(k) for k in keys])
    if push_to is not None and d.pusher is not None and len(keys):
        pushed = await asyncio.to_thread(d.pusher.push, svc.llm.store, keys, push_to)
        if pushed.blocks == len(keys):
            adapter.unpin(pin)                    # the decode worker has them all: nothing to pull
        answer["pushed"] = {"node": push_to, "blocks": pushed.blocks, "sent": pushed.sent, "bytes": pushed.bytes,
                            "seconds": round(pushed.seconds, 6), **({"error": pushed.error} if pushed.error else {})}
    d.prefills += 1
    return JSON(answer)


def _push_target(value: Any, key: bytes | None) -> str | None:
    """The node a prefill's blocks are pushed to ("push_to": a decode worker's node and its
    signature, as its /kvtier/load answers them), checked; None: pull."""
    if value is None:
        return None
    node = value.get("node") if isinstance(value, dict) else None
    try:
        if not isinstance(node, str):
            raise ConfigError("not a string")
        parse_address(node)
    except ConfigError:
        raise P.bad("push_to must be {'node': 'host:port', 'signature': hex}: a decode worker's node and "
                    "node_signature from its GET /kvtier/load", "push_to") from None
    if not signed(key, PUSH_TARGET, node, (), value.get("signature")):
        raise P.bad("push_to is not signed by a decode worker of this cluster (its signature is missing or wrong): "
                    "give the node and node_signature its GET /kvtier/load answers", "push_to", "invalid_signature")
    return node
