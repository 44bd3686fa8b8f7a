"""LMCache's CPU path and kvtier's engine path on the same workload, in one process.

    /work/main/.venv/lmcache/bin/python bench/lmcache_compare.py [--requests 2 --prompt-tokens 4096 --repeat 5 --json]

Both sides move the same bytes between the same engine pages (vLLM format, one tensor per
layer [2, num_pages, page_tokens, kv_heads, head_dim], NHD, bf16, the requests' pages
scattered over twice as many) and host memory, each timed against a raw memcpy of the same
bytes run just before it, all ops round-robin so all see the same machine:

    kvtier   KVAdapter.save_from(...).wait() / load_into(...).wait(), a HostTier store,
             one kvtier block per engine page (kvtier bench adapter's path).
    lmcache  LMCacheEngine.store(tokens, kvcaches=, slot_mapping=) / .retrieve(...), built
             by LMCacheEngineBuilder with the local CPU backend, chunk_size 256.
             LMCache 0.5.6 has no vLLM connector for a CPU device (CreateGPUConnector raises
             "No supported cpu connector found"; VLLMPagedMemGPUConnectorV2 needs CUDA
             streams), so the connector below is glue that hands the pages to LMCache's
             own CPU kernel, lmcache.device_ops.multi_layer_kv_transfer (the torch fallback
             that VLLMPagedMemGPUConnectorV2 calls), with LMCache's own format discovery
             (kv_layout hint NHD: on a CPU LMCache otherwise assumes vLLM's CPU backend's HND).
    lmcache  (contiguous) the same engine with a KV tensor already in LMCache's memory format
             [2, layers, tokens, kv_heads*head_dim]: a chunk is one strided torch copy_ in the
             glue. Not an engine layout; it shows LMCache's engine cost without its kernel.

Ratios are paired (as in `kvtier bench`): a row's `ratio` is the median over the rounds of
(memcpy time / op time) in each round, with a 90% interval (`ratio_low`, `ratio_high`); a
kvtier row's `vs_lmcache` is the median of (LMCache's time / kvtier's time) for the same
move in the same round, with its interval (`vs_lmcache_low`, `vs_lmcache_high`).

Each request is its own call (--requests calls per timed op, --prompt-tokens tokens each).
Every repetition stores fresh tokens (new keys), and checks that every chunk/block was stored;
both caches hold the loaded set and two rounds of saves, so timed saves/stores evict (LRU).
Every retrieve/load checks that every token/block came back; bytes are compared exactly
once per page size for both systems. LMCache's store is synchronous on this path (the copy
happens in store(); the local CPU backend's put is a dict insert), so it needs no wait.
A retrieve is preceded, untimed, by lookup(pin=True) as LMCache's vLLM connector does.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")    # no usage telemetry from a benchmark
# LMCache logs every store/retrieve at INFO, and each allocation that must evict first at
# WARNING; the checks below catch what its warnings would say (a partial store or retrieve).
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

from kvtier.bench.adapter import page_sizes, add_arguments  # noqa: E402
from kvtier.bench.common import Column, Paired, emit, interval_column, quiet_threads  # noqa: E402

CHUNK = 256          # LMCache's default chunk_size
INSTANCE = "kvtier-lmcache-compare"


# -- timing --------------------------------------------------------------------------------

@dataclass
class Op:
    system: str
    op: str
    layout: str
    page_tokens: int | None
    chunk_tokens: int
    run: Callable[[], None]
    check: Callable[[], None]      # untimed, after each run: raises if the run moved less
    prepare: Callable[[], None] = lambda: None     # untimed, before each run


def round_robin(ops: list[Op], memcpy: Callable[[], None], repeat: int) -> list[list[tuple[float, float]]]:
    """Per op, (seconds of the memcpy of the same bytes run just before it, seconds of the op)
    in each timed round. Each round runs every op once (a memcpy before each), so all ops
    and their baselines share the machine's state; one untimed round first."""
    rounds: list[list[tuple[float, float]]] = [[] for _ in ops]
    for rnd in range(repeat + 1):
        for i, op in enumerate(ops):
            op.prepare()
            t0 = time.perf_counter()
            memcpy()
            t1 = time.perf_counter()
            op.run()
            t2 = time.perf_counter()
            op.check()
            if rnd:
                rounds[i].append((t1 - t0, t2 - t1))
    return rounds


