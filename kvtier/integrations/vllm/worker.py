"""The worker side of the connector: one kvtier Store per worker (per tensor-parallel rank)
behind a KVAdapter; loads into vLLM's pages and saves from them are the adapter's
engine-owned-pages calls (load_into / save_from).

Per step (vLLM calls in this order):

    ingest(plan)        key the step's new requests (kvtier's chain over their token ids),
                        pin their sessions
    start_load(plan)    adapter.load_into per request: returns at once; the adapter's loader
                        thread reads the cached blocks (verified) and scatters them into
                        vLLM's pages layer after layer
    wait_layer(name)    the forward pass waits for that layer only, then computes it
    end_step(plan)      every load finished: blocks past a load's `loaded` are reported to
                        vLLM (load_errors) and recomputed; the step's newly full blocks are
                        gathered (adapter.save_from) and a saver thread puts them into the store

The store is served by a kvtier Node (loopback by default) so that the scheduler-side
connector, in another process, can ask it how long a prefix it holds; the same node
serves other kvtier nodes when a cluster secret and a listen address are configured.
"""
from __future__ import annotations

import logging
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from kvtier.adapter import KVAdapter, EnginePagesLoad, EnginePagesSave
from kvtier.errors import ConfigError, KvtierError, TierInUseError
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.pages import KVSpec, VllmPages, describe_caches
from kvtier.integrations.vllm.plan import BlockRange, StepPlan, request_keys
from kvtier.keys import BlockKeys, Namespace, chain_keys
from kvtier.net.address import parse_address
from kvtier.store import Store, close_at_exit

log = logging.getLogger("kvtier.vllm")

# Workers in this process by node address: a scheduler in the same process (vLLM's
# single-process mode) asks the store directly instead of over loopback TCP.
LOCAL: dict[str, "WorkerSide"] = {}



@dataclass
class _StepLoad:
    """One step's loads (None: the request's keys were unknown), and what failed."""

    loads: list[tuple[BlockRange, EnginePagesLoad | None]]
    failed: dict[str, int] = field(default_factory=dict)       # req_id -> first block that did not load
    failed_pages: set[int] = field(default_factory=set)

    def fail(self, r: BlockRange, loaded: int) -> None:
        self.failed[r.req_id] = min(self.failed.get(r.req_id, r.end), r.start + loaded)
        self.failed_pages.update(r.pages[loaded:])


