"""Prefill/decode disaggregation on the worker side (docs/disaggregation.md).

- `POST /kvtier/prefill` (prefill workers): `{"api": "completions"|"chat", "request": {...}}`,
  the client's own body. It is validated exactly as /v1/... would (a bad request is the same
  4xx), the prompt is computed into this server's store (one token sampled, then the
  request ends; its full blocks stay cached), and the answer says where the KV is:
  `{"prompt_tokens", "block_tokens", "keys": [hex], "node": "host:port", "cached_tokens"}`.
- A generation request with `"kvtier_handoff": {"node", "keys"}` (decode workers): the keys
  are checked against this server's own keys of the prompt (same model, weights and block
  size, or the hint is ignored) and registered as hints; admission then pulls that prefix
  from the node (verified, layer by layer) and computes only the rest. Nothing pulled
  (the prefill worker died, evicted the blocks) means the prompt is computed here.
- `GET /kvtier/load`: what a router balances on: role, node, outstanding prefill tokens,
  running and waiting requests, KV usage, handed-over bytes.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from kvtier.engine.sampling import SamplingParams
from kvtier.net.handoff import HandoffDirectory
from kvtier.net.remote import Remote
from kvtier.serve import protocol as P
from kvtier.serve.engine_loop import Failed, Finished, Submission
from kvtier.serve.protocol import ApiError

if TYPE_CHECKING:
    from starlette.requests import Request

    from kvtier.serve.app import Service

log = logging.getLogger("kvtier.serve")
ROLES = ("both", "prefill", "decode")
HANDOFF_FIELD = "kvtier_handoff"
MAX_HANDOFF_KEYS = 1 << 14


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
    node: str | None = None                       # set once the node listens (engine thread)
    handoff: HandoffDirectory | None = None
    remote: TimedRemote | None = None
    handed_over: int = 0                          # requests that arrived with a hand-over
    prefills: int = 0                             # /kvtier/prefill answered
    _started: float = field(default_factory=time.perf_counter)

    def load(self, svc: Service) -> dict[str, Any]:
        running, waiting = svc.engine.counts()
        out: dict[str, Any] = {"role": self.role, "node": self.node, "status": svc.phase,
                               "running": running, "waiting": waiting, "inflight": svc.inflight,
                               "prefill_tokens": 0, "kv_usage": 0.0, "handed_over": self.handed_over,
                               "prefills": self.prefills}
        llm = svc.engine.llm
        if llm is not None and svc.phase == "ready":
            s = llm.scheduler
            reqs = list(s.running) + list(s.waiting)          # copies: the engine thread moves them
            out["prefill_tokens"] = sum(max(0, len(r.prompt) - r.computed) for r in reqs)
            out["block_tokens"] = llm.adapter.block_tokens
            out["block_bytes"] = llm.store.layout.block_bytes
            pool = svc.engine.llm.adapter.device_tier.capacity_blocks
            out["kv_usage"] = round(sum(len(r.pages) for r in list(s.running)) / pool, 4) if pool else 0.0
        if self.remote is not None:
            bb = out.get("block_bytes", 0)
            out["pulled_blocks"] = self.remote.fetched_blocks
            out["pulled_bytes"] = self.remote.fetched_blocks * bb
            out["pull_seconds"] = round(self.remote.fetch_seconds, 6)
        return out


def accept_handoff(svc: Service, body: dict, ids: list[int]) -> None:
    """Register a hand-over's hints if its keys are this server's keys of `ids`."""
    d = svc.disagg
    hand = body.get(HANDOFF_FIELD)
    if hand is None or d is None:
        return
    if not isinstance(hand, dict) or not isinstance(hand.get("node"), str) or not isinstance(hand.get("keys"), list) \
            or len(hand["keys"]) > MAX_HANDOFF_KEYS:
        raise P.bad(f"{HANDOFF_FIELD} must be {{'node': 'host:port', 'keys': [hex, ...]}}", HANDOFF_FIELD)
    d.handed_over += 1
    if d.handoff is None or not hand["keys"]:
        return
    try:
        theirs = [bytes.fromhex(k) for k in hand["keys"]]
    except (TypeError, ValueError):
        raise P.bad(f"{HANDOFF_FIELD}.keys must be hex block keys", HANDOFF_FIELD) from None
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


async def prefill(svc: Service, request: Request) -> Any:
    """POST /kvtier/prefill: compute the prompt's KV here and say where it is."""
    from kvtier.serve.app import session_of
    from kvtier.serve.sse import JSON, read_json

    d = svc.disagg
    if d is None or d.node is None:
        raise ApiError(404, "this server has no kvtier node to hand KV over from: start it with --role prefill",
                       code="not_found")
    svc.check_serving()
    session = session_of(request)
    outer = await read_json(request, svc.max_body_bytes)
    if not isinstance(outer, dict) or outer.get("api") not in ("completions", "chat"):
        raise P.bad("the body must be {'api': 'completions' | 'chat', 'request': {...}}", "api")
    chat = outer["api"] == "chat"
    body = outer.get("request")
    req = P.parse_chat(body) if chat else P.parse_completion(body)
    svc.check_model(req.model)
    ids = svc.prompt_ids(req)
    svc.sampling(req, len(ids))                   # the same 400s the decode worker would give
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    rid = f"prefill-{uuid.uuid4().hex}"
    t0 = time.perf_counter()
    svc.begin()
    over = False
    try:
        svc.engine.submit(Submission(rid, ids, params, session,
                                     lambda batch: loop.call_soon_threadsafe(events.put_nowait, batch)))
        while not over:
            for ev in await events.get():
                if isinstance(ev, Failed):
                    over = True
                    raise ApiError(ev.status, ev.message, code=ev.code)
                if isinstance(ev, Finished):
                    over = True
                    cached = sum(ev.cached_by_tier.values())
    finally:
        if not over:                              # cancelled: the router went away
            svc.engine.abort(rid)
        svc.end()
    keys = svc.llm.adapter.keys(ids[:len(ids) - 1])
    d.prefills += 1
    return JSON({"object": "kvtier.prefill", "prompt_tokens": len(ids), "block_tokens": svc.llm.adapter.block_tokens,
                 "keys": [bytes(k).hex() for k in keys], "node": d.node, "cached_tokens": cached,
                 "prefill_s": round(time.perf_counter() - t0, 6)})
