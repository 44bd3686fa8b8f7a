"""The scheduler side of the connector: how long a prefix kvtier can supply, and each step's plan.

    match(request, n_local)     keys the prompt's full blocks (per rank: each rank's store has
                                its own namespace) and asks every worker's store how long a
                                prefix it holds; vLLM loads min(...) blocks past its own hit
    after_alloc(...)            vLLM gave pages for those blocks: remember them
    build(scheduler_output)     the step's plan: new requests' tokens, loads, and the blocks
                                that become full this step (to save after the forward)
    on_output(invalid ids)      a load failed: vLLM recomputes from the failed block, those
                                blocks are saved again once recomputed and are not counted
                                in the request's num_cached_tokens
    finish(request, pages)      vLLM finished it: a block its last step completed whose save
                                was not planned yet (asynchronous scheduling) is saved in the
                                next step, and vLLM keeps the pages until the workers say so
    hit_sources(request, n)     which tier supplies the n tokens after_alloc planned to load
                                (host, disk, p2p: vLLM's per-source cache-hit metric)

The workers' stores live in the worker processes; lookups go to the worker's kvtier node
(loopback TCP, one authenticated FIND round trip: the worker's tiers, then what its remote
tier finds on peers; tensor-parallel ranks at once), or straight to the store when the
worker runs in this process. Nothing here imports vLLM: requests and scheduler outputs are
read through the attributes vLLM gives them.
"""
from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.plan import BlockRange, Grown, NewRequest, StepPlan, request_keys
from kvtier.keys import BlockKeys
from kvtier.net.client import PeerClient, PeerError

log = logging.getLogger("kvtier.vllm")

# Where loaded blocks come from, as vLLM's CacheHitSource values (vllm/v1/metrics/cache_hit_source.py),
# nearest the accelerator first: kvtier's tier kinds, its remote tier (other nodes) as "p2p".
SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
UNKNOWN = "external_unspecified"


def outermost(sources: Sequence[str]) -> str:
    """The source farthest from the accelerator (as vLLM reports overlapping sources)."""
    return max(sources, key=lambda s: SOURCES.index(s) if s in SOURCES else len(SOURCES) - 1)


class WorkerStore:
    """One worker's store as the scheduler sees it: `lookup(keys)` -> its cached prefix (and sources)."""

    def __init__(self, info: dict[str, Any], timeout: float = 0.5) -> None:
        self.info = info
        # A worker with a remote tier asks its peers in turn: allow for their timeout too.
        timeout += float(info.get("remote_timeout") or 0.0)
        self.seed: bytes = info["seed"]
        self.hash: str = info["hash"]
        self.block_tokens: int = info["block_tokens"]
        self._client: PeerClient | None = None
        self._timeout = timeout
        self._warned = 0.0
        # The worker's local tier kinds, fastest first (a tier index past them: its remote).
        self.tier_kinds: list[str] = list(info.get("tiers") or ())

    def lookup(self, keys: list[bytes]) -> tuple[int, list[str] | None]:
        """The worker's cached prefix of `keys`, in blocks, and each block's source (None where
        the lookup did not tell: it failed, or an older node answered a length only)."""
        from kvtier.integrations.vllm.worker import LOCAL

        if not keys:
            return 0, None
        local = LOCAL.get(self.info["address"])
        if local is not None and local.store is not None:
            hit = local.store.lookup(keys)
            return hit.blocks, _sources(hit.tiers, [t.kind for t in local.store.tiers])
        if self._client is None:
            self._client = PeerClient(self.info["address"], self.info["secret"], self.seed, 1, self._timeout)
        try:
            tiers: list[int] = []
            n = self._client.find(keys, tiers)
            return n, _sources(tiers, self.tier_kinds) if len(tiers) == n else None
        except PeerError as e:          # a worker that cannot answer in time is a miss, not an error
            if time.monotonic() - self._warned > 10:
                self._warned = time.monotonic()
                log.warning("kvtier: prefix lookup at worker %s failed (a miss): %s", self.info["address"], e)
            return 0, None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _sources(tiers: Sequence[int], kinds: Sequence[str]) -> list[str]:
    """Blocks' tier indexes as vLLM cache-hit sources: a local tier's kind, "p2p" past them
    (the remote tier: other nodes)."""
    return [("p2p" if t >= len(kinds) else kinds[t] if kinds[t] in ("device", "host", "disk") else UNKNOWN)
            for t in tiers]


