import threading

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as hs

import kvtier
from kvtier.errors import (CapacityError, ClosedError, ConfigError, KeyNotCachedError, LayoutError)
from tests.conftest import payload


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(layout, ns, blocks=16, **kw) -> kvtier.Store:
    return kvtier.Store(layout, [kvtier.HostTier(blocks=blocks)], ns, **kw)


def test_put_lookup_get_round_trip(layout, ns):
    store = make(layout, ns)
    keys = store.keys(list(range(30)))            # 7 full blocks, 2 tokens left over
    assert len(keys) == 7 and store.lookup(keys).blocks == 0
    data = payload(keys, layout.block_bytes)
    t = store.put(keys, data)
    assert (t.blocks, t.nbytes, t.present) == (7, 7 * layout.block_bytes, 0)
    hit = store.lookup(keys)
    assert (hit.blocks, hit.tokens, hit.by_tier()) == (7, 28, {"host": 7})
    out = torch.zeros(7, layout.block_bytes, dtype=torch.uint8)
    store.get(keys, out).wait()
    assert torch.equal(out, data)


def test_layout_dtype_tensors_and_lists_are_accepted(layout, ns):
    store = make(layout, ns)
    keys = store.keys(list(range(12)))
    blocks = torch.randn(3, *layout.block_shape, dtype=torch.float16)
    store.put(keys, blocks)
    out = torch.empty_like(blocks)
    store.get(keys, out)
    assert torch.equal(out, blocks)
    outs = [torch.empty(layout.block_shape, dtype=torch.float16) for _ in range(3)]
    store.get(keys, outs)
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks))


def test_lookup_stops_at_the_first_missing_block(layout, ns):
    store = make(layout, ns)
    keys = store.keys(list(range(40)))
    store.put(keys[:3], payload(keys[:3], layout.block_bytes))
    store.put(keys[4:6], payload(keys[4:6], layout.block_bytes))
    assert store.lookup(keys).blocks == 3
    other = store.keys([999] + list(range(1, 40)))   # differs in block 0: shares nothing
    assert store.lookup(other).blocks == 0


def test_put_of_cached_blocks_only_refreshes(layout, ns):
    store = make(layout, ns)
    keys = store.keys(list(range(16)))
    store.put(keys, payload(keys, layout.block_bytes))
    t = store.put(keys, torch.zeros(4, layout.block_bytes, dtype=torch.uint8))
    assert (t.blocks, t.present) == (0, 4)
    out = torch.zeros(4, layout.block_bytes, dtype=torch.uint8)
    store.get(keys, out)
    assert torch.equal(out, payload(keys, layout.block_bytes))   # not overwritten


def test_leaf_first_lru_eviction(layout, ns):
    store = make(layout, ns, blocks=6)
    a = store.keys([1] * 16)            # 4 blocks
    b = store.keys([2] * 12)            # 3 blocks: evicts one of a's
    store.put(a, payload(a, layout.block_bytes))
    store.put(b, payload(b, layout.block_bytes))
    # a's deepest block went first: its prefix of 3 is still whole.
    assert store.lookup(a).blocks == 3
    assert store.lookup(b).blocks == 3
    s = store.stats().tiers[0]
    assert (s.used_blocks, s.evicted, s.dropped, s.inserted) == (6, 1, 1, 7)


def test_get_refreshes_recency(layout, ns):
    store = make(layout, ns, blocks=4)
    a, b = store.keys([1] * 8), store.keys([2] * 8)
    store.put(a, payload(a, layout.block_bytes))
    store.put(b, payload(b, layout.block_bytes))
    store.get(a, torch.empty(2, layout.block_bytes, dtype=torch.uint8))   # a is now most recent
    c = store.keys([3] * 8)
    store.put(c, payload(c, layout.block_bytes))
    assert store.lookup(a).blocks == 2 and store.lookup(b).blocks == 0


def test_get_refreshes_tail_first_so_leaves_go_before_roots(layout, ns):
    store = make(layout, ns, blocks=6)
    a, x = store.keys([1] * 16), store.keys([2] * 8)        # 4 + 2 blocks: full
    store.put(a, payload(a, layout.block_bytes))
    store.put(x, payload(x, layout.block_bytes))
    store.get(a, torch.empty(4, layout.block_bytes, dtype=torch.uint8))
    y = store.keys([3] * 12)                                 # 3 victims: x's two, then a's leaf
    store.put(y, payload(y, layout.block_bytes))
    assert store.lookup(a).blocks == 3 and store.lookup(x).blocks == 0


