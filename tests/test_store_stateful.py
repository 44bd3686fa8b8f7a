"""Stateful (model-based) tests of kvtier.Store.

A hypothesis RuleBasedStateMachine drives a real Store over one to three small tiers (host
memory; the lowest one on disk in some runs) with a fake clock, against a plain-Python
model that knows:

- every key ever put (the payload of a key is derived from the key alone, so the model
  never has to know which blocks were evicted: it only checks that what the store
  reports is real and byte-exact);
- every pin (session -> keys, floor tier, expiry), from which it predicts pin()'s return
  value (budget accounting), unpin()'s return value and stats' pinned counts;
- the store's operation counters.

After every step it checks: capacity never exceeded; per-tier counter identities (what
entered a tier less what left it is what it holds; what left a tier entered the next or
was dropped); every readable key was put and holds exactly its bytes; pinned blocks that
arrived stay readable (and in their floor tier or above) until the pin expires or is
released; distinct readable keys never exceed capacity, and when nothing is in flight the
index's copies in each tier are that tier's used slots and reading() holds the whole
cached prefix. A flood rule checks that blocks no longer pinned are evicted under
pressure; a put of exactly the top tier's slots is taken, one more is refused unchanged.

A few focused tests pin down single behaviours (leaf-first LRU, pin TTL boundary,
pin replacement) and two bugs found while writing this file (now fixed).
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvtier
import kvtier.store
from kvtier.errors import CapacityError, KeyNotCachedError

torch.set_num_threads(1)

LAYOUT = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=1, head_dim=4, block_tokens=4, dtype=torch.float16)
BB = LAYOUT.block_bytes          # 128 bytes
BT = LAYOUT.block_tokens         # 4 tokens
NS = kvtier.Namespace(model="stateful-test", revision="r1")
UNPINNED = 1 << 30

# Agent sessions sharing a system prompt: token sequences whose keys share prefixes.
SYS = list(range(1, 9))                                   # 2 blocks shared by most sequences
SEQS = [
    SYS + list(range(100, 112)),                          # 5 blocks
    SYS + list(range(100, 108)) + list(range(200, 208)),  # 6 blocks, shares 4 with SEQS[0]
    SYS + list(range(300, 316)),                          # 6 blocks, shares 2
    list(range(900, 912)),                                # 3 blocks, unrelated
    SYS + list(range(100, 112)) + list(range(400, 416)),  # 9 blocks, extends SEQS[0]
    SYS + list(range(300, 304)) + [7] * 7,                # 4 blocks (+ a partial one), shares 3 with SEQS[2]
]
SESSIONS = ["s0", "s1", "s2"]

_PAYLOAD: dict[bytes, np.ndarray] = {}


def payload_row(key: bytes) -> np.ndarray:
    """The bytes of the block stored under `key`: a pure function of the key."""
    row = _PAYLOAD.get(key)
    if row is None:
        rng = np.random.default_rng(int.from_bytes(key, "little"))
        row = rng.integers(0, 256, BB, dtype=np.uint8)
        row.flags.writeable = False
        _PAYLOAD[key] = row
    return row


def payload(keys, form: str):
    """The blocks of `keys` in one of the forms put() accepts."""
    raw = np.stack([payload_row(k) for k in keys]) if keys else np.empty((0, BB), np.uint8)
    if form == "numpy":
        return raw.copy()
    t = torch.from_numpy(raw.copy())
    if form == "u8":
        return t
    if form == "typed":
        return t.view(LAYOUT.dtype).reshape(len(keys), *LAYOUT.block_shape)
    return [t[i].clone() for i in range(len(keys))]       # "list"


def out_buffer(n: int, form: str):
    """A buffer for get() in one of the accepted forms, filled with a sentinel."""
    raw = np.full((n, BB), 0xA5, dtype=np.uint8)
    if form == "numpy":
        return raw
    t = torch.from_numpy(raw)
    if form == "u8":
        return t
    if form == "typed":
        return t.view(LAYOUT.dtype).reshape(n, *LAYOUT.block_shape)
    return [t[i].clone() for i in range(n)]


def out_rows(out) -> list[np.ndarray]:
    if isinstance(out, np.ndarray):
        return list(out)
    if isinstance(out, list):
        return [t.numpy() for t in out]
    return list(out.view(torch.uint8).reshape(out.shape[0], BB).numpy())


def assert_bytes(keys, out) -> None:
    rows = out_rows(out)
    assert len(rows) == len(keys)
    for i, (k, row) in enumerate(zip(keys, rows)):
        assert np.array_equal(row, payload_row(k)), f"block {i} of a get is not the bytes put under its key"


FORMS = st.sampled_from(["u8", "typed", "list", "numpy"])


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store: kvtier.Store | None = None
        self.now = 0.0
        self.ever: set[bytes] = set()                  # every key ever put
        self.sessions: dict[str, tuple[list[bytes], int, float]] = {}  # name -> (keys, floor tier, expires)
        self.prot: dict[bytes, int] = {}               # pinned key seen readable -> deepest tier allowed
        self.pending: list[tuple[str, kvtier.Transfer, list[bytes], object]] = []
        self.floods = 0
        self.c = dict(lookups=0, lookup_blocks=0, lookup_hit_blocks=0, gets=0, get_blocks=0,
                      puts=0, put_keys=0)

    # -- setup -----------------------------------------------------------------------
    @initialize(caps=st.one_of(st.tuples(st.integers(4, 12)),
                               st.tuples(st.integers(4, 12), st.integers(2, 8)),
                               st.tuples(st.integers(4, 12), st.integers(2, 8), st.integers(2, 8))),
                pin_budget=st.sampled_from([0.25, 0.5, 0.75, 0.9]), disk=st.booleans(),
                head=st.sampled_from([None, 1, 2]))
    def setup(self, caps, pin_budget, disk, head) -> None:
        # head: puts of 2*head+ blocks are reserved and written in two steps (store.py, _store)
        self.head_bytes = kvtier.store.PIPELINE_HEAD_BYTES
        if head is not None:
            kvtier.store.PIPELINE_HEAD_BYTES = head * BB
        self.caps = list(caps)
        self.pin_budget = pin_budget
        tiers = [kvtier.HostTier(blocks=c, name=f"t{i}") for i, c in enumerate(self.caps)]
        self.tmp = None
        if disk and len(caps) >= 2:   # the lowest tier on disk: verified reads, LMDB records
            self.tmp = tempfile.mkdtemp(prefix="kvtier-stateful-")
            last = len(caps) - 1
            tiers[last] = kvtier.DiskTier(self.tmp, blocks=caps[last], name=f"t{last}", io_threads=2)
        self.store = kvtier.Store(LAYOUT, tiers, NS, pin_budget=pin_budget, clock=lambda: self.now)
        self.chains = [self.store.keys(s) for s in SEQS]

    def teardown(self) -> None:
        kvtier.store.PIPELINE_HEAD_BYTES = getattr(self, "head_bytes", kvtier.store.PIPELINE_HEAD_BYTES)
        if self.store is not None:
            for _, t, _, _ in self.pending:
                try:
                    t.wait()
                except Exception:
                    pass
            self.store.close()
        if getattr(self, "tmp", None):
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- model helpers ---------------------------------------------------------------
    def active(self) -> dict[str, tuple[list[bytes], int, float]]:
        return {s: r for s, r in self.sessions.items() if r[2] > self.now}

    def floors(self) -> dict[bytes, int]:
        f: dict[bytes, int] = {}
        for keys, tier, _ in self.active().values():
            for k in keys:
                f[k] = min(f.get(k, UNPINNED), tier)
        return f

    def lookup(self, keys) -> kvtier.Hit:
        hit = self.store.lookup(keys)
        self.c["lookups"] += 1
        self.c["lookup_blocks"] += len(keys)
        self.c["lookup_hit_blocks"] += hit.blocks
        assert 0 <= hit.blocks <= len(keys)
        assert len(hit.tiers) == hit.blocks
        assert all(0 <= t < len(self.caps) for t in hit.tiers)
        assert hit.tokens == hit.blocks * BT
        assert sum(hit.by_tier().values()) == hit.blocks
        for k in keys[:hit.blocks]:
            assert k in self.ever, "lookup reported a key that was never put"
        return hit

    def pending_puts(self) -> bool:
        return any(op == "put" for op, _, _, _ in self.pending)

    def finish(self, op, t, keys, out) -> None:
        t.wait()
        if op == "get":
            assert_bytes(keys, out)

    def put_keys(self, keys, form: str, blocking: bool) -> kvtier.Transfer:
        self.ever.update(keys)
        t = self.store.put(keys, payload(keys, form), blocking=blocking)
        self.c["puts"] += 1
        self.c["put_keys"] += len(keys)
        assert t.present + t.rejected <= len(keys)
        return t

    # -- rules -----------------------------------------------------------------------
    @rule(seq=st.integers(0, len(SEQS) - 1), data=st.data(), form=FORMS, blocking=st.booleans())
    def put(self, seq, data, form, blocking) -> None:
        chain = self.chains[seq]
        lo = data.draw(st.one_of(st.just(0), st.integers(0, len(chain) - 1)), label="lo")
        hi = data.draw(st.integers(lo + 1, len(chain)), label="hi")
        keys = chain[lo:hi]
        if len(keys) > self.caps[0]:
            with pytest.raises(CapacityError):
                self.store.put(keys, payload(keys, form), blocking=blocking)
            return
        quiet = not self.pending
        before = [self.lookup([k]).blocks for k in keys] if quiet and blocking else []
        t = self.put_keys(keys, form, blocking)
        if not blocking:
            self.pending.append(("put", t, list(keys), None))
            return
        assert t.blocks + t.present + t.rejected == len(keys)
        if quiet and t.rejected == 0:
            # Everything was written or already there: the whole slice is readable now.
            for k in keys:
                assert self.lookup([k]).blocks == 1, "a put that rejected nothing left a block unreadable"
        elif quiet:
            # What the put stored is a prefix of what it was given: no block it stored sits
            # past one it left uncached (a lookup stops there: it could never be a hit).
            after = [self.lookup([k]).blocks for k in keys]
            gap = after.index(0) if 0 in after else len(keys)
            assert not any(a and not b for a, b in zip(after[gap:], before[gap:])), \
                f"the put stored blocks past position {gap}, which it left uncached"

    @rule(seq=st.integers(0, len(SEQS) - 1), form=FORMS, blocking=st.booleans())
    def lookup_get(self, seq, form, blocking) -> None:
        keys = self.chains[seq]
        hit = self.lookup(keys)
        n = hit.blocks
        if n == 0:
            return
        out = out_buffer(n, form)
        t = self.get_after_lookup(keys[:n], out, blocking)
        if t is None:
            return
        self.c["gets"] += 1
        self.c["get_blocks"] += n
        assert t.blocks == n and t.nbytes == n * BB
        if blocking:
            assert_bytes(keys[:n], out)
        else:
            self.pending.append(("get", t, list(keys[:n]), out))

    def get_after_lookup(self, keys, out, blocking):
        """get() right after a lookup must succeed, unless transfers still in flight (a
        pending get promotes what it read, which may evict) took the blocks meanwhile:
        lookup-then-get is not atomic, and KeyNotCachedError is how a store says so."""
        if not self.pending:
            return self.store.get(keys, out, blocking=blocking)
        try:
            return self.store.get(keys, out, blocking=blocking)
        except kvtier.KeyNotCachedError:
            return None

    @rule(seq=st.integers(0, len(SEQS) - 1), form=FORMS)
    def serve(self, seq, form) -> None:
        """What an engine does: lookup, load the hit prefix, compute and save the rest."""
        keys = self.chains[seq]
        n = self.lookup(keys).blocks
        if n:
            out = out_buffer(n, form)
            if self.get_after_lookup(keys[:n], out, True) is None:
                return
            self.c["gets"] += 1
            self.c["get_blocks"] += n
            assert_bytes(keys[:n], out)
        rest = keys[n:n + self.caps[0]]
        if rest:
            t = self.put_keys(rest, form, True)
            assert t.blocks + t.present + t.rejected == len(rest)

    @rule(seq=st.integers(0, len(SEQS) - 1), data=st.data(), fail=st.booleans())
    def save_in_place(self, seq, data, fail) -> None:
        """An engine's save written straight into reserved slots (Store.write_in_place; in two
        parts when the pipelined variant shrinks PIPELINE_HEAD_BYTES); a copy that fails, in
        either part, leaves nothing readable and frees every slot."""
        chain = self.chains[seq]
        lo = data.draw(st.integers(0, len(chain) - 1), label="lo")
        keys = chain[lo:data.draw(st.integers(lo + 1, len(chain)), label="hi")]
        if len(keys) > self.caps[0]:
            with pytest.raises(CapacityError):
                self.store.write_in_place(keys, lambda w: None)
            return
        quiet = not self.pending
        self.ever.update(keys)
        fail_in = data.draw(st.sampled_from(["write", "wait"]), label="fail_in") if fail else None
        reserved: list = []          # every part the store reserved (what its counters count)
        real = self.store._reserve

        def spy(keys, part=None):
            reserved.append(real(keys, part))
            return reserved[-1]

        def write(w) -> None:
            mem = w.memory.numpy()
            for slot, pos in zip(w.slots.tolist(), w.positions):
                mem[slot] = payload_row(keys[pos])
            if fail_in == "write":
                raise OSError("the engine's copy failed")

        waits = []

        def wait() -> None:
            waits.append(1)
            if fail_in == "wait":
                raise OSError("the engine's copies failed")
        self.store._reserve = spy
        try:
            self.store.write_in_place(keys, write, wait)
        except OSError:
            if not fail:
                raise
        finally:
            del self.store._reserve
        self.c["puts"] += 1                       # one save, however many parts it was reserved in
        if any(r.keys for r in reserved):         # copies may have been queued: waited for, even on failure
            assert waits, "write_in_place freed slots without waiting for the copies into them"
        positions = [p for r in reserved for p in r.positions]
        present, rejected = sum(r.present for r in reserved), sum(r.rejected for r in reserved)
        if not fail:
            assert len(positions) + present + rejected == len(keys)
        self.c["put_keys"] += present + rejected + (0 if fail else len(positions))
        if fail and quiet:
            for pos in positions:
                assert self.lookup([keys[pos]]).blocks == 0, "a failed in-place save left a block readable"

    @rule(seq=st.integers(0, len(SEQS) - 1))
    def read_in_place(self, seq) -> None:
        """An engine's load read straight from where the blocks are held (Store.reading)."""
        keys = self.chains[seq]
        hit = self.lookup(keys).blocks if not self.pending else None
        with self.store.reading(keys) as held:
            rows = held.rows()
            assert len(rows) == held.blocks == len(held.tiers) <= len(keys)
            if hit is not None:          # nothing in flight: it holds the whole cached prefix
                assert held.blocks == hit, "reading() held less than the cached prefix"
            for k, r in zip(keys, rows):
                assert np.array_equal(r, payload_row(k)), "a held block's bytes are not the block's"
        self.c["gets"] += 1
        self.c["get_blocks"] += held.blocks

    @rule(over=st.sampled_from([0, 1]), form=FORMS)
    def put_at_capacity(self, over, form) -> None:
        """A put of exactly the top tier's slots is taken (blocks pinned there may refuse
        some); one block more is a CapacityError that changes nothing."""
        self.wait_all()         # transfers in flight would change the tiers meanwhile
        self.floods += 1
        chain = self.store.keys([20_000_000 + 10_000 * self.floods + i for i in range((self.caps[0] + over) * BT)])
        if over:
            before = self.store.stats()
            with pytest.raises(CapacityError):
                self.store.put(chain, payload(chain, form))
            after = self.store.stats()
            assert [t.used_blocks for t in after.tiers] == [t.used_blocks for t in before.tiers]
            assert after.counters.puts == before.counters.puts
            return
        t = self.put_keys(chain, form, True)
        assert t.blocks + t.present + t.rejected == len(chain) and t.present == 0

    @precondition(lambda self: not self.pending_puts())
    @rule(seq=st.integers(0, len(SEQS) - 1))
    def get_miss(self, seq) -> None:
        keys = self.chains[seq]
        n = self.lookup(keys).blocks
        if n == len(keys):
            return
        with pytest.raises(KeyNotCachedError):
            self.store.get(keys[:n + 1], out_buffer(n + 1, "u8"))
        # All or nothing: the failed get holds nothing (checked by flood: held blocks never leave).

    @rule(session=st.sampled_from(SESSIONS), seq=st.integers(0, len(SEQS) - 1), data=st.data(),
          ttl=st.sampled_from([1.0, 2.5, 5.0, 20.0]))
    def pin(self, session, seq, data, ttl) -> None:
        chain = self.chains[seq]
        hi = data.draw(st.integers(1, len(chain)), label="hi")
        tier = data.draw(st.integers(0, len(self.caps) - 1), label="tier")
        keys = chain[:hi]
        # Model: drop this session's pin and expired ones, then pin the longest prefix
        # whose newly floored keys fit the tier's budget.
        self.sessions.pop(session, None)
        self.sessions = self.active()
        floors = self.floors()
        counts = [0] * len(self.caps)
        for f in floors.values():
            counts[f] += 1
        budget = int(self.pin_budget * self.caps[tier])
        expect = 0
        for k in keys:
            old = floors.get(k, UNPINNED)
            if old > tier:
                if counts[tier] + 1 > budget:
                    break
                counts[tier] += 1
                if old != UNPINNED:
                    counts[old] -= 1
                floors[k] = tier
            expect += 1
        got = self.store.pin(session, keys, ttl, tier=tier if data.draw(st.booleans(), label="by_index")
                             else f"t{tier}")
        assert got == expect, f"pin returned {got}, model expected {expect}"
        self.sessions[session] = (list(keys[:got]), tier, self.now + ttl)

    @rule(session=st.sampled_from(SESSIONS))
    def unpin(self, session) -> None:
        rec = self.active().get(session)
        self.sessions.pop(session, None)
        got = self.store.unpin(session)
        assert got == (len(rec[0]) if rec else 0)

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5, 7.0]))
    def advance(self, dt) -> None:
        self.now += dt
        self.sessions = self.active()

    @precondition(lambda self: bool(self.pending))
    @rule()
    def wait_all(self) -> None:
        pending, self.pending = self.pending, []
        for p in pending:
            self.finish(*p)

    @rule()
    def flood(self) -> None:
        """Fill the store with fresh blocks: every block nobody pins must leave."""
        self.wait_all()
        self.floods += 1
        total = sum(self.caps)
        tokens = [10_000 * self.floods + i for i in range(2 * total * BT)]
        chain = self.store.keys(tokens)
        before = set(self.ever)
        stored_all = True
        for i in range(len(chain)):
            t = self.put_keys(chain[i:i + 1], "u8", True)
            stored_all &= t.rejected == 0
            if len(self.caps) == 1 and self.pin_budget < 1.0:
                assert t.rejected == 0, "single tier with an unpinned slot rejected a block"
        if not stored_all:
            return   # the top tier is all pinned: nothing flowed down to push older blocks out
        floors = self.floors()
        # A middle tier whose every slot holds a pinned block (pinned while already below its
        # floor: it may only move up) lets nothing flow past it: blocks below it stay.
        with self.store._lock:
            pinned_in = [0] * len(self.caps)
            for k, e in self.store.index.entries.items():
                if k in floors:
                    for t in [e.tier, *(e.copies or {})]:
                        pinned_in[t] += 1
        reach = next((t for t in range(1, len(self.caps) - 1) if pinned_in[t] == self.caps[t]), len(self.caps))
        for k in before:
            if k not in floors:
                hit = self.lookup([k])
                assert hit.blocks == 0 or hit.tiers[0] > reach, "an unpinned block survived a flood of fresh blocks"

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if self.store is None:
            return
        s = self.store.stats()          # also expires pins whose TTL passed
        quiet = not self.pending
        active = self.active()
        floors = self.floors()

        # Capacity and per-tier counter identities.
        assert [t.capacity_blocks for t in s.tiers] == self.caps
        for t in s.tiers:
            assert 0 <= t.used_blocks <= t.capacity_blocks
        # A copy enters a tier by a put or a promotion (inserted) or from the tier above
        # (demoted_in), and leaves it by eviction (moved down, or dropped); only the top
        # tier takes puts and promotions, and what leaves the bottom one is dropped.
        top, bottom = s.tiers[0], s.tiers[-1]
        assert top.demoted_in == 0 and all(t.inserted == 0 for t in s.tiers[1:])
        for t in s.tiers:
            assert t.inserted + t.demoted_in - t.evicted == t.used_blocks
        for upper, lower in zip(s.tiers, s.tiers[1:]):
            assert upper.evicted == lower.demoted_in + upper.dropped
        assert bottom.evicted == bottom.dropped

        # Pins: sessions and per-tier pinned counts match the model.
        assert s.pinned_sessions == len(active)
        want = [0] * len(self.caps)
        for f in floors.values():
            want[f] += 1
        assert [t.pinned_blocks for t in s.tiers] == want

        # Store counters.
        c = s.counters
        assert (c.lookups, c.lookup_blocks, c.lookup_hit_blocks) == (
            self.c["lookups"], self.c["lookup_blocks"], self.c["lookup_hit_blocks"])
        assert (c.gets, c.get_blocks) == (self.c["gets"], self.c["get_blocks"])
        assert sum(t.hits for t in s.tiers) == c.get_blocks
        assert c.puts == self.c["puts"]
        if quiet:
            assert c.put_blocks + c.put_present + c.put_rejected == self.c["put_keys"]
            assert c.put_bytes == c.put_blocks * BB

        # Readable keys: all were put, hold their exact bytes, and fit the capacity.
        readable: dict[bytes, int] = {}
        for k in self.ever:
            hit = self.lookup([k])
            if hit.blocks:
                readable[k] = hit.tiers[0]
        assert len(readable) <= sum(self.caps)
        copies = self.peek(readable, quiet)
        if quiet:                # the index's copies in each tier are its used slots
            assert copies == [t.used_blocks for t in s.tiers]

        # Pinned blocks that arrived stay readable, in their floor tier or above.
        for k in list(self.prot):
            if k not in floors:
                del self.prot[k]
        for k, f in floors.items():
            if k in self.prot:
                assert k in readable, "a pinned block left the store before its TTL"
                assert readable[k] <= self.prot[k], "a pinned block moved below its floor tier"
            if k in readable:
                # A block pinned while below its floor may only move up (promotion).
                self.prot[k] = max(f, readable[k])

    def peek(self, readable: dict[bytes, int], quiet: bool) -> list[int]:
        """White-box: read every copy of each readable block without touching LRU order;
        returns how many copies of ready blocks the index holds in each tier."""
        store = self.store
        with store._lock:
            idx = store.index
            assert set(idx.ready) <= self.ever, "the index holds a readable key that was never put"
            for k, tier in readable.items():
                e = idx.entries.get(k)
                if not quiet and (e is None or e.tier != tier):
                    continue   # a pending get's promotion may evict or move blocks meanwhile
                assert e is not None and e.ready, "lookup reported a block the index does not hold"
                assert e.tier == tier
                assert all(t > e.tier for t in (e.copies or {})), "a copy in or above the primary's tier"
                for t, slot in [(e.tier, e.slot), *(e.copies or {}).items()]:
                    assert np.array_equal(np.asarray(store.tiers[t].block(slot)), payload_row(k)), \
                        "a slot of a readable block does not hold the bytes put under its key"
            per_tier = [0] * len(self.caps)
            for e in idx.entries.values():
                if e.ready:
                    for t in [e.tier, *(e.copies or {})]:
                        per_tier[t] += 1
            return per_tier


StoreMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.filter_too_much])
TestStoreStateful = StoreMachine.TestCase


# -- focused properties ------------------------------------------------------------------
def make_store(*caps: int, pin_budget: float = 0.5, clock=None) -> kvtier.Store:
    tiers = [kvtier.HostTier(blocks=c, name=f"t{i}") for i, c in enumerate(caps)]
    kw = {} if clock is None else {"clock": clock}
    return kvtier.Store(LAYOUT, tiers, NS, pin_budget=pin_budget, **kw)


@settings(max_examples=40, deadline=None)
@given(cap=st.integers(2, 10), data=st.data())
def test_lru_evicts_leaves_first(cap, data):
    """A chain filling the tier loses its deepest blocks first, one per fresh block."""
    k = data.draw(st.integers(1, cap), label="fresh")
    with make_store(cap) as s:
        chain = s.keys(list(range(cap * BT)))
        s.put(chain, payload(chain, "u8"))
        for i in range(k):
            fresh = s.keys([50_000 + i * BT + j for j in range(BT)])
            assert s.put(fresh, payload(fresh, "u8")).rejected == 0
        hit = s.lookup(chain)
        assert hit.blocks == cap - k
        out = out_buffer(hit.blocks, "u8")
        s.get(chain[:hit.blocks], out)
        assert_bytes(chain[:hit.blocks], out)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 5), refresh=st.sampled_from(["get", "put"]), form=FORMS)