@dataclass
class _Req:
    tokens: list[int]            # the prompt's full blocks
    n_blocks: int                # blocks the workers can key: the prompt's, then generated ones
    tag: bytes
    session: str | None
    ttl: float
    skip: bool = False           # not keyed (multimodal or embedding inputs): never loaded or saved
    keys: list[BlockKeys] | None = None       # per worker
    hit: int = 0                 # blocks the stores hold (all workers), at the last match
    sources: list[list[str] | None] | None = None   # per worker: each hit block's source (None: not known yet)
    plan: tuple[int, int] | None = None       # blocks [start, end) match() offered
    pending: BlockRange | None = None         # a load waiting for its step
    loading: BlockRange | None = None         # the last load sent (its pages are this request's)
    saved: int = 0               # blocks [0, saved) are in the store or being saved
    sent: bool = False           # the workers know this request's tokens
    resync: bool = False         # a load failed; tell the workers saves may resume
    request: Any = None          # vLLM's Request (its prefill statistics are corrected on a failed load)


class SchedulerSide:
    """Per-request bookkeeping of the scheduler-side connector."""

    def __init__(self, cfg: ConnectorConfig, block_tokens: int) -> None:
        self.cfg = cfg
        self.block_tokens = block_tokens
        self.workers: list[WorkerStore] = []
        self._pool: ThreadPoolExecutor | None = None
        self._reqs: dict[str, _Req] = {}
        self._final: StepPlan = StepPlan()       # finished requests' last saves, for the next step
        self.counters = {"lookups": 0, "hit_blocks": 0, "load_blocks": 0, "save_blocks": 0, "failed_loads": 0,
                         "final_saves": 0}

    def set_workers(self, infos: list[dict[str, Any]]) -> None:
        """The workers' handshakes: where their stores answer lookups, and their key seeds."""
        for w in self.workers:
            w.close()
        self.workers = [WorkerStore(i) for i in sorted(infos, key=lambda i: i["rank"])]
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        # Tensor-parallel ranks are asked at once: each FIND may wait on its peers' answers.
        self._pool = ThreadPoolExecutor(len(self.workers), "kvtier-lookup") if len(self.workers) > 1 else None
        for w in self.workers:
            if w.block_tokens != self.block_tokens:
                from kvtier.errors import ConfigError
                raise ConfigError(f"worker {w.info['rank']} keys blocks of {w.block_tokens} tokens but vLLM's block "
                                  f"size here is {self.block_tokens}")

    # -- lookup ------------------------------------------------------------------------
    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is not None:
            st.request = request
            return st
        prompt = list(request.prompt_token_ids or [])
        B = self.block_tokens
        n = len(prompt) // B
        params = getattr(request, "kv_transfer_params", None) or {}
        session = params.get(self.cfg.session_param) if isinstance(params, dict) else None
        ttl = _ttl(params.get("x-session-ttl") if isinstance(params, dict) else None, self.cfg.store.pin_ttl)
        lora = getattr(request, "lora_request", None)
        tag = b""
        if lora is not None:
            tag += b"lora:" + str(getattr(lora, "lora_name", lora)).encode() + b"\0"
        salt = getattr(request, "cache_salt", None)
        if salt:
            tag += b"salt:" + str(salt).encode() + b"\0"
        skip = bool(getattr(request, "mm_features", None)) or getattr(request, "prompt_embeds", None) is not None
        # A prompt shorter than a block has nothing to look up, but its answer's blocks are saved.
        st = _Req(prompt[:n * B], n, tag, str(session) if session else None, ttl,
                  skip=skip or (n == 0 and not self.cfg.save_generated), request=request)
        self._reqs[request.request_id] = st
        return st

    def match(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` (vLLM's own hit) that kvtier will load (whole blocks)."""
        st = self._state(request)
        st.plan = None
        if st.skip or not self.workers:
            return 0
        if st.keys is None:
            st.keys = [request_keys(st.tokens, self.block_tokens, w.seed, w.hash, st.tag) for w in self.workers]
        answers = self._ask(st.keys)
        st.hit = min(n for n, _ in answers)
        st.sources = [src for _, src in answers]
        self.counters["lookups"] += 1
        self.counters["hit_blocks"] += st.hit
        B = self.block_tokens
        # At least one prompt token must be computed (vLLM needs its logits).
        usable = min(st.hit, (request.num_tokens - 1) // B)
        local = num_computed_tokens // B
        if usable - local < self.cfg.min_hit_blocks:
            return 0
        st.plan = (local, usable)
        return (usable - local) * B

    def _ask(self, keys: list[BlockKeys]) -> list[tuple[int, list[str] | None]]:
        """Each worker's cached prefix of its keys (its rank's chain), and its blocks' sources if known."""
        if self._pool is None:
            return [w.lookup(k) for w, k in zip(self.workers, keys)]
        return list(self._pool.map(lambda wk: wk[0].lookup(wk[1]), zip(self.workers, keys)))

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """The `num_external_tokens` that after_alloc planned to load, by the tier each block
        comes from ("host", "disk", "p2p"; vLLM's CacheHitSource values): with several ranks,
        the farthest of theirs per block; what is not known, "external_unspecified". The
        counts sum to num_external_tokens."""
        out: dict[str, int] = {}
        left = num_external_tokens
        st = self._reqs.get(request.request_id)
        r = st.pending if st is not None else None
        if st is not None and r is not None and st.sources is not None:
            per_worker = [src or [] for src in st.sources]     # None: that lookup did not tell
            for b in range(r.start, r.end):
                if left <= 0:
                    break
                s = outermost([src[b] if b < len(src) else UNKNOWN for src in per_worker])
                n = min(self.block_tokens, left)
                out[s] = out.get(s, 0) + n
                left -= n
        if left > 0:
            out[UNKNOWN] = out.get(UNKNOWN, 0) + left
        return out

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated the request's pages (block_ids: all of them, in order)."""
        st = self._reqs.get(request.request_id)
        if st is None or st.skip:
            return
        st.saved = st.hit            # the store has these already; save the rest as vLLM computes it
        st.pending = None
        if num_external_tokens > 0 and st.plan is not None:
            start = st.plan[0]
            end = start + num_external_tokens // self.block_tokens
            st.pending = BlockRange(request.request_id, start, end, list(block_ids[start:end]))

    # -- each step -----------------------------------------------------------------------
    def build(self, so: Any, block_ids_of: Callable[[str], list[int]]) -> StepPlan:
        """The plan for the step `so` (vLLM's SchedulerOutput) describes."""
        plan, self._final = self._final, StepPlan()
        cached = so.scheduled_cached_reqs
        scheduled = {r.req_id for r in so.scheduled_new_reqs} | set(cached.req_ids)
        for rid in getattr(so, "preempted_req_ids", None) or ():
            st = self._reqs.get(rid)
            if st is not None:
                st.loading = None                # its pages are gone
                if rid not in scheduled:
                    st.pending = None
                # else: preempted and resumed in this same step (vLLM's reset_prefix_cache
                # preempts running requests and schedules them again at once): the load
                # after_alloc planned for its new pages stands; vLLM counts those tokens as
                # loaded, and dropping it left them uncomputed (wrong output).
        for r in so.scheduled_new_reqs:
            ids = r.block_ids[0] if r.block_ids else []
            self._step(plan, so, r.req_id, r.num_computed_tokens, lambda ids=ids: ids)
        for i, rid in enumerate(cached.req_ids):
            self._step(plan, so, rid, cached.num_computed_tokens[i], lambda rid=rid: block_ids_of(rid))
        return plan

    def _step(self, plan: StepPlan, so: Any, rid: str, computed: int, ids: Callable[[], list[int]]) -> None:
        st = self._reqs.get(rid)
        if st is None or st.skip:
            return
        if not st.sent:
            plan.new.append(NewRequest(rid, st.tokens, st.tag, st.session, st.ttl))
            st.sent = True
        if st.resync:
            plan.resync.append(rid)
            st.resync = False
        if st.pending is not None:
            plan.loads.append(st.pending)
            self.counters["load_blocks"] += st.pending.end - st.pending.start
            st.loading, st.pending = st.pending, None
        B = self.block_tokens
        full = (computed + so.num_scheduled_tokens.get(rid, 0)) // B       # blocks whose KV this step completes
        self._save(plan, st, rid, full, self._known(st.request), ids)

    def _save(self, plan: StepPlan, st: _Req, rid: str, full: int, known: Sequence[int],
              ids: Callable[[], list[int]]) -> bool:
        """Save the request's blocks [st.saved, full) whose tokens are `known`; whether any."""
        B = self.block_tokens
        if self.cfg.save_generated and full > st.n_blocks:
            # Generated tokens filled blocks: their ids are the request's (scheduled draft
            # tokens are not, and may be rejected: only tokens vLLM has accepted are keyed).
            grown = min(full, len(known) // B)
            if grown > st.n_blocks:
                plan.grown.append(Grown(rid, list(known[st.n_blocks * B: grown * B])))
                st.n_blocks = grown
        full = min(full, st.n_blocks)
        if full <= st.saved:
            return False
        pages = ids()
        plan.saves.append(BlockRange(rid, st.saved, full, list(pages[st.saved:full])))
        self.counters["save_blocks"] += full - st.saved
        st.saved = full
        return True

    def _known(self, request: Any) -> Sequence[int]:
        """The tokens of `request` vLLM has accepted so far. With asynchronous scheduling (vLLM's
        default on a GPU) a step is planned before the previous step's token is known, so the
        block that token completes is saved a step later (finish() saves a finished request's)."""
        return getattr(request, "all_token_ids", None) or ()

    def on_output(self, invalid_block_ids: set[int] | None) -> None:
        """Blocks that failed to load: vLLM recomputes from the first one; save them again."""
        if not invalid_block_ids:
            return
        for st in self._reqs.values():
            r = st.loading
            if r is None:
                continue
            bad = [j for j, p in enumerate(r.pages) if p in invalid_block_ids]
            if bad:
                uncount_cached(st.request, (r.start + bad[0]) * self.block_tokens)
                st.saved = min(st.saved, r.start + bad[0])
                st.resync = True
                st.loading = None
                self.counters["failed_loads"] += 1

    def finish(self, request: Any, block_ids: list[int]) -> bool:
        """vLLM finished `request` (`block_ids`: its pages of computed tokens). Whether vLLM must
        keep those pages until the workers report them sent: a block whose KV is computed but
        whose save would come a step later (asynchronous scheduling: the last step's token
        was not yet known when the step was planned) is saved in the next step instead of lost."""
        st = self._reqs.pop(request.request_id, None)
        if st is None or st.skip or not st.sent or not self.cfg.save_generated:
            return False
        # Tokens whose KV is computed: vLLM's own reckoning at this point (less any step still in flight).
        computed = int(request.num_computed_tokens) - int(getattr(request, "num_in_flight_tokens", 0) or 0)
        known = getattr(request, "all_token_ids", None) or ()
        if not self._save(self._final, st, request.request_id, computed // self.block_tokens, known,
                          lambda: list(block_ids)):
            return False
        self._final.final.append(request.request_id)
        self.counters["final_saves"] += 1
        return True

    def finished(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def uncount_cached(request: Any, cached: int) -> None:
    """A load failed and vLLM recomputes from token `cached` on: count only the tokens before
    it as cached. vLLM's RequestOutput.num_cached_tokens is the request's prefill statistics,
    fixed when the request was first scheduled (its own hit plus what the connector offered)
    and not lowered when it recomputes blocks a connector reported as failed; they are still
    the request's until its first output, which a failed load's step does not produce."""
    stats = getattr(request, "prefill_stats", None)
    if stats is None or stats.num_cached_tokens <= cached:
        return
    lost = stats.num_cached_tokens - cached
    stats.num_cached_tokens = cached
    stats.num_external_cached_tokens = max(0, stats.num_external_cached_tokens - lost)
    stats.num_computed_tokens += lost


def _ttl(value: Any, default: float) -> float:
    """A request's x-session-ttl (a client's value, read inside vLLM's engine core: one that
    raised there killed the engine for every request); anything but a finite number > 0 is
    the default, with a warning."""
    if value is None:
        return default
    try:
        ttl = float(value)
    except (TypeError, ValueError, OverflowError):
        ttl = math.nan
    if isinstance(value, bool) or not math.isfinite(ttl) or ttl <= 0:
        log.warning("kvtier: x-session-ttl %r is not a finite number of seconds > 0; using %g", value, default)
        return default
    return ttl