def test_put_of_a_suffix_refreshes_the_chain_prefix(layout, ns):
    store = make(layout, ns, blocks=8)
    longer = store.keys([1] * 24)                            # 6 blocks; its first 4 are put first
    store.put(longer[:4], payload(longer[:4], layout.block_bytes))
    x = store.keys([2] * 8)
    store.put(x, payload(x, layout.block_bytes))
    store.put(longer[4:], payload(longer[4:], layout.block_bytes))   # the next turn's new blocks
    y = store.keys([3] * 12)                                 # 3 victims: x's two, then the leaf
    store.put(y, payload(y, layout.block_bytes))
    assert store.lookup(longer).blocks == 5


def test_get_of_uncached_keys_raises_and_holds_nothing(layout, ns):
    store = make(layout, ns, blocks=4)
    keys = store.keys(list(range(16)))
    store.put(keys[:2], payload(keys[:2], layout.block_bytes))
    with pytest.raises(KeyNotCachedError, match="block 2 of the 4"):
        store.get(keys, torch.empty(4, layout.block_bytes, dtype=torch.uint8))
    # Nothing stayed held: both blocks can still be evicted.
    other = store.keys([7] * 16)
    store.put(other, payload(other, layout.block_bytes))
    assert store.lookup(keys).blocks == 0


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(3, 512, dtype=torch.float32), "dtype"),
    (torch.zeros(2, 512, dtype=torch.uint8), "shape"),
    (torch.zeros(3, 500, dtype=torch.uint8), "512 bytes"),
    (torch.zeros(512, 3, dtype=torch.uint8).t(), "contiguous"),
    (torch.zeros(3, 512, dtype=torch.uint8, device="meta"), "meta"),
    # the layout's dtype in another order (block [2, 2, 4, 2, 8]: tokens before K/V here) or
    # flattened: same element count, was stored as raw bytes and loaded back scrambled
    (torch.zeros(3, 2, 4, 2, 2, 8, dtype=torch.float16), r"shape \(3, 2, 4, 2, 2, 8\) .* in that order"),
    (torch.zeros(3, 256, dtype=torch.float16), r"pass \[3, 2, 2, 4, 2, 8\] in that order"),
    ([torch.zeros(512, dtype=torch.uint8)] * 2, "2 blocks but 3"),
    ("not a tensor", "must be a tensor"),
])
def test_put_rejects_bad_blocks_before_touching_the_store(layout, ns, bad, match):
    store = make(layout, ns)
    keys = store.keys(list(range(12)))
    with pytest.raises(LayoutError, match=match):
        store.put(keys, bad)
    assert store.lookup(keys).blocks == 0 and store.stats().tiers[0].used_blocks == 0


