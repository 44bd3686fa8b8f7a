"""Session pins (kvtier/pins.py): a key's floor is the highest tier any live pin gives it, and
the pins as a whole are bounded: a client can name as many sessions as it likes."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.pins import UNPINNED, Pins

KEYS = [bytes([i]) * 16 for i in range(12)]


def check(p: Pins) -> None:
    """Floors, per-tier counts and references against the live records, brute force."""
    want: dict[bytes, int] = {}
    for rec in p.sessions().values():
        for k in rec.keys:
            want[k] = min(want.get(k, UNPINNED), rec.tier)
    assert {k: p.floor(k) for k in want} == want and p.keys() == len(want)
    assert p.pinned == [sum(1 for t in want.values() if t == tier) for tier in range(len(p.capacities))]
    assert p.refs == sum(len(r.keys) for r in p.sessions().values()) <= max(p.ref_limit, max(
        (len(r.keys) for r in p.sessions().values()), default=0))
    assert {(r.expires, s) for s, r in p.sessions().items()} <= set(p._expiry)   # every pin can expire


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["pin", "unpin", "tick"]), st.integers(0, 7), st.integers(0, 2),
                              st.lists(st.sampled_from(KEYS), max_size=8)), max_size=40),
       limit=st.integers(4, 40))
def test_floors_counts_and_the_bound_hold_under_any_pins(ops, limit):
    now = [0.0]
    p = Pins([8, 20, 100], 0.5, lambda: now[0], ref_limit=limit)
    for op, session, tier, keys in ops:
        if op == "pin":
            n = p.pin(f"s{session}", keys, ttl=10 + session, tier=tier)
            assert p.sessions()[f"s{session}"].keys == list(dict.fromkeys(keys))[:n]   # the new pin stays
        elif op == "unpin":
            p.unpin(f"s{session}")
        else:
            now[0] += 3
            p.expire()
        check(p)


def test_past_the_bound_the_pins_nearest_expiry_go_first():
    """20,000 sessions pinning one 256-block prefix held 155 MB (each record lists its keys)."""
    now = [0.0]
    p = Pins([100, 1000], 0.5, lambda: now[0], ref_limit=50)
    for s in range(10):
        now[0] += 1
        assert p.pin(f"s{s}", KEYS[:10], ttl=60, tier=1) == 10
    assert p.refs == 50 and p.shed == 5
    assert sorted(p.sessions()) == [f"s{s}" for s in range(5, 10)]     # the 5 pinned last
    assert all(p.floor(k) == 1 for k in KEYS[:10])
    for s in range(5, 10):
        p.unpin(f"s{s}")
    assert p.refs == 0 and p.keys() == 0 and p.pinned == [0, 0]


def test_re_pinning_does_not_grow_the_expiry_heap():
    """Each re-pin pushed an entry that stayed until its old expiry: a session re-pinned every
    turn left rate x TTL of them. Stale entries are dropped once they outnumber live ones;
    expiry still unpins at the latest TTL."""
    now = [0.0]
    p = Pins([100, 1000], 0.5, lambda: now[0])
    for turn in range(5000):
        now[0] += 0.01
        p.pin(f"s{turn % 3}", KEYS[:4 + turn % 5], ttl=600, tier=1)
        assert len(p._expiry) <= 2 * p.count() + 65
    now[0] += 599.97
    p.expire()
    assert p.count() == 3              # each session's last pin runs its own TTL
    now[0] += 0.05
    p.expire()
    assert p.count() == 0 and p.refs == 0 and p.keys() == 0