def test_reads_and_reputs_refresh_recency(m, refresh, form):
    """A chain used again (get or put of cached blocks) outlives an older, unused one."""
    with make_store(2 * m) as s:
        a = s.keys(list(range(m * BT)))
        b = s.keys(list(range(1000, 1000 + m * BT)))
        c = s.keys(list(range(2000, 2000 + m * BT)))
        s.put(a, payload(a, form))
        s.put(b, payload(b, form))
        if refresh == "get":
            s.get(a, out_buffer(m, form))
        else:
            assert s.put(a, payload(a, form)).present == m
        assert s.put(c, payload(c, form)).rejected == 0
        assert s.lookup(a).blocks == m
        assert s.lookup(b).blocks == 0
        assert s.lookup(c).blocks == m


@settings(max_examples=30, deadline=None)
@given(cap=st.integers(4, 10), ttl=st.sampled_from([1.0, 3.0, 10.0]))
def test_pin_holds_until_ttl_then_is_evictable(cap, ttl):
    """Pinned blocks survive any pressure while now < expiry; at expiry they go under pressure."""
    now = [0.0]
    with make_store(cap, clock=lambda: now[0]) as s:
        chain = s.keys(list(range(2 * BT)))
        s.put(chain, payload(chain, "u8"))
        assert s.pin("a", chain, ttl) == 2
        n = 0

        def flood():
            nonlocal n
            for _ in range(2 * cap):
                fresh = s.keys([90_000 + n * BT + j for j in range(BT)])
                n += 1
                s.put(fresh, payload(fresh, "u8"))

        flood()
        now[0] = ttl - 0.5
        flood()
        assert s.lookup(chain).blocks == 2
        assert s.stats().tiers[0].pinned_blocks == 2
        now[0] = ttl                       # expires at now + ttl (inclusive)
        flood()
        assert s.lookup(chain).blocks == 0
        assert s.stats().pinned_sessions == 0