def test_get_rejects_read_only_and_bad_out(layout, ns):
    store = make(layout, ns)
    keys = store.keys(list(range(8)))
    store.put(keys, payload(keys, layout.block_bytes))
    ro = np.zeros((2, layout.block_bytes), dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(LayoutError, match="read-only"):
        store.get(keys, ro)
    with pytest.raises(LayoutError, match="dtype"):
        store.get(keys, torch.zeros(2, 256, dtype=torch.int16))
    with pytest.raises(LayoutError, match="in that order"):
        store.get(keys, torch.zeros(2, 2, 4, 2, 2, 8, dtype=torch.float16))
    right = torch.zeros(2, *layout.block_shape, dtype=torch.float16)
    assert store.get(keys, right).loaded == 2 and store.get(keys, list(right)).loaded == 2
    assert torch.equal(right.view(torch.uint8).reshape(2, -1), payload(keys, layout.block_bytes))


def test_bad_keys_and_config(layout, ns):
    store = make(layout, ns)
    with pytest.raises(LayoutError, match="16-byte"):
        store.lookup([b"short"])
    with pytest.raises(LayoutError, match="list of 16-byte"):
        store.lookup(b"0123456789abcdef")
    with pytest.raises(ConfigError, match="unknown policy"):
        make(layout, ns, policy="nope")
    with pytest.raises(ConfigError, match="non-empty list"):
        kvtier.Store(layout, kvtier.HostTier(blocks=4), ns)
    with pytest.raises(ConfigError, match="unique"):
        kvtier.Store(layout, [kvtier.HostTier(blocks=4), kvtier.HostTier(blocks=4)], ns)
    with pytest.raises(ConfigError, match="exactly one"):
        kvtier.HostTier()
    with pytest.raises(ConfigError, match="Namespace"):
        kvtier.Store(layout, [kvtier.HostTier(blocks=4)], "model")
    with pytest.raises(ConfigError, match="policy must be a policy name"):
        make(layout, ns, policy=None)
    # Fastest first: a disk above host memory kept blocks where a restart lost them.
    with pytest.raises(ConfigError, match="fastest first: device, then host, then disk; got host \\(host\\), device"):
        kvtier.Store(layout, [kvtier.HostTier(blocks=4), kvtier.DeviceTier(blocks=4, device="cpu")], ns)
    with pytest.raises(ConfigError, match="no tier named 'gpu': this store's tiers are 'host'"):
        store.stats().tier("gpu")
    store.close()
    with pytest.raises(ClosedError):
        store.unpin("s")
    with pytest.raises(ClosedError):
        with store:
            pass
    with pytest.raises(ClosedError):
        store.flush()                  # returned None without a persistent tier
    assert store.stats().tier("host").capacity_blocks == 16     # still reads the last counters
    assert len(store.keys(list(range(8)))) == 2                 # hashing needs nothing the store holds


@pytest.mark.parametrize("other", [
    dict(namespace=dict(model="another-model")),
    dict(namespace=dict(model="test-model", revision="r1", salt=b"tenant-b")),
    dict(layout=dict(dtype=torch.bfloat16)),
    dict(hash="sha256"),
])
def test_keys_of_another_store_are_refused(layout, ns, other):
    store = make(layout, ns)
    theirs = make(kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4,
                                      **{"dtype": torch.float16, **other.get("layout", {})}),
                  kvtier.Namespace(**other.get("namespace", {"model": "test-model", "revision": "r1"})),
                  hash=other.get("hash", "xxh3"))
    toks = list(range(24))
    keys = theirs.keys(toks)
    data = payload(keys, layout.block_bytes)
    for call in (lambda: store.put(keys, data), lambda: store.lookup(keys),
                 lambda: store.get(keys[:2], torch.zeros(2, layout.block_bytes, dtype=torch.uint8)),
                 lambda: store.pin("s", keys[1:], ttl=60), lambda: store.keys(toks[24:], parent=keys)):
        with pytest.raises(kvtier.ForeignKeysError, match=r"another store's keys\(\).*this store's keys\(tokens\)"):
            call()
    assert store.stats().counters.puts == store.stats().counters.lookups == 0
    assert store.stats().tiers[0].used_blocks == 0


def test_foreign_keys_error_says_what_differs(layout, ns):
    store = make(layout, ns)
    keys = make(layout, kvtier.Namespace("model-a", revision="r9")).keys(list(range(8)))
    with pytest.raises(ConfigError) as e:
        store.lookup(keys)
    msg = str(e.value)
    assert "model 'model-a' (this store: 'test-model')" in msg and "revision 'r9' (this store: 'r1')" in msg
    assert "layout" not in msg.split(". ")[0]   # only what differs is named


def test_keys_of_an_equal_store_and_untagged_keys_are_accepted(layout, ns):
    store = make(layout, ns)
    twin = make(layout, kvtier.Namespace(model="test-model", revision="r1"))   # same identity, same keys
    keys = twin.keys(list(range(16)))
    assert keys == store.keys(list(range(16)))
    store.put(keys[:2], payload(keys[:2], layout.block_bytes))
    assert store.lookup(keys).blocks == 2
    # Keys with no origin (from a peer, a trace, a plain list) are accepted as before.
    assert store.lookup(list(keys)).blocks == 2
    assert store.lookup(kvtier.BlockKeys(keys)).blocks == 2
    store.put(list(keys[2:]), payload(keys[2:], layout.block_bytes))
    assert store.lookup(keys).blocks == 4