def paired(base: list[float], op: list[float]) -> Paired:
    """The op against a baseline timed in the same rounds: medians, and the ratio of each
    round (baseline time / op time) whose median and 90% interval the rows report."""
    return Paired(statistics.median(op), statistics.median(base), tuple(b / a for b, a in zip(base, op)))


# -- LMCache -------------------------------------------------------------------------------

def lmcache_engine(args: argparse.Namespace, nbytes: int):
    from lmcache.utils import EngineType, mock_up_broadcast_fn, mock_up_broadcast_object_fn
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import CreateGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata

    # Room for the retrieved set and two rounds of stores, so a timed store evicts (LRU) as
    # a full cache does, as kvtier's host tier below does.
    gib = 3 * nbytes / 2**30 + 0.25
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=gib)
    metadata = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.bfloat16,
                               kv_shape=(args.layers, 2, CHUNK, args.kv_heads, args.head_dim))
    try:
        CreateGPUConnector(config, metadata, EngineType.VLLM)
        note = "LMCache's vLLM connector builds on this machine; this script still uses the CPU glue"
    except RuntimeError as e:
        note = f"CreateGPUConnector(VLLM) on this CPU: {e}"
    engine = LMCacheEngineBuilder.get_or_create(INSTANCE, config, metadata, _connector(args),
                                                mock_up_broadcast_fn, mock_up_broadcast_object_fn)
    engine.post_init()
    return engine, note


def _connector(args: argparse.Namespace):
    import lmcache.lmcache_native as native
    from lmcache import device_ops
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector import GPUConnectorInterface
    from lmcache.v1.gpu_connector.utils import (get_block_size, get_head_size, get_num_blocks,
                                                normalize_kv_and_discover_format)

    hidden = args.kv_heads * args.head_dim

    class CPUPagedConnector(GPUConnectorInterface):
        """kvcaches= (vLLM pages, one tensor per layer) + slot_mapping=: LMCache's CPU kernel
        moves each chunk. kv= (a [2, layers, tokens, hidden] tensor): one torch copy_."""

        def __init__(self) -> None:
            self._pages: tuple[int, Any] | None = None

        def _paged(self, kvcaches: list[torch.Tensor]) -> Any:
            if self._pages is None or self._pages[0] != kvcaches[0].data_ptr():
                fmt, kv = normalize_kv_and_discover_format(kvcaches, EngineType.VLLM, {"kv_layout": "NHD"})
                ptrs = torch.tensor([t.data_ptr() for t in kv], dtype=torch.int64)
                bs = get_block_size(kv, fmt)
                self._pages = (kvcaches[0].data_ptr(),
                               (fmt, ptrs, get_num_blocks(kv, fmt) * bs, bs, get_head_size(kv, fmt)))
            return self._pages[1]

        def _move(self, obj: Any, start: int, end: int, direction: Any, **kw: Any) -> None:
            if "kv" in kw:                                   # contiguous, LMCache's own format
                part = kw["kv"][:, :, start:end]
                if direction == native.TransferDirection.D2H:
                    obj.tensor.copy_(part)
                else:
                    part.copy_(obj.tensor)
                return
            fmt, ptrs, page_buffer, bs, hs = self._paged(kw["kvcaches"])
            device_ops.multi_layer_kv_transfer(obj.tensor, ptrs, kw["slot_mapping"][start:end],
                                               torch.device("cpu"), page_buffer, direction, fmt,
                                               block_size=bs, head_size=hs)

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            self._move(memory_obj, start, end, native.TransferDirection.D2H, **kw)

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            self._move(memory_obj, start, end, native.TransferDirection.H2D, **kw)

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for o, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(o, s, e, **kw)

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for o, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(o, s, e, **kw)

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, args.layers, num_tokens, hidden])

    return CPUPagedConnector()


