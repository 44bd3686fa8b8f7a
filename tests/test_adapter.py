"""The engine adapter: pages in the device tier (allocate, load in place or from lower
tiers, verified, cache, free) and pages the engine owns (load_into / save_from)."""
from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings, strategies as hst

import kvtier
from kvtier.adapter import KVAdapter
from kvtier.errors import TransferError
from kvtier.pool import PagePool
from kvtier.transfer.pages import ChunkPlan, PagedKV
from kvtier.transfer.streams import LayerLoader

LAYOUT = kvtier.KVLayout.mla(num_layers=3, kv_lora_rank=16, rope_dim=8, block_tokens=4, dtype=torch.float32)
NS = kvtier.Namespace(model="adapter-test", revision="r1")
BB = LAYOUT.block_bytes


def make(device_blocks: int = 8, host_blocks: int | None = 16, disk=None) -> KVAdapter:
    tiers: list = [kvtier.DeviceTier(blocks=device_blocks, device="cpu")]
    if host_blocks:
        tiers.append(kvtier.HostTier(blocks=host_blocks))
    if disk is not None:
        tiers.append(kvtier.DiskTier(disk, blocks=32))
    return KVAdapter(kvtier.Store(LAYOUT, tiers, NS, promote=False))


def fill(a: KVAdapter, slots: list[int], tag: int) -> list[torch.Tensor]:
    """Write distinct bytes into pages `slots` (as an engine's forward pass would)."""
    pool = a.pool()
    out = []
    for j, s in enumerate(slots):
        pool[s] = torch.full(LAYOUT.block_shape, float(tag * 100 + j))
        out.append(pool[s].clone())
    return out


def compute(a: KVAdapter, tokens: list[int], tag: int) -> tuple[kvtier.BlockKeys, list[int], list[torch.Tensor]]:
    """Allocate pages for `tokens`' full blocks, write them, cache them; returns keys, pages, bytes."""
    keys = a.keys(tokens)
    slots = a.allocate(len(keys))
    assert slots is not None
    data = fill(a, slots, tag)
    assert a.cache(keys, slots) == len(keys)
    return keys, slots, data


def test_a_device_hit_is_used_in_place():
    a = make()
    tokens = list(range(17))                       # 4 full blocks + 1 token
    keys, slots, data = compute(a, tokens, 1)
    a.free(slots)                                  # the request that computed them finished
    match = a.lookup(tokens)
    assert (match.blocks, match.tokens, match.tiers) == (4, 16, ["device"] * 4)
    load = a.load(match)
    assert load.pages == slots and load.cached == 4 and not load.copies
    assert load.from_tiers == {"device": 4}
    for s, d in zip(load.pages, data):
        assert torch.equal(a.pool()[s], d)
    # Referenced: filling the device tier with other work cannot evict them.
    assert a.allocate(4) is not None
    assert a.allocate(1) is None
    a.free(load.pages)
    assert a.allocate(1) is not None               # now one of them can go (to the host tier)


def test_a_host_hit_is_copied_into_pages_then_cached():
    a = make(device_blocks=4)
    tokens = list(range(16))
    keys, slots, data = compute(a, tokens, 2)
    a.free(slots)
    other, pages, _ = compute(a, list(range(100, 116)), 3)   # pushes the first prompt down to host
    a.free(pages)
    match = a.lookup(tokens)
    assert match.tiers == ["host"] * 4
    load = a.load(match)
    assert load.blocks == 4 and load.cached == 0 and load.from_tiers == {"host": 4}
    for l in range(LAYOUT.num_layers):
        load.wait_for_layer(l)
    for s, d in zip(load.pages, data):
        assert torch.equal(a.pool()[s], d)
    assert a.lookup(tokens).tiers == ["host"] * 4   # not cached in the device tier until cache()
    assert a.cache(load.keys, load.pages) == 4
    assert a.lookup(tokens).tiers == ["device"] * 4
    a.free(load.pages)


