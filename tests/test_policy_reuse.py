"""The reuse-protected LRU ("reuse"): keeps reused blocks over one-shot ones, is exactly
LRU when it has no signal (no reuse, or delta pinned at 0), adapts delta through its
ghosts, and keeps its state bounded."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.policies import POLICIES, BlockInfo, ReusePolicy, make_policy, policy_names
from kvtier.sim import replay
from kvtier.traces.model import Request, Trace

ANY = lambda k: True  # noqa: E731


def info(k, depth=0, tokens=16, bt=16):
    return BlockInfo(k, None, depth, tokens, bt, depth + 1)


def trace(reqs, bt=16):
    return Trace("t", [Request(keys=list(r), input_length=len(r) * bt) for r in reqs], bt)


def test_registered_with_nopartial():
    assert "reuse" in POLICIES and "reuse+nopartial" in policy_names()
    p = make_policy("reuse+nopartial", 8)
    assert p.name == "reuse+nopartial" and not p.offline
    assert not p.admit(info(1, tokens=5)) and p.admit(info(1))


def test_keeps_the_reused_block_and_evicts_one_shots():
    # Block 0 is reused once, then one-shot blocks stream through a cache of 4.
    # LRU evicts 0 after 4 newer blocks; reuse protects it for delta = 0.5 * 4 = 2 more ticks.
    reqs = [[0], [0], [1], [2], [3], [4], [0]]
    lru = replay(trace(reqs), "lru", 4)
    reuse = replay(trace(reqs), "reuse", 4)
    assert lru.hits == [0, 1, 0, 0, 0, 0, 0]
    assert reuse.hits == [0, 1, 0, 0, 0, 0, 1]


def test_victim_prefers_fresh_blocks_within_delta():
    p = ReusePolicy(4, protect=0.5)             # delta = 2 ticks
    for k in (1, 2):
        p.insert(info(k))
    p.touch([1])                                # 1 reused at t=3; 2 fresh at t=2
    assert p.victim(ANY) == 2
    p.remove(2)
    for k in (3, 4, 5):                         # t = 4, 5, 6
        p.insert(info(k))
    assert p.victim(ANY) == 3                   # 4 <= 3 + 2: the fresh block still goes first
    p.remove(3)
    p.insert(info(6))
    assert p.victim(ANY) == 4
    p.remove(4)
    assert p.victim(ANY) == 1                   # 6 > 3 + 2: the reused block is now too old
    assert p.victim(lambda k: k != 1) == 5      # held blocks are skipped


def test_ghosts_adapt_delta():
    p = ReusePolicy(2, protect=0.5, step=1.0)   # delta = 1
    for k in (1, 2):
        p.insert(info(k))
    p.touch([1])
    v = p.victim(ANY)
    p.remove(v)                                 # 2 -> ghost of A
    assert v == 2 and p.ghosts() == 1
    p.insert(info(2))                           # came back: fresh blocks went too early
    assert p.delta == 0.0
    p.touch([2])
    p.insert(info(3))
    v = p.victim(ANY)
    assert v == 1                               # both reused; 1 is older
    p.remove(v)
    p.insert(info(1))                           # reused block came back: protect more
    assert p.delta == 1.0


def test_remove_of_a_non_victim_leaves_no_ghost():
    p = ReusePolicy(4)
    p.insert(info(1))
    p.remove(1)                                 # dropped or moved, not evicted
    p.remove(99)                                # unknown key: ignored
    assert len(p) == 0 and p.ghosts() == 0


prefix_traces = st.lists(
    st.tuples(st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=60
).map(lambda rs: [[(root, d) for d in range(n)] for root, n in rs])


@settings(max_examples=60, deadline=None)
@given(prefix_traces, st.integers(1, 12))
def test_delta_zero_is_exactly_lru(reqs, cap):
    t = trace(reqs)
    pol = ReusePolicy(cap, protect=0.0, step=0.0)
    assert replay(t, pol, cap).hits == replay(t, "lru", cap).hits


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=8), min_size=1, max_size=80),
       st.integers(1, 10))
def test_without_reuse_it_is_lru(keysets, cap):
    # Every request brings only new blocks (nothing is ever reused): the B list stays
    # empty and the order is LRU's, whatever delta is.
    n, reqs = 0, []
    for ks in keysets:
        reqs.append(list(range(n, n + len(ks))))
        n += len(ks)
    t = trace(reqs)
    assert replay(t, ReusePolicy(cap, protect=2.0), cap).hits == replay(t, "lru", cap).hits


@settings(max_examples=80, deadline=None)
@given(prefix_traces, st.integers(1, 12), st.floats(0.0, 3.0), st.floats(0.0, 8.0))
def test_state_stays_bounded(reqs, cap, protect, step):
    pol = ReusePolicy(cap, protect=protect, step=step, max_protect=2.0)
    replay(trace(reqs), pol, cap)
    assert len(pol) <= cap
    assert pol.ghosts() <= cap
    assert 0.0 <= pol.delta <= 2.0 * cap
    assert not set(pol._a) & set(pol._b) and not set(pol._ga) & set(pol._gb)


def test_live_store_uses_it(layout, ns):
    store = kvtier.Store(layout, [kvtier.HostTier(blocks=4)], ns, policy="reuse+nopartial")
    toks = torch.arange(4 * layout.block_tokens)
    keys = store.keys(toks)
    store.put(keys, torch.zeros(len(keys), layout.block_bytes, dtype=torch.uint8))
    assert store.lookup(keys).blocks == 4