def lmcache_ops(engine: Any, requests: list[tuple[torch.Tensor, dict]], layout: str,
                page_tokens: int | None) -> list[Op]:
    """Retrieve and store of every request. `requests`: (tokens, connector kwargs) each.

    A retrieve goes as in LMCache's vLLM connector: the scheduler's lookup(pin=True) first
    (untimed, as kvtier's lookup is not in load_into either; it also refreshes the chunks'
    LRU place, which a blocking retrieve alone does not), retrieve(req_id=) timed, then
    lookup_unpin."""
    rounds = [0]
    fresh: list[torch.Tensor] = []
    got: list[tuple[int, int]] = []
    ids = [f"bench-{i}" for i in range(len(requests))]

    def lookup() -> None:
        for rid, (tokens, _) in zip(ids, requests):
            n = engine.lookup(tokens, lookup_id=rid, pin=True)
            if n != len(tokens):
                raise AssertionError(f"LMCache holds {n} of {len(tokens)} tokens before a retrieve")

    def retrieve() -> None:
        got.clear()
        for rid, (tokens, kw) in zip(ids, requests):
            got.append((int(engine.retrieve(tokens, req_id=rid, **kw).sum()), len(tokens)))

    def retrieved() -> None:
        for rid in ids:
            engine.lookup_unpin(rid)
        for n, want in got:
            if n != want:
                raise AssertionError(f"LMCache retrieved {n} of {want} tokens")

    def store() -> None:             # fresh tokens each time: new keys, so every chunk is stored
        rounds[0] += 1
        fresh.clear()
        for tokens, kw in requests:
            t = tokens + rounds[0] * 1_000_003
            engine.store(t, **kw)
            fresh.append(t)

    def stored() -> None:
        for t in fresh:
            n = engine.lookup(t)
            if n != len(t):
                raise AssertionError(f"LMCache stored {n} of {len(t)} tokens")

    return [Op("lmcache", "retrieve", layout, page_tokens, CHUNK, retrieve, retrieved, lookup),
            Op("lmcache", "store", layout, page_tokens, CHUNK, store, stored)]


# -- one page size -------------------------------------------------------------------------

def paged_rows(args: argparse.Namespace, page_tokens: int, engine: Any, memcpy: Callable[[], None],
               nbytes: int) -> list[dict[str, Any]]:
    import kvtier
    from kvtier.adapter import KVAdapter
    from kvtier.transfer.pages import PagedKV

    P, R = args.prompt_tokens, args.requests
    per_req = P // page_tokens                        # pages (= kvtier blocks) per request
    n = R * per_req
    layout = kvtier.KVLayout.mha(args.layers, args.kv_heads, args.head_dim, page_tokens, torch.bfloat16)
    assert n * layout.block_bytes == nbytes
    g = torch.Generator().manual_seed(page_tokens)
    num_pages = 2 * n
    pages = [torch.randn(2, num_pages, page_tokens, args.kv_heads, args.head_dim, generator=g).to(torch.bfloat16)
             for _ in range(args.layers)]
    table = torch.randperm(num_pages, generator=g)[:n].reshape(n, 1)
    slots = (table * page_tokens + torch.arange(page_tokens)).reshape(-1)     # token -> slot

    # The same requests for both: request r is tokens r*P .. (r+1)*P-1 on pages table[r*per_req:...].
    req_tables = [table[r * per_req:(r + 1) * per_req] for r in range(R)]
    req_tokens = [torch.arange(P) + r * P for r in range(R)]
    lmc_requests = [(req_tokens[r], {"kvcaches": pages, "slot_mapping": slots[r * P:(r + 1) * P]})
                    for r in range(R)]

    paged = PagedKV(pages, layout, "vllm")
    # Room for two rounds of saves, so a timed save evicts (as a full store does), as in kvtier bench adapter.
    store = kvtier.Store(layout, [kvtier.HostTier(blocks=2 * n + 1)], kvtier.Namespace("bench-lmcache", "r1"))
    adapter = KVAdapter(store)
    try:
        load_keys = [adapter.keys(t) for t in req_tokens]
        for keys, tab in zip(load_keys, req_tables):
            adapter.save_from(keys, paged, tab).wait()
        engine.clear()
        for tokens, kw in lmc_requests:
            engine.store(tokens, **kw)
        _check_bytes(pages, table, engine, lmc_requests, adapter, paged, load_keys, req_tables)

        rounds = [0]
        saved: list[int] = []
        loaded: list[int] = []

        def save() -> None:          # fresh tokens each time: a save of blocks already cached does nothing
            rounds[0] += 1
            saved.clear()
            for t, tab in zip(req_tokens, req_tables):
                keys = adapter.keys(t + rounds[0] * 1_000_003)
                saved.append(adapter.save_from(keys, paged, tab).wait().blocks)

        def saved_all() -> None:
            if saved != [per_req] * R:
                raise AssertionError(f"kvtier saved {saved} blocks; expected {per_req} per request")

        def load() -> None:
            loaded.clear()
            for keys, tab in zip(load_keys, req_tables):
                loaded.append(adapter.load_into(keys, paged, tab).wait())

        def loaded_all() -> None:
            if loaded != [per_req] * R:
                raise AssertionError(f"kvtier loaded {loaded} blocks; expected {per_req} per request")

        lmc = lmcache_ops(engine, lmc_requests, "vllm pages", page_tokens)
        # Loads first in each round: saves evict the oldest saved blocks, never the loaded ones.
        ops = [lmc[0],
               Op("kvtier", "load_into", "vllm pages", page_tokens, page_tokens, load, loaded_all),
               lmc[1],
               Op("kvtier", "save_from", "vllm pages", page_tokens, page_tokens, save, saved_all)]
        return _rows(ops, round_robin(ops, memcpy, args.repeat), nbytes)
    finally:
        adapter.close()
        store.close()
        engine.clear()