def _head_in_host_tail_in_pages(a: KVAdapter) -> tuple[list[int], list[torch.Tensor]]:
    """8 blocks of tokens: the first 4 in host memory, the last 4 in every page (of 4); the
    tokens and the head's bytes."""
    tokens = list(range(32))
    head, head_pages, head_data = compute(a, tokens[:16], 1)
    a.free(head_pages)
    keys = a.keys(tokens)
    tail_pages = a.allocate(4)                     # the head goes down to host memory
    fill(a, tail_pages, 2)
    assert a.cache(keys[4:], tail_pages) == 4
    a.free(tail_pages)
    assert a.lookup(tokens).tiers == ["host"] * 4 + ["device"] * 4
    return tokens, head_data


def test_a_load_whose_shorter_plan_fails_holds_nothing(monkeypatch):
    """A failure while the prefix is rebuilt shorter (a page's eviction failed) held the blocks
    acquired so far for good, and counted them as hits."""
    a = make(device_blocks=4)
    tokens, _ = _head_in_host_tail_in_pages(a)
    real, calls = PagePool._allocate, []

    def failing(self, n):
        calls.append(n)
        if len(calls) == 3:                            # the plan's first try, one page, then this one
            raise TransferError("demotion failed")
        return real(self, n)
    monkeypatch.setattr(PagePool, "_allocate", failing)
    with pytest.raises(TransferError):
        a.load(a.lookup(tokens))
    monkeypatch.undo()
    stats = a.store.stats()
    assert stats.tier("host").hits == 0 and stats.tier("device").hits == 0
    assert a.store.pages.owned() == set()
    assert a.allocate(4) is not None                   # nothing stays held or owned
    a.close()


@pytest.mark.parametrize("backup_busy", [False, True])
def test_a_prefix_whose_tail_fills_the_pages_loads_its_head(monkeypatch, backup_busy):
    """The head of a prefix in host memory, its tail in every page: the load lets the tail go
    to make pages for the head (it loaded nothing, every time); the prefix ends where the
    pages run out, and every page holds its block's bytes. backup_busy: a backup pass was
    copying as the load was planned, so it was planned again once the pass ended; the first
    plan's blocks were counted as hits twice (a flaky failure under load)."""
    a = make(device_blocks=4)
    tokens, head_data = _head_in_host_tail_in_pages(a)
    match = a.lookup(tokens)
    if backup_busy:
        assert a.store.backup is not None
        busy = iter([True])
        monkeypatch.setattr(type(a.store.backup), "copying", property(lambda self: next(busy, False)))
    load = a.load(match)
    load.wait()
    assert load.blocks == 4 and load.from_tiers == {"host": 4}
    for s, d in zip(load.pages, head_data):
        assert torch.equal(a.pool()[s], d)
    a.free(load.pages)
    stats = a.store.stats()
    if backup_busy:
        assert next(busy, None) is None                     # the plan did meet the busy pass
    assert stats.tier("device").hits == 0                   # no device block was served
    assert stats.tier("host").hits == 4                     # each head block, once
    match = a.lookup(tokens[:20])                          # the tail went down too, and reads back
    assert match.blocks == 5
    load = a.load(match)
    load.wait()
    assert load.blocks == 4 and torch.equal(a.pool()[load.pages[0]], head_data[0])
    a.free(load.pages)
    assert a.allocate(4) is not None                       # nothing stays referenced


def test_two_threads_with_two_engines_pages_share_one_adapter(monkeypatch):
    """Each call with another PagedKV replaces the adapter's loader; the one a thread chose
    was closed before it queued its load (RuntimeError: cannot schedule new futures after
    shutdown). Now every load lands, and close() leaves no loader thread."""
    import threading
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    a = KVAdapter(store)
    keys = a.keys(list(range(LAYOUT.block_tokens)))
    engines = [[torch.zeros(3, *LAYOUT.block_shape[1:]) for _ in range(LAYOUT.num_layers)] for _ in range(2)]
    for l in range(LAYOUT.num_layers):
        engines[0][l][0] = 7.0 + l
    paged = [PagedKV.of_pages(e, LAYOUT, 3) for e in engines]
    a.save_from(keys, paged[0], [[0]]).wait()
    errors: list[BaseException] = []
    real = LayerLoader.load_held

    def slow(self, *args, **kw):            # widen the window between choosing a loader and using it
        time.sleep(0.002)
        return real(self, *args, **kw)
    monkeypatch.setattr(LayerLoader, "load_held", slow)

    def run(p):
        try:
            for _ in range(100):
                assert a.load_into(keys, p, [[2]]).wait() == 1
        except BaseException as e:          # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(p,)) for p in paged]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    for e in engines:
        assert all(torch.equal(e[l][2], engines[0][l][0]) for l in range(LAYOUT.num_layers))
    a.close()
    store.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvtier-load")]


