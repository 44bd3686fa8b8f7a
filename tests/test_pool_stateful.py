"""The page owner (kvtier/pool.py) under any order of allocate, load, cache, free, pins and
another client's puts: every top-tier slot is in exactly one state, no tier holds more
than its capacity, and a page a request uses always holds its own block's bytes (a block
evicted is never handed out again as if it were still there)."""
from __future__ import annotations

import shutil
import tempfile

import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvtier
from kvtier.adapter import KVAdapter

LAYOUT = kvtier.KVLayout.mla(num_layers=2, kv_lora_rank=8, rope_dim=8, block_tokens=4, dtype=torch.float32)
NS = kvtier.Namespace(model="pool-stateful", revision="r1")
DEVICE_BLOCKS = 6


def tokens_of(family: int, blocks: int) -> list[int]:
    return [family * 1000 + i for i in range(blocks * LAYOUT.block_tokens)]


def bytes_of(key: bytes) -> torch.Tensor:
    """The one right content of block `key` (what the engine computed for it)."""
    return torch.full(LAYOUT.block_shape, float(int.from_bytes(key[:2], "little")))


class PagePoolMachine(RuleBasedStateMachine):
    @initialize(disk=st.booleans(), backup=st.booleans())
    def open(self, disk: bool, backup: bool) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvtier-pool-")
        tiers: list = [kvtier.DeviceTier(blocks=DEVICE_BLOCKS, device="cpu"), kvtier.HostTier(blocks=4)]
        if disk:
            tiers.append(kvtier.DiskTier(f"{self.dir}/kv", blocks=8))
        self.store = kvtier.Store(LAYOUT, tiers, NS, promote=False, backup=backup)
        self.a = KVAdapter(self.store)
        self.requests: dict[int, tuple[list[bytes], list[int]]] = {}   # id -> (keys, pages)
        self.next_id = 0

    def teardown(self) -> None:
        if hasattr(self, "store"):
            self.a.close()
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- an engine's requests -------------------------------------------------------------
    @rule(family=st.integers(0, 3), blocks=st.integers(1, 3))
    def start(self, family: int, blocks: int) -> None:
        """Admit a request: load its cached prefix, allocate pages for the rest, compute
        them, cache every full block (as the reference engine's scheduler does)."""
        tokens = tokens_of(family, blocks)
        match = self.a.lookup(tokens)
        assert list(match.keys) == list(self.a.keys(tokens))          # same tokens -> same keys
        load = self.a.load(match)
        load.wait()
        # Cached blocks on the device are used in place (no page to find): the load may stop
        # short only where a block must be copied up from a lower tier.
        in_place = next((i for i, t in enumerate(match.tiers) if t != "device"), match.blocks)
        assert load.blocks >= in_place, "a load did not use the device's cached prefix"
        for k, p in zip(load.keys, load.pages):
            assert torch.equal(self.a.pool()[p], bytes_of(k)), "a load handed out a page without its block"
        fresh = self.a.allocate(len(match.keys) - load.blocks)
        if fresh is None:                                             # no room: give the prefix back
            self.a.free(load.pages)
            return
        for k, p in zip(match.keys[load.blocks:], fresh):
            self.a.pool()[p] = bytes_of(k)
        pages = list(load.pages) + fresh
        self.a.cache(match.keys, pages)
        if self.store.backup is not None:      # its copies down end before the next rule: hypothesis
            self.store.backup.drain()          # replays each case exactly (a pass holds its blocks)
        self.requests[self.next_id] = (list(match.keys), pages)
        self.next_id += 1

    @rule(n=st.integers(0, 3))
    def scratch(self, n: int) -> None:
        """A request that only allocates (a decode's pages before they fill)."""
        pages = self.a.allocate(n)
        if pages is not None:
            self.requests[self.next_id] = ([], pages)
            self.next_id += 1

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 1 << 16))
    def finish(self, pick: int) -> None:
        rid = sorted(self.requests)[pick % len(self.requests)]
        _, pages = self.requests.pop(rid)
        self.a.free(pages)

    # -- everything else that moves blocks -------------------------------------------------
    @rule(family=st.integers(4, 6), blocks=st.integers(1, 3))
    def another_clients_put(self, family: int, blocks: int) -> None:
        keys = self.store.keys(tokens_of(family, blocks))
        rows = torch.stack([bytes_of(k) for k in keys])
        try:
            self.store.put(keys, rows)
        except kvtier.CapacityError:
            pass

    @rule(family=st.integers(0, 3), blocks=st.integers(1, 3))
    def pin(self, family: int, blocks: int) -> None:
        self.a.pin(f"s{family}", self.store.keys(tokens_of(family, blocks)), ttl=1e6)

    @rule(family=st.integers(0, 3))
    def unpin(self, family: int) -> None:
        self.a.unpin(f"s{family}")

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def every_slot_in_exactly_one_state(self) -> None:
        if not hasattr(self, "store"):
            return
        index = self.store.index
        free = index.tiers[0].free
        owned = self.store.pages.owned()
        refs = self.store.pages.referenced()
        cached = {e.slot: k for k, e in index.entries.items() if e.tier == 0}
        assert len(free) == len(set(free)), "a slot is free twice"
        assert not (set(free) & owned) and not (set(free) & set(cached)), "a slot is both free and in use"
        assert not (owned & set(cached)), "a slot is both owned and a cached block"
        assert len(free) + len(owned) + len(cached) == DEVICE_BLOCKS, "a slot is unaccounted for"
        for p, (k, n) in refs.items():
            assert n > 0 and cached.get(p) == k, "a referenced page is not its cached block any more"
        for k, e in index.entries.items():           # between calls, the only holds are the callers'
            want = refs[e.slot][1] if e.tier == 0 and e.slot in refs else 0
            assert e.refs == want, "a block is held by nobody's reference (or unheld under one)"


    @invariant()
    def every_tiers_slots_are_free_or_hold_one_copy(self) -> None:
        """Below the device too: a slot is free, or holds exactly one block's copy, and the
        used count is what the index holds there."""
        if not hasattr(self, "store"):
            return
        index = self.store.index
        held: list[list[int]] = [[] for _ in index.tiers]
        for e in index.entries.values():
            for t, slot in [(e.tier, e.slot), *(e.copies or {}).items()]:
                held[t].append(slot)
        for i, (ts, t) in enumerate(zip(index.tiers, self.store.stats().tiers)):
            free = list(ts.free)
            if i == 0:
                continue            # the device: every_slot_in_exactly_one_state (pages lent too)
            assert len(set(held[i])) == len(held[i]), f"two blocks share a slot of tier {i}"
            assert not set(free) & set(held[i]), f"a slot of tier {i} is both free and holds a block"
            assert len(free) + len(held[i]) == t.capacity_blocks == ts.capacity
            assert t.used_blocks == len(held[i])

    @invariant()
    def pages_in_use_keep_their_bytes(self) -> None:
        if not hasattr(self, "store"):
            return
        refs = self.store.pages.referenced()
        owned = self.store.pages.owned()
        use: dict[int, int] = {}
        for keys, pages in self.requests.values():
            for i, p in enumerate(pages):
                assert (p in owned) != (p in refs)
                use[p] = use.get(p, 0) + 1
                if i < len(keys):
                    assert torch.equal(self.a.pool()[p], bytes_of(keys[i]))
        for p, n in use.items():
            assert p in owned and n == 1 or refs[p][1] == n, "references do not match the requests using a page"


PagePoolMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
TestPagePool = PagePoolMachine.TestCase