def _check_bytes(pages: list[torch.Tensor], table: torch.Tensor, engine: Any, lmc_requests: list,
                 adapter: Any, paged: Any, load_keys: list, req_tables: list) -> None:
    """Zero the requests' pages, load them back with each system, compare with the originals."""
    used = table.reshape(-1)
    want = [p[:, used].clone() for p in pages]
    try:
        for system in ("lmcache", "kvtier"):
            for p in pages:
                p[:, used] = 0
            if system == "lmcache":
                for tokens, kw in lmc_requests:
                    engine.retrieve(tokens, **kw)
            else:
                for keys, tab in zip(load_keys, req_tables):
                    adapter.load_into(keys, paged, tab).wait()
            bad = [i for i, (p, w) in enumerate(zip(pages, want)) if not torch.equal(p[:, used], w)]
            if bad:
                raise AssertionError(f"{system}: layers {bad[:4]} differ from the saved bytes after a load")
    finally:
        for p, w in zip(pages, want):
            p[:, used] = w


def contiguous_rows(args: argparse.Namespace, engine: Any, memcpy: Callable[[], None],
                    nbytes: int) -> list[dict[str, Any]]:
    P, R = args.prompt_tokens, args.requests
    hidden = args.kv_heads * args.head_dim
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, args.layers, R * P, hidden, generator=g).to(torch.bfloat16)
    assert kv.numel() * kv.element_size() == nbytes
    requests = [(torch.arange(P) + r * P, {"kv": kv[:, :, r * P:(r + 1) * P]}) for r in range(R)]
    try:
        engine.clear()
        for tokens, kw in requests:
            engine.store(tokens, **kw)
        want = kv.clone()
        kv.zero_()
        for tokens, kw in requests:
            engine.retrieve(tokens, **kw)
        if not torch.equal(kv, want):
            raise AssertionError("lmcache (contiguous): bytes differ after a retrieve")
        del want
        ops = lmcache_ops(engine, requests, "contiguous", None)
        return _rows(ops, round_robin(ops, memcpy, args.repeat), nbytes)
    finally:
        engine.clear()


def _rows(ops: list[Op], rounds: list[list[tuple[float, float]]], nbytes: int) -> list[dict[str, Any]]:
    """One row per op: GB/s, its paired ratio to memcpy with the interval, and for a kvtier op
    its paired speed-up over the LMCache op doing the same move (same rounds)."""
    times = {(op.system, op.op): [t for _, t in r] for op, r in zip(ops, rounds)}
    rows = []
    for op, r in zip(ops, rounds):
        p = paired([c for c, _ in r], [t for _, t in r])
        row = {"bench": "lmcache_compare", "system": op.system, "op": op.op, "layout": op.layout,
               "page_tokens": op.page_tokens, "chunk_tokens": op.chunk_tokens,
               "mib": round(nbytes / 2**20, 1), "gbps": round(nbytes / p.a / 1e9, 3),
               "memcpy_gbps": round(nbytes / p.b / 1e9, 3),
               **{k: round(v, 3) for k, v in p.fields().items()}}
        rival = times.get(("lmcache", PEER_OP.get(op.op, "")))
        if op.system == "kvtier" and rival is not None:
            vs = paired(rival, times[(op.system, op.op)])        # LMCache's time / kvtier's, round by round
            row.update(vs_lmcache=round(vs.ratio, 3), vs_lmcache_low=round(vs.low, 3),
                       vs_lmcache_high=round(vs.high, 3))
        rows.append(row)
    return rows