def test_a_host_hit_lands_as_one_run_of_slots_into_one_run_of_pages(monkeypatch):
    """A chain's host slots ascend in chain order (session 16); the pages a load allocates
    came from evicting the last request's blocks tail-first, so they descended, and every
    block was a copy of its own (one DMA per block and layer group on a GPU). Now both
    ascend: one run."""
    from kvtier.transfer.runs import runs
    seen = []
    real = KVAdapter._copy_lower

    def spy(self, plan, tier):
        seen.append(runs([s for _, s in plan.store_locs], [plan.pages[i] for i in plan.lower]))
        return real(self, plan, tier)
    monkeypatch.setattr(KVAdapter, "_copy_lower", spy)
    a = make(device_blocks=8, host_blocks=32)
    for round_ in range(3):
        tokens = [round_ * 1000 + t for t in range(8 * LAYOUT.block_tokens)]
        keys, pages, data = compute(a, tokens, 10 + round_)
        a.free(pages)
        _, other, _ = compute(a, [t + 500 for t in tokens], 20 + round_)   # pushes it down
        a.free(other)
        match = a.lookup(tokens)
        assert match.tiers == ["host"] * 8
        load = a.load(match)
        load.wait()
        assert load.blocks == 8 and len(seen[-1]) == 1, seen[-1]
        for p, d in zip(load.pages, data):
            assert torch.equal(a.pool()[p], d)
        a.cache(load.keys, load.pages)
        a.free(load.pages)


def test_caching_a_block_someone_cached_first_keeps_the_page_private():
    a = make()
    tokens = list(range(8))
    keys, slots, _ = compute(a, tokens, 4)
    again = a.allocate(2)
    assert a.cache(keys, again) == 0               # already cached: the pages stay the caller's
    assert set(again) <= a.store.pages.owned()
    a.free(again)
    a.free(slots)
    assert a.store.stats().tiers[0].used_blocks == 2


def test_a_corrupt_disk_block_ends_the_prefix(tmp_path):
    a = make(device_blocks=4, host_blocks=None, disk=tmp_path / "kv")
    tokens = list(range(16))
    keys, slots, data = compute(a, tokens, 5)
    a.free(slots)
    other, pages, _ = compute(a, list(range(200, 216)), 6)   # the first prompt goes to disk
    a.free(pages)
    assert a.lookup(tokens).tiers == ["disk"] * 4
    disk = a.store.tiers[1]
    slot = a.store.index.entries[keys[2]].slot
    with open(tmp_path / "kv" / "slab.bin", "r+b") as f:
        f.seek(slot * disk.slot_bytes + 10)
        b = f.read(1)
        f.seek(slot * disk.slot_bytes + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    load = a.load(a.lookup(tokens))
    assert load.blocks == 2                        # blocks 0-1 good; the engine computes from block 2
    load.wait()                                    # the copies run on the loader's thread
    for s, d in zip(load.pages, data[:2]):
        assert torch.equal(a.pool()[s], d)
    assert a.store.pages.owned() == set(load.pages)   # the pages of blocks 2-3 went back
    a.cache(load.keys, load.pages)
    a.free(load.pages)
    assert a.lookup(tokens).blocks == 2


def test_pages_the_engine_owns_round_trip():
    a = KVAdapter(kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=16)], NS))
    pages = [torch.randn(10, 4, 24) for _ in range(LAYOUT.num_layers)]   # [pages, page_tokens, 16 + 8]
    paged = PagedKV(pages, LAYOUT, "mla")
    tokens = list(range(12))
    keys = a.keys(tokens)
    save = a.save_from(keys, paged, [[7], [2], [5]])
    save.wait_for_pages()
    assert save.wait().blocks == 3
    dst = [torch.zeros(10, 4, 24) for _ in range(LAYOUT.num_layers)]
    got = a.load_into(keys, PagedKV(dst, LAYOUT, "mla"), [[0], [1], [9]])
    for l in range(LAYOUT.num_layers):
        got.wait_for_layer(l)
        for src, d in ((7, 0), (2, 1), (5, 9)):
            assert torch.equal(dst[l][d], pages[l][src])
    assert got.loaded == 3
    assert torch.count_nonzero(dst[0][3]) == 0     # pages no block names are untouched
    miss = a.load_into(a.keys(list(range(50, 62))), PagedKV(dst, LAYOUT, "mla"), [[0], [1], [2]])
    assert miss.loaded == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU machine, see docs/gpu.md")