class WorkerSide:
    """Owns the store, its node and the copiers of one vLLM worker."""

    def __init__(self, cfg: ConnectorConfig, model: str, revision: str, rank: int, world: int,
                 sync_failures: Callable[[list[int]], list[int]] | None = None) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.namespace = Namespace(model=cfg.model or model, revision=revision if cfg.revision is None else cfg.revision,
                                   shard=f"tp{rank}/{world}", salt=cfg.salt)
        self.sync_failures = sync_failures      # TP > 1: OR of per-load failure flags across ranks
        self.store: Store | None = None
        self.adapter: KVAdapter | None = None
        self.pages: VllmPages | None = None
        self.node: Any = None
        self.address = ""
        self.secret = cfg.secret or os.urandom(32)
        self._chains: dict[str, BlockKeys] = {}    # req_id -> keys of its full blocks (prompt, then generated)
        self._sessions: dict[str, tuple[str, float]] = {}   # req_id -> (session, ttl) of a pinned request
        self._sent: set[str] = set()            # finished requests whose last save has read their pages
        self._tainted: dict[str, int] = {}      # req_id -> first block computed over a failed load
        self._errors: set[int] = set()
        self._load: _StepLoad | None = None
        self._saver_thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-save")
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self.counters = {"load_blocks": 0, "load_failed_blocks": 0, "save_blocks": 0, "save_new_blocks": 0,
                         "save_dropped_blocks": 0, "save_skipped_blocks": 0, "save_errors": 0, "final_saves": 0}
        self._closed = False

    # -- setup ---------------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, torch.Tensor], spec: KVSpec, layer_names: list[str] | None) -> None:
        """vLLM's caches are known: derive the layout, open the store, start the node."""
        from kvtier.net import Node, RedisDirectory

        self.pages = describe_caches(kv_caches, spec, layer_names)
        layout = self.pages.layout
        cfg = self.cfg
        try:
            self.store = cfg.store.build(layout, self.namespace, remote=cfg.build_remote(self.rank),
                                         subdir=self.disk_subdir(layout))
        except TierInUseError as e:
            raise ConfigError(f"{e}. Two live vLLM instances cannot share one disk tier: give each its own "
                              "disk_path and let them fetch from each other's node (listen + peers + secret_file, "
                              "see docs/vllm.md); instances that run one after another may share it") from None
        self.adapter = KVAdapter(self.store)
        host, port = parse_address(cfg.listen)
        listen = f"{host}:{port + self.rank if port else 0}"
        directory = self.store.remote.directory if self.store.remote is not None else None
        try:
            self.node = Node(self.store, listen, self.secret, advertise=cfg.advertise, transport=cfg.transport,
                             directory=directory if isinstance(directory, RedisDirectory) else None).start()
        except BaseException:    # (a port in use) the store made above must not keep its disk lock and memory
            self.adapter.close()
            self.store.close()
            raise
        self.address = self.node.address
        LOCAL[self.address] = self
        close_at_exit(self)      # at exit, before the store: stop the node and the savers first
        log.info("kvtier: store for %s (%s), node %s, recovered %d blocks", self.namespace.model,
                 layout.describe(), self.address, self.store.recovered)

    def disk_subdir(self, layout: Any) -> str:
        """Where under disk_path this store lives: one directory per namespace (model,
        revision, rank, layout), since a disk tier holds one namespace and one process."""
        seed = self.namespace.seed(layout, self.cfg.store.hash).hex()[:16]
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", self.namespace.model).strip("_")[-48:] or "model"
        return f"{slug}-{seed}"

    def handshake(self) -> dict[str, Any] | None:
        """What the scheduler-side connector needs to look prefixes up in this worker's store
        (None before vLLM registered its caches: the scheduler then finds no hits)."""
        if self.store is None:
            return None
        return {"address": self.address, "secret": self.secret, "seed": self.store.keyer.seed,
                "hash": self.cfg.store.hash, "block_tokens": self.store.layout.block_tokens, "rank": self.rank,
                "pid": os.getpid(), "remote_timeout": self.store.remote.timeout if self.store.remote else None,
                "tiers": [t.kind for t in self.store.tiers]}     # (vLLM's per-source hit metric)

    # -- per step ------------------------------------------------------------------------
    def ingest(self, plan: StepPlan) -> None:
        """Key the step's new requests; let resynced requests save again."""
        assert self.store is not None and self.adapter is not None
        bt, seed, h = self.store.layout.block_tokens, self.store.keyer.seed, self.cfg.store.hash
        for r in plan.new:
            self._chains[r.req_id] = request_keys(r.token_ids, bt, seed, h, r.tag)
            if r.session:
                self._sessions[r.req_id] = (r.session, r.ttl)
                self._pin(r.req_id)
        for g in plan.grown:                 # generated tokens filled blocks: continue the chain
            chain = self._chains.get(g.req_id)
            if chain is not None:            # (empty for a prompt shorter than a block: its root)
                self._chains[g.req_id] = chain + chain_keys(g.token_ids, bt, chain.last, h, start=len(chain),
                                                            origin=chain.origin)
                self._pin(g.req_id)          # the answer's blocks are the session's next prompt
        for rid in plan.resync:
            self._tainted.pop(rid, None)

    def _pin(self, req_id: str) -> None:
        """Pin a session request's chain so far (its prompt, then the blocks its answer
        fills). Keys not cached yet are protected when they arrive; the session's next
        request replaces the pin with its own, longer chain (a pin that a chain extends
        only adds the new keys)."""
        session = self._sessions.get(req_id)
        keys = self._chains.get(req_id)
        if session is None or not keys:
            return
        assert self.adapter is not None
        try:       # in the host tier: vLLM's pages are not in the store
            self.adapter.pin(session[0], keys, session[1], tier=0)
        except KvtierError as e:
            log.warning("kvtier: pinning session %r failed: %s", session[0], e)

    def start_load(self, plan: StepPlan) -> None:
        """Start this step's loads (adapter.load_into: read and scatter on its loader thread)."""
        if not plan.loads or self.pages is None or self.adapter is None:
            return
        if self._load is not None:           # a previous step's load that nobody finished
            self._finish_load()
        loads: list[tuple[BlockRange, EnginePagesLoad | None]] = []
        for r in plan.loads:
            chain, load = self._chains.get(r.req_id), None
            if chain is not None and len(chain) >= r.end:
                try:
                    load = self.adapter.load_into(chain[r.start:r.end], self.pages.paged, [[p] for p in r.pages])
                except KvtierError as e:     # a bad plan: never use it, vLLM recomputes
                    log.error("kvtier: cannot load blocks %d..%d of request %s, vLLM will recompute them: %s",
                              r.start, r.end, r.req_id, e)
            loads.append((r, load))
        self._load = _StepLoad(loads)

    def wait_layer(self, layer_name: str) -> None:
        """Block until this step's loads have put layer `layer_name` in place (GPU: the stream waits)."""
        step, pages = self._load, self.pages
        if step is None or pages is None:
            return
        i = pages.layer_index(layer_name)
        if i is None:
            return
        for _, load in step.loads:
            if load is not None:
                load.wait_for_layer(i)

    def _finish_load(self) -> None:
        step, self._load = self._load, None
        if step is None:
            return
        for r, load in step.loads:               # layers no attention call waited for, and the outcome
            got = load.wait() if load is not None else 0
            if load is not None and load.error is not None:
                log.error("kvtier: loading blocks %d..%d of request %s failed, vLLM will recompute them: %s",
                          r.start, r.end, r.req_id, load.error)
            if got < r.end - r.start:
                step.fail(r, got)
            self.counters["load_blocks"] += got
        if self.sync_failures is not None and self.world > 1:
            # Another rank's failed block feeds this rank's later KV too (through the all-reduce).
            flags = self.sync_failures([1 if r.req_id in step.failed else 0 for r, _ in step.loads])
            for (r, _), f in zip(step.loads, flags):
                if f and r.req_id not in step.failed:
                    step.failed[r.req_id] = r.start
        for rid, first in step.failed.items():
            self._tainted[rid] = min(self._tainted.get(rid, first), first)
        self.counters["load_failed_blocks"] += len(step.failed_pages)
        self._errors |= step.failed_pages

    def end_step(self, plan: StepPlan) -> None:
        """After the forward: settle the step's loads, then save its newly full blocks."""
        try:
            self._finish_load()
            self._save(plan)
        finally:     # whatever happened to their saves: vLLM frees their pages once told
            self._sent.update(plan.final)
            self.counters["final_saves"] += len(plan.final)

    def sent(self) -> set[str]:
        """Finished requests whose pages vLLM may free now (their last save read them)."""
        out, self._sent = self._sent, set()
        return out

    def _save(self, plan: StepPlan) -> None:
        if not plan.saves or self.pages is None or self.adapter is None:
            return
        paged, bb = self.pages.paged, self.pages.layout.block_bytes
        for r in plan.saves:
            chain = self._chains.get(r.req_id)
            n = r.end - r.start
            if chain is None or len(chain) < r.end or n <= 0:
                continue
            if r.req_id in self._tainted:        # computed over KV that failed to load: never store it
                self.counters["save_skipped_blocks"] += n
                continue
            with self._lock:
                if self._pending_bytes + n * bb > self.cfg.max_pending_save:
                    self.counters["save_dropped_blocks"] += n
                    continue
                self._pending_bytes += n * bb
            # A slice of the chain: the store refreshes the prefix's blocks too.
            save = self.adapter.save_from(chain[r.start:r.end], paged, [[p] for p in r.pages])
            save.wait_for_pages()                # vLLM may reuse the pages after this
            self._saver_thread.submit(self._put, r, save, n * bb)

    def _put(self, r: BlockRange, save: EnginePagesSave, nbytes: int) -> None:
        try:
            t = save.wait()                      # into the store
            self.counters["save_blocks"] += r.end - r.start
            self.counters["save_new_blocks"] += t.blocks
        except Exception as e:      # a failed save is a future miss, never an engine error
            self.counters["save_errors"] += 1
            log.warning("kvtier: saving %d block(s) of request %s failed: %s", r.end - r.start, r.req_id, e)
        finally:
            with self._lock:
                self._pending_bytes -= nbytes

    def load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (vLLM recomputes them)."""
        out, self._errors = self._errors, set()
        return out

    def finished(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self._chains.pop(rid, None)
            self._sessions.pop(rid, None)
            self._tainted.pop(rid, None)

    def drain(self) -> None:
        """Wait until every submitted save is in the store (tests, benchmarks, shutdown)."""
        self._saver_thread.submit(lambda: None).result()

    def close(self) -> None:
        """Finish pending saves, stop the node, close the store (flushing the disk tier)."""
        if self._closed:
            return
        self._closed = True
        self.sync_failures = None                # no collective at shutdown: ranks close at different times
        try:
            self._finish_load()
        except Exception:
            pass
        self._saver_thread.shutdown(wait=True)
        if self.node is not None:
            LOCAL.pop(self.address, None)
            self.node.stop()
        if self.adapter is not None:
            self.adapter.close()
        if self.store is not None:
            log.info("kvtier: closing the store (%s)", self.counters)
            self.store.close()