def test_float_token_ids_never_hit_another_tokens_blocks(layout, ns):
    store = make(layout, ns)
    keys = store.keys([1, 2, 3, 4])
    store.put(keys, payload(keys, layout.block_bytes))
    for bad in ([1.5, 2, 3, 4], [1.0, 2, 3, 4], np.array([1.5, 2, 3, 4]), torch.tensor([1, 2, 3, 4.0]),
                torch.tensor([1, 2, 3, 4], dtype=torch.bfloat16)):
        with pytest.raises(LayoutError, match="token ids must be integers"):
            store.keys(bad)
    for bad in ([1, 2, 3, -4], [1, 2, 3, 2**32 + 4], np.array([1, 2, 3, 2**40])):
        with pytest.raises(LayoutError, match=r"\[0, 2\*\*32\), got .* at position 3"):
            store.keys(bad)
    for ok in ([1, 2, 3, 4], (1, 2, 3, 4), np.array([1, 2, 3, 4], dtype=np.int32), torch.tensor([1, 2, 3, 4])):
        assert store.lookup(store.keys(ok)).blocks == 1
    for bad, got in ((None, "NoneType"), (iter([1, 2, 3, 4]), "an iterator: make a list of it"), (7, "int")):
        with pytest.raises(LayoutError, match=f"list, array or tensor of int token ids, got {got}"):
            store.keys(bad)      # said "one-dimensional sequence of ids, got shape ()"


def test_capacity_smaller_than_one_block(layout, ns):
    with pytest.raises(CapacityError, match="smaller than one block"):
        kvtier.Store(layout, [kvtier.HostTier(capacity="100B")], ns)


def test_put_larger_than_the_tier(layout, ns):
    store = make(layout, ns, blocks=3)
    keys = store.keys(list(range(16)))
    with pytest.raises(CapacityError, match="4 blocks cannot fit"):
        store.put(keys, payload(keys, layout.block_bytes))
    assert store.lookup(keys).blocks == 0


def test_a_tier_serves_one_store(layout, ns):
    tier = kvtier.HostTier(blocks=4)
    kvtier.Store(layout, [tier], ns)
    with pytest.raises(ConfigError, match="already in use"):
        kvtier.Store(layout, [tier], ns)


def test_pins_survive_pressure_until_their_ttl(layout, ns):
    clock = Clock()
    store = make(layout, ns, blocks=8, clock=clock)
    sess = store.keys([5] * 16)                 # 4 blocks, the whole pin budget (0.5 x 8)
    store.put(sess, payload(sess, layout.block_bytes))
    assert store.pin("s1", sess, ttl=60) == 4
    assert store.stats().tiers[0].pinned_bytes == 4 * layout.block_bytes
    for i in range(10):                         # heavy pressure from other prompts
        k = store.keys([100 + i] * 16)
        store.put(k, payload(k, layout.block_bytes))
    assert store.lookup(sess).blocks == 4
    clock.now = 61                               # TTL over: the pin lapses
    k = store.keys([999] * 16)
    store.put(k, payload(k, layout.block_bytes))
    k = store.keys([998] * 16)
    store.put(k, payload(k, layout.block_bytes))
    assert store.lookup(sess).blocks == 0
    assert store.stats().pinned_sessions == 0


def test_pin_budget_and_unpin(layout, ns):
    store = make(layout, ns, blocks=8)          # budget: 4 pinned blocks
    a, b = store.keys([1] * 12), store.keys([2] * 12)
    assert store.pin("a", a, ttl=60) == 3       # not cached yet: protected when they arrive
    assert store.pin("b", b, ttl=60) == 1       # only one more fits
    assert store.pin("b2", a, ttl=60) == 3      # shared blocks cost the budget once
    assert store.stats().tiers[0].pinned_blocks == 4
    assert store.unpin("a") == 3 and store.stats().tiers[0].pinned_blocks == 4   # still pinned by b2
    assert store.unpin("b2") == 3 and store.unpin("b") == 1
    assert store.stats().tiers[0].pinned_blocks == 0 and store.unpin("nobody") == 0
    for bad in (0, -1, float("nan"), float("inf"), True, "60"):    # nan passed `ttl <= 0`: pinned forever
        with pytest.raises(ConfigError, match="ttl"):
            store.pin("c", a, ttl=bad)
    assert store.stats().pinned_sessions == 0


def test_pins_shed_past_their_bound_are_counted_in_stats(layout, ns):
    store = make(layout, ns, blocks=8)
    store.index.pins.ref_limit = 6              # the default is at least 2**20 keys
    keys = store.keys([3] * 12)
    for s in range(4):
        assert store.pin(f"s{s}", keys, ttl=60) == 3
    st = store.stats()
    assert st.pins_shed == 2 and st.pinned_sessions == 2 and st.as_dict()["pins_shed"] == 2