def test_repin_replaces_and_unpin_releases():
    now = [0.0]
    with make_store(8, clock=lambda: now[0]) as s:
        a = s.keys(list(range(3 * BT)))
        assert s.pin("x", a, 10.0) == 3
        assert s.stats().tiers[0].pinned_blocks == 3
        assert s.pin("x", a[:1], 10.0) == 1       # replaces, not adds
        assert s.stats().tiers[0].pinned_blocks == 1
        assert s.pin("y", a, 10.0) == 3          # shared key counted once
        assert s.stats().tiers[0].pinned_blocks == 3
        assert s.unpin("y") == 3
        assert s.stats().tiers[0].pinned_blocks == 1
        assert s.unpin("x") == 1 and s.unpin("x") == 0
        assert s.stats().tiers[0].pinned_blocks == 0


def test_pin_with_repeated_keys_unpins_cleanly():
    """Pinning two prompts that share a system prompt under one session (keys repeat)."""
    now = [0.0]
    with make_store(8, clock=lambda: now[0]) as s:
        a = s.keys(SEQS[0])
        b = s.keys(SEQS[2])
        assert a[0] == b[0]
        both = list(a[:2]) + list(b[:3])
        distinct = len(set(both))
        assert distinct < len(both)
        assert s.pin("agent", both, 5.0) == distinct   # a shared key counts once
        assert s.stats().tiers[0].pinned_blocks == distinct
        now[0] = 10.0
        assert s.stats().pinned_sessions == 0   # expiry unpins the session cleanly
        assert s.unpin("agent") == 0


