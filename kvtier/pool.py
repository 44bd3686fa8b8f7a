"""The one owner of a store's top-tier slots when they are an engine's KV pages.

Every slot of the top tier is in exactly one of three states, and only this object moves
it between them (the index keeps the eviction order and the holds; this class keeps who
has which page):

    free     in the index's free list, or a cached block nobody references (evictable)
    owned    allocate()d to the caller: its bytes are the caller's, no key names it
    cached   a cached block the caller references (held: never evicted or moved)

Four verbs; KVAdapter and the reference engine call them allocate, load, cache and free
(the adapter's load is plan() and the copies it plans):

    allocate(n)          free -> owned (evicting, demoting as needed)
    plan(keys)           the cached prefix as pages: top-tier blocks -> cached (in place),
                         lower-tier blocks -> owned pages their bytes are copied into
    cache(keys, pages)   owned -> cached, once the caller wrote (or a load copied) the bytes
    free(pages)          owned -> free; cached -> one reference fewer

A load is planned in one pass under the store's lock; the copies run outside it, holding
the blocks they read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from kvtier.errors import ConfigError, LayoutError
from kvtier.ids import TOP_TIER, BlockKey, SlotId, TierId
from kvtier.index import Move, Reservation

if TYPE_CHECKING:
    from kvtier.store import Store


@dataclass
class LoadPlan:
    """A cached prefix made pages, decided under the lock: `pages[i]` is the page of block i.

    Blocks `lower` (positions) came from lower tiers: their pages are owned and still empty,
    and `store_locs[j]` is where block lower[j] is held for reading until the copy ends
    (`Store._held_reads`). The rest are top-tier blocks, referenced in place."""

    keys: list[BlockKey]
    pages: list[SlotId]
    tiers: list[TierId]                                  # the tier each block was found in
    lower: list[int] = field(default_factory=list)
    store_locs: list[tuple[TierId, SlotId]] = field(default_factory=list)


class PagePool:
    """Who holds each top-tier slot of one store (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._owned: set[SlotId] = set()
        # page -> (its block's key, how many references the callers hold). A cached page
        # may be referenced by several requests at once (a shared prefix).
        self._refs: dict[SlotId, tuple[BlockKey, int]] = {}

    # -- free -> owned ----------------------------------------------------------------
    def allocate(self, n: int) -> list[SlotId] | None:
        """`n` empty pages, or None when the top tier cannot free that many (everything else
        is referenced or pinned). Less valuable blocks are evicted (demoted) to make room."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"allocate(n): n is a number of pages >= 0, got {n!r}")
        st = self._store
        with st._lock:
            st._check_open()
            slots = self._allocate(n)
            # Read under the lock: a pass that held blocks during _allocate is still copying now.
            retry = slots is None and st.backup is not None and st.backup.copying
        if retry:
            assert st.backup is not None
            with st.backup.paused(), st._lock:      # the blocks a backup held are evictable again
                st._check_open()
                slots = self._allocate(n)
        return slots

    def _allocate(self, n: int) -> list[SlotId] | None:
        """allocate() with the lock held."""
        st = self._store
        moves: list[Move] = []
        slots = st.index.allocate(TOP_TIER, n, moves)
        try:
            st._mover.apply(Reservation(moves=moves))     # evictions chosen stand even when slots is None
        except BaseException:
            if slots:
                st.index.free(TOP_TIER, slots)
            raise
        if slots:
            self._owned.update(slots)
        return slots

    # -- owned -> cached --------------------------------------------------------------
    def cache(self, keys: Sequence[BlockKey], pages: Sequence[SlotId]) -> int:
        """Owned pages whose bytes are in become the cached blocks `keys` (prefix order); the
        caller keeps referencing them. Pages already cached under the same key are left as
        they are; a page whose key another page caches already stays owned (free() handles
        both). Returns how many pages became cached blocks."""
        st = self._store
        st._check_keys(keys)
        if len(pages) != len(keys):
            raise LayoutError(f"cache: {len(keys)} keys but {len(pages)} pages; give one page per key")
        with st._lock:
            st._check_open()
            slots: list[SlotId | None] = []
            seen: set[SlotId] = set()
            for k, p in zip(keys, pages):
                if p in seen:
                    raise LayoutError(f"page {p} is named twice in one cache(): give each block its own page")
                seen.add(p)
                if p in self._owned:
                    slots.append(p)
                elif p in self._refs and self._refs[p][0] == k:
                    slots.append(None)               # cached under this key already
                else:
                    raise LayoutError(f"page {p} was not allocated or loaded by this pool (or is cached under "
                                      "another key): cache only pages allocate() or load() returned")
            top = st.index.tiers[0].counters
            refused = top.rejected
            done = st.index.cache(TOP_TIER, keys, slots)
            refused = top.rejected - refused
            for k, p, d in zip(keys, slots, done):
                if d:
                    self._owned.discard(p)           # type: ignore[arg-type]
                    self._refs[p] = (k, 1)           # type: ignore[index]
            tried, n = sum(s is not None for s in slots), sum(done)
            c = st.counters
            c.puts += 1
            c.put_blocks += n
            c.put_bytes += n * st.layout.block_bytes
            c.put_rejected += refused
            c.put_present += tried - n - refused
            new = [k for k, d in zip(keys, done) if d] if n else []
            backup: list[BlockKey] = []
            if new and st.backup is not None:
                # A loaded block keeps its copy where it came from: one already in the backup's
                # tier (a host hit) needs none, and its 256 keys cost the backup thread's Python
                # (GIL, store lock) beside the next steps for nothing.
                t, entries = st.backup.tier, st.index.entries
                backup = [k for k in new if not ((e := entries[k]).copies and t in e.copies)]
        if backup:
            st.backup.submit(backup)     # type: ignore[union-attr]
        if new and st.write_through:
            st._write_through(new)
        return n

    # -- cached prefix -> pages ---------------------------------------------------------
    def plan(self, keys: Sequence[BlockKey]) -> LoadPlan:
        """The longest locally cached prefix of `keys` as pages, in one pass under the lock:
        top-tier blocks referenced in place; blocks in lower tiers held for reading, each
        given an owned page. With no page to spare for them, the prefix stops at the first
        lower-tier block. Copy the bytes (Store._held_reads(plan.store_locs...)), then
        cache() the pages; free() them if the copy fails."""
        st = self._store
        st._check_keys(keys)
        plan = self._plan(keys, retry=st.backup is not None)
        if plan is None:                              # pages were held by a backup pass: again without
            assert st.backup is not None
            with st.backup.paused():
                plan = self._plan(keys, retry=False)
        assert plan is not None
        return plan

    def _plan(self, keys: Sequence[BlockKey], retry: bool) -> LoadPlan | None:
        """plan() in one pass under the lock; None (nothing held) where `retry` and the lower
        blocks found no pages while a backup pass held some."""
        st = self._store
        with st._lock:
            st._check_open()
            n, _ = st.index.lookup(keys)
            prefix = list(keys[:n])
            locs = st.index.acquire(prefix)          # held: nothing below evicts them
            lower = [i for i, (t, _) in enumerate(locs) if t > 0]
            owned: list[SlotId] | None = []
            if lower:
                try:
                    owned = self._allocate(len(lower))
                except BaseException:
                    st.index.unacquire(prefix)
                    raise
                if owned is None and retry and st.backup is not None and st.backup.copying:
                    st.index.unacquire(prefix)           # acquired again, and counted, by the retry
                    return None
                if owned is None:                     # not a page for each: a shorter prefix
                    n, prefix, locs, lower, owned = self._shorter(prefix, locs, lower)
            pages = [s for _, s in locs]
            for j, i in enumerate(lower):
                pages[i] = owned[j]                   # type: ignore[index]
            for i, (t, s) in enumerate(locs):
                if t == 0:
                    self._refs[s] = (prefix[i], self._refs.get(s, (None, 0))[1] + 1)   # type: ignore[arg-type]
            c = st.counters
            c.gets += 1
            c.get_blocks += n
            c.get_bytes += n * st.layout.block_bytes
        return LoadPlan(prefix, pages, [t for t, _ in locs], lower, [locs[i] for i in lower])

    def _shorter(self, prefix: list[BlockKey], locs: list[tuple[TierId, SlotId]],
                 lower: list[int]) -> tuple[int, list[BlockKey], list[tuple[TierId, SlotId]], list[int], list[SlotId]]:
        """(The lock held; no page for every lower-tier block.) The prefix as far as pages go:
        the top-tier blocks past the first lower one are let go, so the pages they fill can
        hold blocks nearer the root (a prefix whose head is in host memory and whose tail
        fills the pages loaded nothing), then it is rebuilt block by block: a block still in
        the top tier held again, a lower one held and given a page, until one gets none.
        Returns (n, prefix, locs, lower, owned pages) as _plan keeps them."""
        st = self._store
        index, first = st.index, lower[0]
        index.unacquire(prefix[first:])               # counted again as each is held back
        locs, lower, owned = locs[:first], [], []
        n = held = first                              # held: prefix[:held] is acquired
        try:
            for k in prefix[first:]:
                e = index.entries.get(k)
                if e is None or not e.ready:          # dropped to make room for a page
                    break
                (t, s), = index.acquire([k])
                held += 1
                if t > 0:
                    page = self._allocate(1)
                    if page is None:
                        index.unacquire([k])
                        held -= 1
                        break
                    owned += page
                    lower.append(n)
                locs.append((t, s))
                n += 1
        except BaseException:                         # (a demotion failed): nothing stays held or owned
            index.unacquire(prefix[:held])
            self._owned.difference_update(owned)
            index.free(TOP_TIER, owned)
            raise
        owned.sort()                                  # ascending, as allocate() gives them: one copy run
        return n, prefix[:n], locs, lower, owned

    # -- owned / cached -> free ----------------------------------------------------------
    def free(self, pages: Sequence[SlotId]) -> None:
        """Drop the caller's reference to each page: an owned page is free again; a cached
        block is evictable once nobody references it (it stays cached until then)."""
        st = self._store
        with st._lock:
            owned: set[SlotId] = set()
            drop: dict[SlotId, int] = {}              # cached page -> references this call drops
            for p in pages:                           # all checked before anything changes
                if p in self._owned:
                    if p in owned:
                        raise LayoutError(f"page {p} is named twice in one free(): free each page once")
                    owned.add(p)
                elif p in self._refs and drop.get(p, 0) < self._refs[p][1]:
                    drop[p] = drop.get(p, 0) + 1
                else:
                    raise LayoutError(f"page {p} is not allocated or referenced here (freed twice?): free only "
                                      "pages allocate() or load() returned, once each")
            released: list[BlockKey] = []
            for p, n in drop.items():
                key, refs = self._refs[p]
                released += [key] * n
                if refs == n:
                    del self._refs[p]
                else:
                    self._refs[p] = (key, refs - n)
            self._owned -= owned
            st.index.free(TOP_TIER, list(owned))
            st.index.release(released)

    # -- state, for tests and stats -------------------------------------------------------
    def owned(self) -> set[SlotId]:
        """Pages allocated and not cached."""
        with self._store._lock:
            return set(self._owned)

    def referenced(self) -> dict[SlotId, tuple[BlockKey, int]]:
        """Cached pages callers reference: page -> (key, references)."""
        with self._store._lock:
            return dict(self._refs)