def test_pinned_blocks_arriving_later_are_protected(layout, ns):
    store = make(layout, ns, blocks=6)
    sess = store.keys([5] * 12)
    store.pin("s", sess, ttl=600)
    store.put(sess, payload(sess, layout.block_bytes))
    for i in range(5):
        k = store.keys([50 + i] * 12)
        store.put(k, payload(k, layout.block_bytes))
    assert store.lookup(sess).blocks == 3
    # Every unpinned slot is full of others and the rest is pinned: a put larger than
    # what can be freed stores what fits and reports the rest.
    t = store.put(store.keys([77] * 16), torch.zeros(4, layout.block_bytes, dtype=torch.uint8))
    assert (t.blocks, t.rejected) == (3, 1)


@pytest.mark.parametrize("promote", [False, True])
def test_two_tiers_demote_on_eviction(layout, ns, promote):
    store = kvtier.Store(layout, [kvtier.HostTier(blocks=4, name="fast"), kvtier.HostTier(blocks=8, name="big")], ns,
                         promote=promote)
    a, b = store.keys([1] * 16), store.keys([2] * 16)
    store.put(a, payload(a, layout.block_bytes))
    store.put(b, payload(b, layout.block_bytes))      # a moves down to "big"
    hit = store.lookup(a)
    assert hit.blocks == 4 and hit.by_tier() == {"fast": 0, "big": 4}
    out = torch.zeros(4, layout.block_bytes, dtype=torch.uint8)
    t = store.get(a, out)
    assert t.loaded == 4 and torch.equal(out, payload(a, layout.block_bytes))   # bytes survived the move
    s = store.stats()
    if not promote:
        assert store.lookup(a).by_tier() == {"fast": 0, "big": 4}
        assert s.tier("fast").evicted == 4 and s.tier("big").demoted_in == 4 and s.tier("big").dropped == 0
    else:
        # The hit was copied up (its copy below stays); b went down to make room.
        assert store.lookup(a).by_tier() == {"fast": 4, "big": 0}
        assert store.lookup(b).by_tier() == {"fast": 0, "big": 4}
        assert s.tier("fast").evicted == 8 and s.tier("big").demoted_in == 8
        assert s.tier("big").used_blocks == 8           # a's copies and b
        c = store.keys([3] * 16)
        store.put(c, payload(c, layout.block_bytes))  # a leaves "fast": its copy below is kept, no I/O
        assert store.lookup(a).by_tier() == {"fast": 0, "big": 4}
        store.get(a, out)
        assert torch.equal(out, payload(a, layout.block_bytes))


def test_pin_to_a_tier_keeps_the_block_there(layout, ns):
    store = kvtier.Store(layout, [kvtier.HostTier(blocks=8, name="fast"), kvtier.HostTier(blocks=8, name="big")], ns)
    a = store.keys([1] * 16)
    store.put(a, payload(a, layout.block_bytes))
    store.pin("s", a, ttl=600, tier="fast")
    for i in range(4):
        k = store.keys([10 + i] * 16)
        store.put(k, payload(k, layout.block_bytes))
    assert store.lookup(a).by_tier() == {"fast": 4, "big": 0}
    with pytest.raises(ConfigError, match="no tier named"):
        store.pin("t", a, ttl=1, tier="disk")


def test_non_blocking_put_and_get(layout, ns):
    store = make(layout, ns, blocks=64)
    keys = store.keys(list(range(64 * 4)))
    data = payload(keys, layout.block_bytes)
    t = store.put(keys, data, blocking=False)
    assert t.wait() is t and t.done() and store.lookup(keys).blocks == 64
    out = torch.zeros_like(data)
    g = store.get(keys, out, blocking=False)
    g.wait(timeout=10)
    assert torch.equal(out, data)
    store.close()
    with pytest.raises(ClosedError):
        store.lookup(keys)


def test_concurrent_threads_never_read_wrong_bytes(layout, ns):
    store = make(layout, ns, blocks=24)
    errors: list[str] = []

    def worker(w: int) -> None:
        rng = np.random.default_rng(w)
        for _ in range(60):
            toks = [int(rng.integers(0, 6))] * 4 + rng.integers(0, 3, 12).tolist()
            keys = store.keys(toks)
            hit = store.lookup(keys)
            if hit.blocks:
                out = torch.empty(hit.blocks, layout.block_bytes, dtype=torch.uint8)
                try:
                    store.get(keys[:hit.blocks], out)
                except KeyNotCachedError:
                    continue          # evicted between lookup and get by another thread: a miss
                if not torch.equal(out, payload(keys[:hit.blocks], layout.block_bytes)):
                    errors.append("wrong bytes")
            store.put(keys[hit.blocks:], payload(keys[hit.blocks:], layout.block_bytes))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.stats().tiers[0].used_blocks <= 24