@pytest.mark.parametrize("path", ["layer by layer", "grouped layers", "whole rows first"])
def test_on_a_gpu_pages_the_engine_owns_round_trip(path, monkeypatch):
    """save_from GPU pages -> the pinned host tier -> load_into other GPU pages, byte-exact,
    by 2D DMAs of one layer or of two (streams.layer_groups) and by the whole-rows fallback
    (fragmented slots)."""
    from kvtier.transfer import streams
    if path == "whole rows first":
        monkeypatch.setattr(streams, "MAX_LAYER_COPIES", 0)
    monkeypatch.setattr(streams, "MIN_DMA_ROW", LAYOUT.layer_bytes * (2 if path == "grouped layers" else 1))
    a = KVAdapter(kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=16)], NS))
    pages = [torch.randn(10, 4, 24, device="cuda") for _ in range(LAYOUT.num_layers)]
    keys = a.keys(list(range(12)))
    assert a.save_from(keys, PagedKV(pages, LAYOUT, "mla"), [[7], [2], [5]]).wait().blocks == 3
    dst = [torch.zeros(10, 4, 24, device="cuda") for _ in range(LAYOUT.num_layers)]
    got = a.load_into(keys, PagedKV(dst, LAYOUT, "mla"), [[0], [1], [9]])
    for l in range(LAYOUT.num_layers):
        got.wait_for_layer(l)
    got.wait()
    assert got.loaded == 3
    for l in range(LAYOUT.num_layers):
        for src, d in ((7, 0), (2, 1), (5, 9)):
            assert torch.equal(dst[l][d], pages[l][src])
        assert torch.count_nonzero(dst[l][3]) == 0
    a.close()


def _engine_pages_with_cached(n_pages: int = 10) -> tuple[KVAdapter, list[torch.Tensor], kvtier.BlockKeys]:
    """A host-tier adapter holding 3 blocks saved from random engine pages 7, 2, 5."""
    a = KVAdapter(kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=16)], NS))
    pages = [torch.randn(n_pages, 4, 24) for _ in range(LAYOUT.num_layers)]
    keys = a.keys(list(range(12)))
    a.save_from(keys, PagedKV(pages, LAYOUT, "mla"), [[7], [2], [5]]).wait()
    return a, pages, keys


def test_load_into_reads_and_copies_off_the_callers_thread(monkeypatch):
    """load_into returns before the store read; wait_for_layer(l) waits for layer l only."""
    import threading

    from kvtier.transfer import streams

    a, pages, keys = _engine_pages_with_cached()
    dst = [torch.zeros(10, 4, 24) for _ in range(LAYOUT.num_layers)]
    paged = PagedKV(dst, LAYOUT, "mla")
    reading, layer1 = threading.Event(), threading.Event()
    real_reading, real_copy = a.store.reading, streams.copy

    @contextmanager
    def slow_reading(*args, **kw):
        assert reading.wait(10)
        with real_reading(*args, **kw) as held:
            yield held

    def slow_copy(views, *args, **kw):
        if views[0] is paged.views[1]:
            assert layer1.wait(10)
        return real_copy(views, *args, **kw)

    real_layer = ChunkPlan.layer

    def slow_layer(plan, l, to_blocks):     # the path taken where kvtier._copy is built
        if l == 1:
            assert layer1.wait(10)
        return real_layer(plan, l, to_blocks)

    monkeypatch.setattr(a.store, "reading", slow_reading)
    monkeypatch.setattr(streams, "copy", slow_copy)
    monkeypatch.setattr(ChunkPlan, "layer", slow_layer)
    load = a.load_into(keys, paged, [[0], [1], [9]])     # returns while the read is held
    assert load.requested == 3 and not load.handle.done()
    reading.set()
    assert load.loaded == 3                               # known once the read finished
    load.wait_for_layer(0)
    assert torch.equal(dst[0][[0, 1, 9]], pages[0][[7, 2, 5]])
    assert torch.count_nonzero(dst[1]) == 0               # layer 1 is still held back
    layer1.set()
    assert load.wait() == 3
    for l in range(LAYOUT.num_layers):
        assert torch.equal(dst[l][[0, 1, 9]], pages[l][[7, 2, 5]])
    a.close()