PEER_OP = {"save_from": "store", "load_into": "retrieve"}     # kvtier's op -> LMCache's doing the same move


# -- main ----------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    p.set_defaults(page_tokens="256,16")
    p.add_argument("--no-contiguous", action="store_true",
                   help="skip LMCache on a contiguous KV tensor (its own memory format)")
    args = p.parse_args()
    if args.device not in (None, "cpu"):         # add_arguments is kvtier bench adapter's, which has a GPU path
        p.error(f"--device {args.device}: this comparison runs on the CPU only (LMCache's CPU path)")
    quiet_threads()                                   # torch.set_num_threads(1); all on the CPU
    from kvtier.tiers.memory import allocate_host

    sizes = page_sizes(args.page_tokens)
    for pt in sizes:
        if args.prompt_tokens % CHUNK or args.prompt_tokens % pt:
            p.error(f"--prompt-tokens {args.prompt_tokens} must be a multiple of LMCache's chunk ({CHUNK}) "
                    f"and of each page size ({pt})")
    token_bytes = 2 * args.layers * args.kv_heads * args.head_dim * 2       # K and V, bf16
    nbytes = args.requests * args.prompt_tokens * token_bytes

    def say(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    import lmcache
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    say(f"LMCache {lmcache.__version__}, torch {torch.__version__}, {torch.get_num_threads()} torch thread; "
        f"{args.requests} requests x {args.prompt_tokens} tokens = {nbytes / 2**20:.0f} MiB a move")
    src, dst = allocate_host(nbytes), allocate_host(nbytes)
    src.tensor[:] = 1

    def memcpy() -> None:
        dst.tensor.copy_(src.tensor)

    engine, note = lmcache_engine(args, nbytes)
    say(note)
    rows: list[dict[str, Any]] = []
    try:
        for pt in sizes:
            say(f"{pt}-token pages ...")
            rows += paged_rows(args, pt, engine, memcpy, nbytes)
        if not args.no_contiguous:
            say("LMCache on a contiguous KV tensor ...")
            rows += contiguous_rows(args, engine, memcpy, nbytes)
    finally:
        LMCacheEngineBuilder.destroy(INSTANCE)        # its threads keep the process alive otherwise
        src.close()
        dst.close()

    emit(rows, args.json, f"LMCache CPU path vs kvtier engine path, {nbytes / 2**20:.0f} MiB a move, vs a raw "
         "memcpy of the same bytes (higher GB/s is better)",
         ["system", "op", "layout", Column("page_tokens", "page"), Column("chunk_tokens", "chunk"),
          Column("gbps", "GB/s"), Column("memcpy_gbps", "memcpy"), "ratio", interval_column(),
          Column("vs_lmcache", "vs LMCache")])
    summary = _summary(rows)
    if args.json:
        import json
        print(json.dumps({"bench": "lmcache_compare", "summary": summary}))
    else:
        for line in summary:
            print(line)
    return 0


def _summary(rows: list[dict[str, Any]]) -> list[str]:
    """kvtier against LMCache (vLLM pages) per op and page size: GB/s, memcpy ratio, and the
    paired speed-up with its 90% interval."""
    pick = {(r["system"], r["op"], r["layout"], r["page_tokens"]): r for r in rows}
    out = []
    for kv_op, lmc_op in PEER_OP.items():
        for (system, op, layout, pt), k in pick.items():
            if system != "kvtier" or op != kv_op or "vs_lmcache" not in k:
                continue
            m = pick[("lmcache", lmc_op, "vllm pages", pt)]
            out.append(f"{kv_op} vs {lmc_op}, {pt}-token pages: kvtier {k['gbps']:.2f} GB/s "
                       f"({k['ratio']:.2f}x memcpy) vs LMCache {m['gbps']:.2f} GB/s ({m['ratio']:.2f}x memcpy): "
                       f"kvtier {k['vs_lmcache']:.2f}x LMCache "
                       f"(90% interval {k['vs_lmcache_low']:.2f}-{k['vs_lmcache_high']:.2f})")
    return out


if __name__ == "__main__":
    sys.exit(main())