def test_stats_count_lookups_and_bytes(layout, ns):
    store = make(layout, ns)
    keys = store.keys(list(range(16)))
    store.lookup(keys)
    store.put(keys, payload(keys, layout.block_bytes))
    store.lookup(keys)
    st = store.stats()
    assert (st.counters.lookups, st.counters.lookup_blocks, st.counters.lookup_hit_blocks) == (2, 8, 4)
    assert st.hit_ratio == 0.5 and st.counters.put_bytes == 4 * layout.block_bytes
    d = st.as_dict()
    assert d["tiers"][0]["used_bytes"] == 4 * layout.block_bytes
    assert d["tiers"][0]["info"]["memory"] in ("pinned", "pageable")


def test_a_lower_tiers_admission_filter_decides_what_moves_down(layout, ns):
    from kvtier.policies import LRUPolicy, register_policy

    class DeepOnly(LRUPolicy):      # admits only blocks past the first of their prompt
        name = "deep-only"

        def admit(self, info):
            return info.depth > 0

    register_policy("deep-only", DeepOnly)
    store = kvtier.Store(layout, [kvtier.HostTier(blocks=4, name="fast"), kvtier.HostTier(blocks=8, name="big")],
                         ns, policy=["lru", "deep-only"])
    a, b = store.keys([1] * 16), store.keys([2] * 16)
    store.put(a, payload(a, layout.block_bytes))
    store.put(b, payload(b, layout.block_bytes))          # a leaves "fast": its root is refused below
    assert store.lookup(a[1:]).blocks == 3 and store.lookup(a).blocks == 0
    s = store.stats()
    assert s.tier("big").demoted_in == 3 and s.tier("fast").dropped == 1


def test_disk_reads_reuse_one_buffer_up_to_a_cap(layout, ns, tmp_path, monkeypatch):
    """reading() puts disk blocks in a buffer the store keeps for the next read, unless the
    buffer is larger than the cap: a long read must not pin its memory for good."""
    from kvtier import store as store_mod

    s = kvtier.Store(layout, [kvtier.HostTier(blocks=2), kvtier.DiskTier(tmp_path / "kv", blocks=16)], ns,
                     promote=False)
    keys = s.keys(list(range(6 * layout.block_tokens)))
    s.put(keys[:2], payload(keys[:2], layout.block_bytes))
    s.put(keys[2:4], payload(keys[2:4], layout.block_bytes))      # the first two go to disk
    with s.reading(keys[:2]) as held:
        assert held.blocks == 2 and held.tiers == [1, 1]
        first = held.groups[0].memory
        assert [r.tobytes() for r in held.rows()] == [r.numpy().tobytes() for r in payload(keys[:2], layout.block_bytes)]
    with s.reading(keys[:2]) as held:
        assert held.groups[0].memory is first                       # reused, not allocated again
    monkeypatch.setattr(store_mod, "_SPARE_MAX_BYTES", 0)
    s._spare = None
    with s.reading(keys[:2]):
        pass
    assert s._spare is None
    s.close()


@given(hs.integers(1, 2000), hs.integers(1, 64))
def test_pipeline_cuts_cover_a_save_tail_first_each_part_at_most_double(n, head):
    """Store.write_in_place's parts: every block once, tail first, contiguous, the first of
    `head` blocks (or all of them), none after it more than twice the one before."""
    from kvtier.store import pipeline_cuts
    cuts = list(pipeline_cuts(n, head))
    assert cuts[0][1] == n and cuts[-1][0] == 0
    assert all(a[0] == b[1] for a, b in zip(cuts, cuts[1:]))                 # contiguous, descending
    sizes = [hi - lo for lo, hi in cuts]
    assert sizes[0] == min(n, head) or len(cuts) == 1
    assert all(size <= 2 * prev + head for prev, size in zip(sizes, sizes[1:]))