def test_load_into_reports_blocks_it_did_not_write(monkeypatch):
    a, pages, keys = _engine_pages_with_cached()
    dst = [torch.zeros(10, 4, 24) for _ in range(LAYOUT.num_layers)]
    paged = PagedKV(dst, LAYOUT, "mla")
    real_reading = a.store.reading

    @contextmanager
    def short_reading(*args, **kw):                       # block 1 fails its checksum
        with real_reading(*args, **kw) as held:
            held.blocks = min(held.blocks, 1)
            yield held

    monkeypatch.setattr(a.store, "reading", short_reading)
    load = a.load_into(keys, paged, [[0], [1], [9]])
    assert load.wait() == 1 and load.error is None
    assert torch.equal(dst[2][0], pages[2][7]) and torch.count_nonzero(dst[2][[1, 9]]) == 0

    def broken(*args, **kw):
        raise OSError("disk on fire")

    monkeypatch.setattr(a.store, "reading", broken)
    dst2 = [torch.zeros(10, 4, 24) for _ in range(LAYOUT.num_layers)]
    load = a.load_into(keys, PagedKV(dst2, LAYOUT, "mla"), [[0], [1], [9]])
    for l in range(LAYOUT.num_layers):
        load.wait_for_layer(l)                            # never raises: the engine recomputes
    assert load.wait() == 0 and isinstance(load.error, OSError)
    assert all(torch.count_nonzero(t) == 0 for t in dst2)
    monkeypatch.undo()
    with pytest.raises(kvtier.LayoutError, match="one row per block"):
        a.load_into(keys, paged, [[0], [1]])              # a bad call fails at once, in the caller
    with pytest.raises(kvtier.LayoutError, match="one row per block"):
        a.save_from(keys, paged, [[0]])
    with pytest.raises(kvtier.LayoutError, match="16-byte block key"):
        a.load_into([1, 2, 3], paged, [[0], [1], [9]])    # not keys: an error, not a miss
    other = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=4)], kvtier.Namespace(model="another-model"))
    with pytest.raises(kvtier.ForeignKeysError):
        a.load_into(other.keys(list(range(12))), paged, [[0], [1], [9]])
    other.close()
    a.store.close()
    with pytest.raises(kvtier.ClosedError):
        a.load_into(keys, paged, [[0], [1], [9]])
    with pytest.raises(kvtier.ClosedError):
        a.save_from(keys, paged, [[0], [1], [9]])
    a.close()


def test_errors_say_what_to_do():
    host_only = KVAdapter(kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=4)], NS))
    with pytest.raises(kvtier.ConfigError, match="DeviceTier"):
        host_only.allocate(1)
    with pytest.raises(kvtier.ConfigError, match="Store"):
        KVAdapter("not a store")                   # type: ignore[arg-type]
    a = make()
    with pytest.raises(kvtier.LayoutError, match="one page per key"):
        a.cache(a.keys(list(range(8))), [0])
    with pytest.raises(kvtier.ConfigError, match="n is a number"):
        a.allocate(-1)