def test_put_not_rejected_while_unpinned_victims_exist():
    now = [0.0]
    with make_store(4, 2, pin_budget=0.9, clock=lambda: now[0]) as s:
        a = s.keys(list(range(2 * BT)))
        d = s.keys(list(range(50, 50 + BT)))
        e = s.keys(list(range(100, 100 + 3 * BT)))
        for ks in (a, d, e):
            s.put(ks, payload(ks, "u8"))          # a is demoted to t1; t0 = d (LRU), e0..e2
        assert s.lookup(a).tiers == [1, 1]
        assert s.pin("a", a, 100.0, tier=0) == 2  # t1 is now full of pinned blocks
        assert s.pin("d", d, 100.0, tier=1) == 1  # d may move down to t1 (it cannot: full)
        c = s.keys(list(range(200, 200 + BT)))
        t = s.put(c, payload(c, "u8"))
        assert t.rejected == 0, "rejected although e0..e2 in t0 are unpinned and evictable"


def test_a_pinned_block_with_no_room_below_stays_where_it_is():
    """A block pinned to the tier below its own may leave its tier only downwards: when every
    slot below is held (a load reading them), evicting it would drop a pinned block, so it
    stays put and the put goes to other victims."""
    with make_store(4, 2, pin_budget=0.5) as s:
        below = s.keys(list(range(2 * BT)))
        s.put(below, payload(below, "u8"))
        fill = s.keys(list(range(5_000, 5_000 + 4 * BT)))
        s.put(fill, payload(fill, "u8"))                   # `below` is demoted into the lower tier
        assert s.lookup(below).tiers == [1, 1]
        a = s.keys(list(range(7_000, 7_000 + BT)))
        assert s.pin("agent", a, 60.0, tier=1) == 1
        s.put(a, payload(a, "u8"))
        lower = [k for k, e in s.index.entries.items() if e.tier == 1]
        assert len(lower) == 2 and s.lookup(a).tiers == [0]
        with contextlib.ExitStack() as stack:             # the lower tier's slots: all held by loads
            assert all(stack.enter_context(s.reading([k])).blocks == 1 for k in lower)
            for i in range(8):                             # pressure on the top tier
                fresh = s.keys([9_000 + 10 * i + j for j in range(BT)])
                s.put(fresh, payload(fresh, "u8"))
            assert s.lookup(a).blocks == 1, "a pinned block was dropped for want of room below"
        out = out_buffer(1, "u8")
        s.get(a, out)
        assert_bytes(a, out)