@pytest.mark.parametrize("fail_at", [None, 0, 2, "wait"])
def test_an_in_place_save_in_parts_is_readable_whole_or_not_at_all(layout, ns, monkeypatch, fail_at):
    """Store.write_in_place with a writer that only queues its copies (like a GPU's DMAs):
    the save is reserved in parts tail first, each part's copies queued before the next is
    reserved; if a write or the wait fails, no block of the save is readable, its slots are
    free again, and it still counts as one put."""
    import kvtier.store
    monkeypatch.setattr(kvtier.store, "PIPELINE_HEAD_BYTES", layout.block_bytes)   # parts of 1, 2, 4, ... blocks
    store = kvtier.Store(layout, [kvtier.HostTier(blocks=16)], ns)
    keys = store.keys(list(range(layout.block_tokens * 8)))
    rows = payload(list(keys), layout.block_bytes)
    queued, parts = [], []

    def write(w):                      # "queue" the copies: done for real only in wait()
        parts.append(list(w.positions))
        if fail_at == len(parts) - 1:
            raise OSError("queueing the copies failed")
        queued.append(w)

    def wait():
        for w in queued:
            for slot, pos in zip(w.slots.tolist(), w.positions):
                w.memory[slot] = rows[pos]
        if fail_at == "wait":
            raise OSError("the copies failed")
    if fail_at is None:
        t = store.write_in_place(keys, write, wait)
        assert t.blocks == 8 and store.lookup(keys).blocks == 8
        out = torch.zeros_like(rows)
        assert store.get(keys, out).loaded == 8 and torch.equal(out, rows)
    else:
        with pytest.raises(OSError):
            store.write_in_place(keys, write, wait)
        assert store.lookup(keys).blocks == 0
        assert store.stats().tiers[0].used_blocks == 0
    assert parts[0] == [7] and (fail_at in (0,) or parts[1] == [6, 5])      # tail first, then twice as many
    assert store.stats().counters.puts == 1
    store.close()


def _pinned_room(store, layout, taken: int) -> None:
    """Fill `taken` slots of the store's top tier with a pinned chain (never evicted)."""
    held = store.keys([10_000_000 + t for t in range(layout.block_tokens * taken)])
    store.put(held, payload(list(held), layout.block_bytes))
    assert store.pin("held", held, ttl=3600) == taken


@pytest.mark.parametrize("pipelined", [False, True], ids=["one-part", "in-parts"])
def test_a_put_with_room_for_part_of_it_keeps_the_chains_head(layout, ns, monkeypatch, pipelined):
    """Room for 7 of a 10-block chain (the rest pinned): the put keeps the 7 nearest the root,
    where it kept the tail (and no lookup could reach any). In parts (a large put: tail
    part reserved and written first) the tail parts took the room; once the head part
    finds none, their blocks are dropped, not kept unreachable: the put stores nothing."""
    import kvtier.store
    if pipelined:
        monkeypatch.setattr(kvtier.store, "PIPELINE_HEAD_BYTES", layout.block_bytes)   # parts of 1, 2, 4, 3 blocks
    store = make(layout, ns, blocks=10)
    _pinned_room(store, layout, 3)
    keys = store.keys(list(range(layout.block_tokens * 10)))
    rows = payload(list(keys), layout.block_bytes)
    t = store.put(keys, rows)
    hit = store.lookup(keys).blocks
    assert t.blocks == hit and t.blocks + t.rejected == 10
    assert hit == (0 if pipelined else 7)
    assert all(store.lookup([k]).blocks == 0 for k in list(keys)[hit:])   # nothing past the prefix
    out = torch.zeros(hit, layout.block_bytes, dtype=torch.uint8)
    assert store.get(list(keys)[:hit], out).loaded == hit and torch.equal(out, rows[:hit])
    s = store.stats()
    assert s.tiers[0].used_blocks == 3 + hit and s.counters.put_rejected == 10 - hit
    assert s.tiers[0].rejected == 10 - hit and s.tiers[0].inserted == 3 + hit
    store.close()


def test_an_admission_refusal_mid_chain_stores_nothing_after_it(layout, ns):
    """A block the admission filter refuses ends what a lookup can reach: the blocks after
    it are not stored either (they took room from reachable ones)."""
    store = make(layout, ns, blocks=16)
    policy = store.index.tiers[0].policy
    policy.admit = lambda info: info.depth != 2
    keys = store.keys(list(range(layout.block_tokens * 6)))
    t = store.put(keys, payload(list(keys), layout.block_bytes))
    assert (t.blocks, t.rejected) == (2, 4) and store.lookup(keys).blocks == 2
    assert store.stats().tiers[0].used_blocks == 2
    store.close()