@settings(max_examples=40, deadline=None)
@given(hst.lists(hst.tuples(hst.integers(0, 5), hst.integers(1, 3), hst.booleans()), min_size=1, max_size=25))
def test_allocating_and_caching_never_exceed_capacity_or_share_a_page(ops):
    """Requests over 6 prompt families come and go; a page is shared only as the same cached
    block, the device tier never holds more than its capacity, and every page in use keeps
    its bytes."""
    a = make(device_blocks=6, host_blocks=6)
    live: list[tuple[list[bytes], list[int], list[torch.Tensor]]] = []
    for family, blocks, finish_one in ops:
        tokens = [family * 1000 + i for i in range(blocks * LAYOUT.block_tokens)]
        match = a.lookup(tokens)
        load = a.load(match)
        load.wait()
        pages = list(load.pages)
        fresh = a.allocate(len(match.keys) - load.blocks)
        if fresh is None:                           # no room: give the prefix back
            a.free(pages)
        else:
            fill(a, fresh, family)
            pages += fresh
            a.cache(match.keys, pages)
            data = [a.pool()[p].clone() for p in pages]
            live.append((list(match.keys), pages, data))
        refs = a.store.pages.referenced()
        owned = a.store.pages.owned()
        owner: dict[int, bytes | None] = {}
        for ks, ps, _ in live:
            for k, p in zip(ks, ps):
                assert (p in owned) != (p in refs)  # one state per page
                if p in refs:
                    assert refs[p][0] == k and (p not in owner or owner[p] == k)
                else:
                    assert p not in owner           # an owned page is one request's
                owner[p] = k if p in refs else None
        st = a.store.stats()
        assert all(t.used_blocks <= t.capacity_blocks for t in st.tiers)
        for ks, ps, data in live:
            for p, d in zip(ps, data):
                assert torch.equal(a.pool()[p], d)  # nobody overwrote a page in use
        assert {k for k, _ in refs.values()} <= set(a.store.index.ready)
        if finish_one and live:
            _, ps, _ = live.pop(0)
            a.free(ps)


def test_pages_are_checked_at_the_boundary():
    a = make()
    slots = a.allocate(2)
    a.free(slots)
    with pytest.raises(kvtier.LayoutError, match="not allocated or referenced"):
        a.free(slots)                                  # twice
    with pytest.raises(kvtier.LayoutError, match="not allocated or referenced"):
        a.free([-5])
    slots = a.allocate(2)
    with pytest.raises(kvtier.LayoutError, match="named twice"):
        a.cache(a.keys(list(range(8))), [slots[0], slots[0]])
    with pytest.raises(kvtier.LayoutError, match="not allocated or loaded"):
        a.cache(a.keys(list(range(8))), [slots[0], min(set(range(8)) - set(slots))])
    keys = a.keys(list(range(8)))
    assert a.cache(keys, slots) == 2
    assert a.cache(keys, slots) == 0                   # cached already: nothing to do
    a.free(slots)                                      # the blocks stay cached, unreferenced
    with pytest.raises(kvtier.LayoutError, match="freed twice"):
        a.free(slots)
    assert a.lookup(list(range(8))).blocks == 2


def test_a_failed_load_leaves_nothing_referenced_or_allocated(monkeypatch):
    a = make(device_blocks=4)
    tokens = list(range(16))
    keys, slots, _ = compute(a, tokens, 7)
    a.free(slots)
    other, pages, _ = compute(a, list(range(300, 308)), 8)   # two of the first prompt's blocks go to host
    a.free(pages)
    match = a.lookup(tokens)
    assert "host" in match.tiers and "device" in match.tiers

    def broken(*args, **kwargs):
        raise OSError("disk on fire")
    monkeypatch.setattr(a.store, "_held_reads", broken)
    load = a.load(match)              # blocks in memory: it returns before the loader's thread reads them
    with pytest.raises(kvtier.TransferError, match="disk on fire"):
        load.wait_for_layer(0)        # where the engine's step finds out
    with pytest.raises(kvtier.TransferError, match="disk on fire"):
        load.wait()
    monkeypatch.undo()
    a.free(load.pages)                # as the engine's abort does
    assert all(e.refs == 0 for e in a.store.index.entries.values())   # the read's holds ended too
    assert not a.store.pages.owned() and not a.store.pages.referenced()
    assert a.allocate(4) is not None                   # every device slot can be had again


