"""Policies behind the EvictionPolicy interface: behaviour on hand-made sequences,
the registry, and Belady as an upper bound of every online policy (hypothesis)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.index import BlockIndex
from kvtier.policies import DEFAULT_POLICY, POLICIES, BlockInfo, make_policy, policy_names
from kvtier.sim import replay
from kvtier.traces.model import Request, Trace


def info(k, depth=0, tokens=16, bt=16):
    return BlockInfo(k, None, depth, tokens, bt, depth + 1)


def fill(pol, keys):
    for k in keys:
        pol.insert(info(k))
    return pol


ANY = lambda k: True  # noqa: E731


def test_lru_leaf_first():
    p = fill(make_policy("lru", 3), ["c", "b", "a"])   # tail-first insert: root a last
    assert p.victim(ANY) == "c"
    p.touch(["a"])
    assert p.victim(lambda k: k != "c") == "b"


def test_lfu_evicts_least_used_then_oldest():
    p = fill(make_policy("lfu", 3), [1, 2, 3])
    p.touch([1, 1, 2])
    assert p.victim(ANY) == 3
    p.remove(3)
    assert p.victim(ANY) == 2
    assert p.victim(lambda k: k != 2) == 1


def test_s3fifo_one_hit_wonders_leave_from_small():
    p = make_policy("s3fifo", 10)                       # small queue holds 1
    fill(p, [1, 2])
    p.touch([1])                                        # 1 was reused while in small
    v = p.victim(ANY)
    assert v == 2                                       # 1 promoted to main, 2 evicted
    p.remove(2)
    p.insert(info(2))                                   # back from the ghost: goes to main
    assert 2 in p._main and len(p) == 2


def test_arc_moves_reused_to_t2_and_ghost_adapts():
    p = fill(make_policy("arc", 2), [1, 2])
    p.touch([1])
    assert list(p._t2) == [1] and list(p._t1) == [2]
    k = p.victim(ANY)
    assert k == 2
    p.remove(k)
    assert list(p._b1) == [2]
    p.admit(info(2))
    p.insert(info(2))                                   # ghost hit in B1: p grows, goes to T2
    assert p.p > 0 and 2 in p._t2


def test_nopartial_refuses_partial_blocks_only():
    p = make_policy("arc+nopartial", 4)
    assert p.name == "arc+nopartial"
    assert p.admit(info(1, tokens=16)) and not p.admit(info(2, tokens=5))


def test_registry_and_errors():
    for base in ("lru", "lfu", "s3fifo", "arc"):
        assert base in POLICIES and f"{base}+nopartial" in policy_names()
    assert make_policy("recommended", 4).name == make_policy(DEFAULT_POLICY, 4).name
    with pytest.raises(ConfigError, match="unknown policy"):
        make_policy("fifo", 4)
    with pytest.raises(ConfigError, match="future"):
        make_policy("belady", 4)
    with pytest.raises(ConfigError, match="trace replay only"):
        from kvtier.policies.belady import BeladyPolicy
        BlockIndex([("host", 4)], policy=BeladyPolicy(4, []))


@pytest.mark.parametrize("name", policy_names())
def test_every_policy_runs_in_the_index_and_respects_held_blocks(name):
    idx = BlockIndex([("host", 3)], policy=name, block_tokens=16)
    r = idx.reserve([1, 2, 3], prefix=[], start=0, parent=None)
    idx.commit(r)
    idx.acquire([1])                                    # held: must not be evicted
    r = idx.reserve([9, 8], prefix=[], start=0, parent=None)
    idx.commit(r)
    assert 1 in idx.ready
    assert len(idx.tiers[0].policy) == len(idx.entries) <= 3


# Random prefix-tree traces: each request extends a prefix of an earlier one.
@st.composite
def tree_traces(draw):
    n = draw(st.integers(1, 25))
    reqs: list[list[int]] = []
    nxt = 0
    for _ in range(n):
        keys: list[int] = []
        if reqs and draw(st.booleans()):
            base = reqs[draw(st.integers(0, len(reqs) - 1))]
            keys = base[:draw(st.integers(0, len(base)))]
        for _ in range(draw(st.integers(0 if keys else 1, 4))):
            keys.append(nxt)
            nxt += 1
        reqs.append(keys)
    partial = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return Trace("h", [Request(k, 16 * len(k) - (8 if p else 0), last_tokens=8 if p else None)
                       for k, p in zip(reqs, partial)], 16)


@settings(max_examples=60, deadline=None)
@given(tree_traces(), st.integers(1, 8))
def test_belady_never_below_online(trace, cap):
    best = replay(trace, "belady", cap).prefix_hits
    for name in policy_names():
        assert replay(trace, name, cap).prefix_hits <= best, name


@settings(max_examples=150, deadline=None)
@given(chains=st.lists(st.tuples(st.integers(1, 5), st.booleans(), st.booleans(), st.booleans()), min_size=1,
                       max_size=6),
       want=st.integers(1, 24), policy=st.sampled_from(["lru", "lru+nopartial", "arc"]))
def test_evicting_many_at_once_evicts_what_one_at_a_time_would(chains, want, policy):
    """BlockIndex.allocate evicts a run of drops in one walk of the policy (_drop_many); the
    slots, moves, entries and the policy's order after it are what _take_slot, one victim at
    a time, gives: over held, pinned, backed-up and not backed-up blocks, with demotions."""
    import copy

    from kvtier.index import Move

    idx = BlockIndex([("device", 16), ("host", 12), ("disk", 64)], policy=policy, block_tokens=4)
    for c, (blocks, backed_up, pinned, held) in enumerate(chains):
        keys = [bytes([c, j]) * 8 for j in range(blocks)]
        slots = idx.allocate(0, blocks, [])
        if slots is None:
            continue
        idx.cache(0, keys, slots)             # held by the caller
        if backed_up:
            res = idx.reserve_copies(keys, 1)
            idx.commit(res)
        if pinned:
            idx.pins.pin(f"s{c}", keys, ttl=600, tier=0)
        if not held:
            idx.release(keys)

    def run(batch: bool) -> tuple:
        i = copy.deepcopy(idx)
        if not batch:
            pol = i.tiers[0].policy
            pol = getattr(pol, "inner", pol)
            pol.victims = lambda kind, n: None      # the one-at-a-time path
        moves: list[Move] = []
        slots = i.allocate(0, want, moves)
        order = [list(getattr(getattr(t.policy, "inner", t.policy), "_order", [])) for t in i.tiers]
        state = {k: (e.tier, e.slot, e.refs, dict(e.copies or {})) for k, e in i.entries.items()}
        return slots, moves, state, order, [sorted(t.free) for t in i.tiers]
    assert run(True) == run(False)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["lru", "lfu", "arc", "s3fifo", "reuse"]),
       st.lists(st.tuples(st.sampled_from(["insert", "touch", "evict"]), st.integers(0, 11)), max_size=80))
def test_every_online_policy_keeps_an_order_of_exactly_its_blocks(name, ops):
    """order() is what a disk tier records at a flush and at close, so a restart adopts its
    blocks as they were used (it was LRU's only: ARC, LFU, S3-FIFO and reuse recorded none,
    and a flush sorted every block by depth instead). It lists every tracked block once;
    where eviction follows one order (LRU, LFU, reuse), the next victim comes first."""
    p = make_policy(name, 6)
    cached: set[int] = set()
    for op, k in ops:
        if op == "insert" and k not in cached and len(cached) < 6:
            p.insert(info(k))
            cached.add(k)
        elif op == "touch" and k in cached:
            p.touch([k])
        elif op == "evict" and cached:
            v = p.victim(ANY)
            assert v in cached
            p.remove(v)
            cached.discard(v)
        order = p.order()
        assert sorted(order) == sorted(cached)
        if order and name in ("lru", "lfu", "reuse"):
            assert p.victim(ANY) == order[0]