def test_a_cached_block_a_put_evicts_for_its_own_new_block_counts_as_rejected(layout, ns):
    """4 slots, 3 pinned, block 4 of a chain cached: a put of blocks 3-4 stores 3 (nearer the
    root) by evicting 4, which it had counted present: it said present=1, rejected=0 while
    block 4 was gone."""
    store = make(layout, ns, blocks=4, pin_budget=0.9)
    chain = store.keys(list(range(layout.block_tokens * 5)))
    rows = payload(list(chain), layout.block_bytes)
    store.put(chain[:3], rows[:3])
    assert store.pin("s", chain[:3], ttl=3600) == 3
    store.put(chain[4:5], rows[4:5])
    t = store.put(chain[3:5], rows[3:5])
    assert (t.blocks, t.present, t.rejected) == (1, 0, 1)
    assert store.lookup(chain).blocks == 4 and store.lookup(chain[4:5]).blocks == 0
    store.close()


@pytest.mark.parametrize("pipelined", [False, True], ids=["one-part", "in-parts"])
def test_a_put_that_evicts_its_own_older_head_re_reserves_it(layout, ns, monkeypatch, pipelined):
    """The chain's cached head is the least recent: the put's new tail blocks evict it, and
    the walk (or the head part, in parts) stores it again. In parts its loss was counted
    too (present -2, rejected 5, 1 block kept)."""
    import kvtier.store
    if pipelined:
        monkeypatch.setattr(kvtier.store, "PIPELINE_HEAD_BYTES", 2 * layout.block_bytes)
    store = make(layout, ns, blocks=4)
    chain = store.keys(list(range(layout.block_tokens * 4)))
    rows = payload(list(chain), layout.block_bytes)
    store.put(chain[:2], rows[:2])
    other = store.keys([9000 + i for i in range(layout.block_tokens * 2)])
    store.put(other, payload(list(other), layout.block_bytes))      # newer: the tier is full
    t = store.put(chain, rows)
    c = store.stats().counters
    assert (t.blocks, t.present, t.rejected) == (4, 0, 0) and store.lookup(chain).blocks == 4
    assert c.put_present == 0 and c.put_rejected == 0 and store.stats().tiers[0].rejected == 0
    store.close()


def test_a_block_refused_after_its_own_put_evicted_it_counts_once(layout, ns):
    store = make(layout, ns, blocks=4)
    chain = store.keys(list(range(layout.block_tokens * 4)))
    rows = payload(list(chain), layout.block_bytes)
    store.put(chain[:3], rows[:3])
    x = store.keys([777] * layout.block_tokens)
    store.put(x, payload(list(x), layout.block_bytes))             # the 4th slot: full now
    store.index.tiers[0].policy.admit = lambda info: info.depth != 2
    t = store.put(chain, rows)
    c = store.stats().counters
    assert (t.blocks, t.present, t.rejected) == (0, 2, 2) and store.lookup(chain).blocks == 2
    assert c.put_rejected == 2 == store.stats().tiers[0].rejected
    store.close()


@settings(max_examples=400, deadline=None)
@given(hs.lists(hs.tuples(hs.sampled_from("ab"), hs.integers(0, 12), hs.integers(0, 1), hs.booleans()),
                min_size=1, max_size=25))
@example([("a", 1, 0, False), ("b", 11, 1, False), ("a", 0, 0, False), ("b", 11, 1, False)])
def test_repinning_a_longer_chain_equals_unpin_then_pin(ops):
    """Pins.pin keeps a session's pinned keys when its new keys extend them (a session's next
    turn, its answer's blocks) and adds only the rest: every floor, budget count and return
    value must be what releasing the pin and pinning afresh gives."""
    from kvtier.pins import Pins

    chain = [bytes([i]) * 16 for i in range(12)]
    other = [bytes([100 + i]) * 16 for i in range(12)]
    fast, ref = Pins([8, 20], 0.5, lambda: 0.0), Pins([8, 20], 0.5, lambda: 0.0)
    for session, n, tier, forked in ops:
        keys = (chain[:n // 2] + other[n // 2:n]) if forked else chain[:n]
        ref.unpin(session)
        assert fast.pin(session, keys, 60, tier) == ref.pin(session, keys, 60, tier)
        assert fast._floor == ref._floor and fast.pinned == ref.pinned
        assert {s: (r.keys, r.tier) for s, r in fast.sessions().items()} == \
            {s: (r.keys, r.tier) for s, r in ref.sessions().items()}