def test_a_failed_disk_read_fails_the_load_at_once(tmp_path, monkeypatch):
    """Blocks on disk are read (and verified) before load() returns, so a failed read is
    raised by load() itself and leaves nothing held, owned or referenced."""
    a = make(device_blocks=4, host_blocks=None, disk=tmp_path / "kv")
    keys, slots, _ = compute(a, list(range(16)), 7)
    a.free(slots)
    other, pages, _ = compute(a, list(range(300, 316)), 8)   # the first prompt goes to disk
    a.free(pages)
    match = a.lookup(list(range(16)))
    assert match.tiers == ["disk"] * 4

    def broken(*args, **kwargs):
        raise OSError("disk on fire")
    monkeypatch.setattr(a.store.tiers[1], "read", broken)
    with pytest.raises(kvtier.TransferError, match="disk on fire"):
        a.load(match)
    monkeypatch.undo()
    assert all(e.refs == 0 for e in a.store.index.entries.values())
    assert not a.store.pages.owned() and not a.store.pages.referenced()


def test_engine_pages_load_from_host_and_disk_and_stop_at_a_corrupt_block(tmp_path):
    """load_into over a prefix split between the host tier (read in place) and disk (read,
    verified, through the store's reused buffer): the prefix ends at a corrupt disk block,
    its pages and those after it are untouched, and a second load reuses the buffer."""
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=3), kvtier.DiskTier(tmp_path / "kv", blocks=16)], NS,
                         promote=False)
    a = KVAdapter(store)
    pages = [torch.randn(12, 4, 24) for _ in range(LAYOUT.num_layers)]
    keys = a.keys(list(range(24)))                              # 6 blocks; the host tier holds 3
    a.save_from(keys[:3], PagedKV(pages, LAYOUT, "mla"), [[0], [1], [2]]).wait()
    a.save_from(keys[3:], PagedKV(pages, LAYOUT, "mla"), [[3], [4], [5]]).wait()
    tiers = a.lookup(list(range(24))).tiers
    assert sorted(set(tiers)) == ["disk", "host"] and tiers.count("disk") == 3
    first_disk = tiers.index("disk")
    bad = next(i for i, t in enumerate(tiers) if t == "disk" and i > first_disk)   # the 2nd disk block
    disk = store.tiers[1]
    slot = store.index.entries[keys[bad]].slot_in(1)
    with open(tmp_path / "kv" / "slab.bin", "r+b") as f:
        f.seek(slot * disk.slot_bytes + 3)
        b = f.read(1)
        f.seek(slot * disk.slot_bytes + 3)
        f.write(bytes([b[0] ^ 0xFF]))
    dst = [torch.zeros(12, 4, 24) for _ in range(LAYOUT.num_layers)]
    table = [[6], [7], [8], [9], [10], [11]]
    load = a.load_into(keys, PagedKV(dst, LAYOUT, "mla"), table)
    assert load.wait() == bad and load.error is None
    for l in range(LAYOUT.num_layers):
        for i in range(6):
            want = pages[l][i] if i < bad else torch.zeros(4, 24)
            assert torch.equal(dst[l][6 + i], want), (l, i)
    assert store.stats().counters.corrupt_blocks == 1
    again = a.load_into(keys[:bad], PagedKV(dst, LAYOUT, "mla"), table[:bad])
    assert again.wait() == bad
    a.close()
    store.close()


def test_bad_arguments_at_the_boundary_are_kvtier_errors():
    """Mistakes a user makes get one of kvtier's errors saying what to pass (they were an
    AttributeError, a TypeError, numpy's ValueError, or None from allocate)."""
    a = make(device_blocks=8)
    pages = [torch.zeros(10, 4, 24) for _ in range(LAYOUT.num_layers)]
    with pytest.raises(kvtier.LayoutError, match="layout must be a kvtier.KVLayout"):
        PagedKV(pages, "llama", "mla")
    with pytest.raises(kvtier.LayoutError, match="pages_per_layer must be a list"):
        PagedKV.of_pages(None, LAYOUT, 10)
    paged = PagedKV(pages, LAYOUT, "mla")
    keys = a.keys(list(range(12)))
    with pytest.raises(kvtier.LayoutError, match="equal rows"):
        a.load_into(keys, paged, [[0], [1, 2], [3]])
    with pytest.raises(kvtier.LayoutError, match="lookup"):
        a.load(list(range(12)))
    with pytest.raises(kvtier.CapacityError, match="8 pages in all"):
        a.allocate(9)                                     # never possible: not None (preempt and retry)
    assert a.allocate(8) is not None
    a.close()
    a.store.close()
