"""What an inference engine calls: look up a prompt's cached prefix, load it into the
engine's pages layer by layer, save new blocks, pin a session.

    adapter = KVAdapter(store)
    match = adapter.lookup(prompt_ids)                 # tokens -> keys -> longest cached prefix
    ...compute only prompt_ids[match.tokens:]...

Two ways to hold the KV pages:

- The pages ARE kvtier's device tier (the reference engine, kvtier/engine/): a page is one
  top-tier slot, and the store's PagePool (kvtier/pool.py) says who holds each one.
  `allocate / load / cache / free`: a prefix found in the device tier is used in place (no
  copy); one found lower down is read (verified) and copied into allocated pages layer by
  layer; full pages the engine wrote (or a load filled) become cached blocks by cache()
  (zero copies); free() ends a request's use of its pages, whatever their state.
- The engine owns its pages (vLLM and most engines): `load_into` returns at once; a loader
  thread reads the cached blocks (verified) and scatters them into the given pages layer
  by layer, flagging each layer (on a CPU too); `save_from` gathers pages into host blocks
  without blocking the engine's stream and puts them into the store.

docs/adapter.md maps each call onto vLLM's KV-connector API.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Sequence

import torch

from kvtier.errors import CapacityError, ClosedError, ConfigError, LayoutError, TransferError
from kvtier.handles import Transfer
from kvtier.ids import BlockKey, SlotId
from kvtier.inplace import HeldBlocks
from kvtier.keys import BlockKeys
from kvtier.pool import LoadPlan
from kvtier.store import Store
from kvtier.tiers.device import DeviceTier
from kvtier.transfer.pages import PagedKV, copy
from kvtier.transfer.streams import LayerLoader, LoadHandle, SaveHandle, Saver


@dataclass
class PrefixMatch:
    """The answer of lookup(): the keys of every full block of the tokens, and how many
    leading ones are cached (in any tier, or on a peer)."""

    keys: BlockKeys
    blocks: int
    tiers: list[str]          # the tier holding each cached block, e.g. ["device", "device", "host"]
    block_tokens: int

    @property
    def tokens(self) -> int:
        """Leading tokens whose KV can be loaded instead of computed."""
        return self.blocks * self.block_tokens


@dataclass
class PageLoad:
    """A cached prefix made usable as the engine's pages (the device tier): `pages[i]` is
    the page of block i. The first `cached` pages are cached blocks used in place; the
    blocks after them came from lower tiers (or lie between such blocks) and their bytes
    are copied in layer by layer: wait_for_layer(l) before layer l reads them. The engine
    cache()s them with its other full blocks after the step, and free()s every page when
    the request ends."""

    keys: BlockKeys
    pages: list[SlotId]
    cached: int                                # leading pages that are cached blocks already
    from_tiers: dict[str, int]                 # blocks per source tier, e.g. {"device": 10, "host": 6}
    copies: list[LoadHandle] = field(default_factory=list)   # layer-wise copies: lower tiers, then peers

    @property
    def blocks(self) -> int:
        return len(self.pages)

    @property
    def pending(self) -> bool:
        """Whether some blocks are copied into pages (wait before caching them)."""
        return bool(self.copies)

    def wait_for_layer(self, layer: int) -> None:
        for h in self.copies:
            h.wait_for_layer(layer)

    def wait(self) -> None:
        """Until every copy into the pages has ended (all of them, even after one failed: the
        pages may be reused right after); then the first failure, if any, is raised."""
        error: BaseException | None = None
        for h in self.copies:
            try:
                h.wait()
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error


@dataclass
class EnginePagesLoad:
    """A load into engine-owned pages, running on a loader thread: the store read (verified),
    then the scatter, layer by layer. Of the `requested` blocks the leading `loaded` ones
    arrive; the engine computes the rest (their pages are never written).

    `loaded` waits for the read. A load that fails (an I/O error, a failed copy) counts as
    loading nothing: `loaded` drops to 0 and `error` says why; the waits never raise, so
    read `loaded` after wait() to know which pages to recompute."""

    requested: int
    handle: LoadHandle | None

    @property
    def error(self) -> BaseException | None:
        return self.handle.error if self.handle is not None else None

    @property
    def loaded(self) -> int:
        """Leading blocks whose pages hold their bytes (0 if the load failed): waits until the
        loader knows how many it holds, not for the copies."""
        if self.handle is None:
            return 0
        try:
            rows = self.handle.wait_rows()
        except TransferError:
            return 0
        return 0 if self.handle.error is not None else rows

    def wait_for_layer(self, layer: int) -> None:
        """Before layer `layer` reads the pages: on a GPU the current stream waits for that layer's copy."""
        if self.handle is None:
            return
        try:
            self.handle.wait_for_layer(layer)
        except TransferError:       # failed: `loaded` is 0 now and the engine recomputes
            pass

    def wait(self) -> int:
        """Block until every layer is in place (or the load failed); the blocks loaded."""
        for layer in range(self.handle.num_layers if self.handle is not None else 0):
            self.wait_for_layer(layer)
        if self.handle is not None and self.handle.error is None:
            self.handle.wait()
        return self.loaded


@dataclass
class EnginePagesSave:
    """A save from engine-owned pages: wait_for_pages() before overwriting them, wait() for the store."""

    saved: SaveHandle | None       # None: the pages were already copied into the store
    keys: BlockKeys
    store: Store
    _put: Transfer | None = None

    def wait_for_pages(self) -> None:
        """Until the engine may overwrite the pages (their bytes are gathered)."""
        if self.saved is not None:
            self.saved.wait_for_pages()

    def wait(self) -> Transfer:
        """The store's put of the gathered blocks (started on the first call): host rows are
        put; device rows go by DMA straight into reserved host-tier slots."""
        if self._put is None:
            saved = self.saved
            assert saved is not None
            if saved.blocks.device.type == "cpu":
                self._put = self.store.put(self.keys, saved.wait())
            else:   # device rows: DMAs straight into host-tier slots, the first part's queued
                    # while the rest of the slots are reserved (Store.write_in_place)
                self._put = self.store.write_in_place(
                    self.keys, lambda w: saved.copy_to(w.memory, w.positions, w.slots.tolist(), wait=False),
                    saved.wait_copies)
        return self._put


class KVAdapter:
    """The engine-facing surface of a Store. One per engine (per tensor-parallel rank)."""

    def __init__(self, store: Store) -> None:
        if not isinstance(store, Store):
            raise ConfigError(f"KVAdapter needs a kvtier.Store, got {type(store).__name__}")
        self.store = store
        self.layout = store.layout
        self.block_tokens = store.layout.block_tokens
        self._pool_loader: LayerLoader | None = None     # lower-tier blocks -> device-tier pages
        self._paged: PagedKV | None = None        # the engine's pages load_into/save_from last moved,
        self._loader: LayerLoader | None = None   # and their copiers (made on first use)
        self._saver: Saver | None = None
        # Copiers are chosen and handed work under this lock: a call with another PagedKV
        # closes the last one's loader, which must not happen between another thread
        # choosing it and queueing its load ("cannot schedule new futures after shutdown").
        self._copiers_lock = threading.Lock()
        self._closed = False

    def _check_open(self) -> None:
        """(With _copiers_lock held.) A closed adapter starts no copier again: its threads
        would outlive close() and never be stopped."""
        if self._closed:
            raise ClosedError("this KVAdapter is closed; make a new KVAdapter(store) (the store stays open "
                              "until store.close())")

    # -- tokens -> keys -> lookup -----------------------------------------------------
    def keys(self, tokens: object, parent: BlockKeys | None = None) -> BlockKeys:
        """Keys of the full blocks of `tokens`, continuing `parent`'s chain if given."""
        return self.store.keys(tokens, parent)

    def lookup(self, tokens: object, parent: BlockKeys | None = None) -> PrefixMatch:
        """The longest cached prefix of `tokens` (token ids), in every tier and on peers."""
        keys = self.keys(tokens, parent)
        hit = self.store.lookup(keys)
        return PrefixMatch(keys, hit.blocks, [hit.tier_names[t] for t in hit.tiers], self.block_tokens)

    # -- the engine's pages are the device tier ---------------------------------------
    @property
    def device_tier(self) -> DeviceTier:
        top = self.store.tiers[0]
        if not isinstance(top, DeviceTier):
            raise ConfigError("this call needs a store whose first tier is a DeviceTier (the engine's pages); "
                              "an engine with its own pages uses load_into/save_from instead")
        return top

    def pool(self) -> torch.Tensor:
        """The device tier as pages: [slots, *layout.block_shape] in the KV dtype (a view)."""
        t = self.device_tier.tensor
        assert t is not None
        return t.view(self.layout.dtype).view(t.shape[0], *self.layout.block_shape)

    def allocate(self, n: int) -> list[SlotId] | None:
        """`n` empty pages (device-tier slots) for new tokens, or None when that many cannot be
        freed (everything else referenced or pinned): preempt a request and try again. More
        pages than the device tier has at all is a CapacityError: no preemption can help."""
        capacity = self.device_tier.capacity_blocks
        if isinstance(n, int) and not isinstance(n, bool) and n > capacity:
            raise CapacityError(f"allocate({n}): the device tier has {capacity} pages in all; a request this "
                                "long needs a larger device_capacity (or fewer tokens per request)")
        return self.store.pages.allocate(n)

    def cache(self, keys: Sequence[BlockKey], pages: Sequence[SlotId]) -> int:
        """Full pages whose KV is written become cached blocks (no copy); the engine keeps
        using them. Pages cached already are skipped. Returns how many became cached."""
        self.device_tier
        return self.store.pages.cache(keys, pages)

    def free(self, pages: Sequence[SlotId]) -> None:
        """The engine is done with these pages (allocated, loaded or cached): each cached block
        stays cached, evictable once no request uses it; other pages are free again."""
        self.device_tier
        if pages:
            self.store.pages.free(pages)

    def load(self, match: PrefixMatch) -> PageLoad:
        """Make the cached prefix of `match` usable as pages: device-tier blocks in place,
        lower-tier blocks read (verified) and copied into allocated pages layer by layer,
        planned in one step under the store's lock; then blocks past the local prefix are
        fetched from peers (verified) into allocated pages. The prefix may come back shorter
        than match.blocks (a block failed verification, was evicted since the lookup, or no
        page was free): compute from load.blocks on."""
        if not isinstance(match, PrefixMatch):
            raise LayoutError(f"load() takes what lookup(tokens) returned (a PrefixMatch), not "
                              f"{type(match).__name__}: match = adapter.lookup(tokens); adapter.load(match)")
        st, tier = self.store, self.device_tier
        with self._copiers_lock:
            self._check_open()
        plan = st.pages.plan(match.keys[:match.blocks])
        n, handle = len(plan.pages), None
        if plan.lower:
            try:
                got, handle = self._copy_lower(plan, tier)
            except BaseException:                 # nothing stays referenced by a load that failed
                st.pages.free(plan.pages)
                raise
            if got < len(plan.lower):             # the prefix ends at the first block that failed
                n = plan.lower[got]
                st.pages.free(plan.pages[n:])
        counts: dict[str, int] = {}
        for t in plan.tiers[:n]:
            counts[st.tier_names[t]] = counts.get(st.tier_names[t], 0) + 1
        cached = plan.lower[0] if plan.lower and plan.lower[0] < n else n
        pages, copies = plan.pages[:n], [handle] if handle is not None else []
        if st.remote is not None and n == len(plan.pages) < match.blocks:
            got, fetched = self._fetch_peers(match.keys[n:match.blocks], tier)
            if got:
                pages += got
                copies.append(fetched)            # type: ignore[arg-type]
                counts[st.remote.name] = len(got)
                n += len(got)
        return PageLoad(match.keys[:n], pages, cached, counts, copies)

    def _into_pages(self, tier: DeviceTier, hold: Callable[[], ContextManager[HeldBlocks]],
                    pages: list[SlotId], in_memory: bool = False) -> tuple[int, LoadHandle]:
        """Copy the blocks `hold()` holds straight into `pages` of the device tier, layer by
        layer on the loader's thread (one DMA per run of rows on a GPU, a memcpy on a CPU,
        beside the engine's compute); how many leading blocks arrive, and the copy.
        in_memory: every block is in a memory tier, so all of them arrive (nothing to verify)
        and this returns without waiting for the loader's thread to hold them."""
        with self._copiers_lock:
            self._check_open()
            if self._pool_loader is None:
                self._pool_loader = LayerLoader(PagedKV.of_pool(tier.tensor, self.layout), self.layout, threaded=True)
            handle = self._pool_loader.load_held(hold, torch.tensor(pages, dtype=torch.int64)[:, None],
                                                 rows=len(pages) if in_memory else None)
        return handle.wait_rows(), handle

    def _fetch_peers(self, keys: Sequence[BlockKey], tier: DeviceTier) -> tuple[list[SlotId], LoadHandle | None]:
        """Blocks past the local prefix, fetched from peers (Store.reading: verified, into the
        store's read buffer) and copied into newly allocated pages; the pages that got one."""
        st = self.store
        pages = st.pages.allocate(len(keys)) or []
        if not pages:
            return [], None
        try:
            got, handle = self._into_pages(tier, lambda: st.reading(keys, promote=False), pages)
        except BaseException:
            st.pages.free(pages)
            raise
        if got < len(pages):
            st.pages.free(pages[got:])
        return pages[:got], handle

    def _copy_lower(self, plan: LoadPlan, tier: DeviceTier) -> tuple[int, LoadHandle]:
        """Copy the plan's lower-tier blocks into their pages; how many leading ones arrived.
        The blocks stay held for reading until their bytes are copied (or this fails)."""
        st = self.store
        lower = [plan.keys[i] for i in plan.lower]
        started = False

        def reads() -> ContextManager[HeldBlocks]:
            nonlocal started
            started = True
            try:
                return st._held_reads(lower, plan.store_locs, promote=False)   # its exit releases the holds
            except BaseException:
                st._release(lower)
                raise
        in_memory = all(st.tiers[t].memory() is not None for t in {t for t, _ in plan.store_locs})
        try:
            return self._into_pages(tier, reads, [plan.pages[i] for i in plan.lower], in_memory)
        except BaseException:
            if not started:                       # never handed to the loader's thread
                st._release(lower)
            raise

    # -- the engine owns its pages -------------------------------------------------------
    def _engine_pages(self, paged: PagedKV, page_table: object, keys: Sequence[BlockKey],
                      unique: bool = False) -> torch.Tensor:
        """Check the call; the table, checked (once: the copiers are told so, so no second check
        and no copy back from a GPU)."""
        if not isinstance(paged, PagedKV):
            raise LayoutError("paged must be a kvtier.transfer.PagedKV over the engine's per-layer pages")
        if paged.device.type not in ("cpu", "cuda"):
            raise LayoutError(f"the engine's pages are on {paged.device}, but kvtier moves pages on the CPU or a "
                              "CUDA GPU only: keep the KV cache there (or copy these pages to one of them)")
        if paged.layout != self.layout:
            raise LayoutError(f"paged was built for {paged.layout.describe()} but the store holds "
                              f"{self.layout.describe()}: build the PagedKV with the store's layout")
        table = paged.table(page_table, unique=unique)
        if table.shape[0] != len(keys):
            raise LayoutError(f"page_table has {table.shape[0]} rows for {len(keys)} keys: one row per block")
        return table

    def _use(self, paged: PagedKV) -> None:
        """(With _copiers_lock held.) Copiers for `paged`: an adapter keeps one engine's (an
        engine has one PagedKV); another PagedKV replaces them, the last loader's loads
        still finishing."""
        if self._paged is not paged:
            if self._loader is not None:
                self._loader.close(wait=False)
            self._paged, self._loader, self._saver = paged, None, None

    def load_into(self, keys: Sequence[BlockKey], paged: PagedKV, page_table: object) -> EnginePagesLoad:
        """Load the cached blocks `keys` into the engine's pages named by `page_table`
        ([n, pages_per_block], one row per key). Returns at once: a loader thread reads the
        blocks (verified) and scatters them layer by layer; wait_for_layer(l) before layer l
        reads its pages. Blocks past `loaded` (not cached any more, corrupt, or the load
        failed) are not written: the engine recomputes them. A bad call (keys that are not
        this store's, a closed store, a bad table) raises here, not as a miss."""
        st = self.store
        st._check_open()
        st._check_keys(keys)
        table = self._engine_pages(paged, page_table, keys, unique=True)
        if not len(keys):
            return EnginePagesLoad(0, None)
        # Straight from the slots holding the blocks (blocks on disk or on a peer: read and
        # verified into the store's reused buffer first): one copy into host pages; into
        # pages on a GPU, one DMA per run of rows, then the scatter. Nothing staged per call.
        with self._copiers_lock:
            self._check_open()
            self._use(paged)
            if self._loader is None:
                self._loader = LayerLoader(paged, self.layout, threaded=True)
            return EnginePagesLoad(len(keys), self._loader.load_held(lambda: st.reading(keys), table, checked=True))

    def save_from(self, keys: Sequence[BlockKey], paged: PagedKV, page_table: object) -> EnginePagesSave:
        """Gather the engine's pages of full blocks `keys` into host memory without blocking
        the engine's stream (a memcpy on a CPU); wait_for_pages() before the engine reuses
        them; wait() on the result puts them into the store (from any thread)."""
        st = self.store
        st._check_open()
        with self._copiers_lock:
            self._check_open()
        table = self._engine_pages(paged, page_table, keys)
        if paged.device.type == "cpu" and st.tiers[0].memory() is not None:
            # Host pages: gathered straight into reserved top-tier slots (one copy), which
            # become cached blocks when the copy is done.
            done = st.write_in_place(keys, lambda w: copy(paged.views, table[w.positions], w.memory,
                                                          to_blocks=True, rows=w.slots))
            return EnginePagesSave(None, keys, st, done)
        with self._copiers_lock:
            self._check_open()
            self._use(paged)
            if self._saver is None:
                self._saver = Saver(paged, self.layout)
            saver = self._saver
        if paged.device.type == "cuda" and st.tiers[0].memory() is not None:
            # Pages on a GPU: gathered on the device now, layer by layer; wait() reserves host-tier
            # slots and DMAs each layer straight into them (the pinned tier is the DMA target).
            return EnginePagesSave(saver.gather(table, checked=True), keys, st)
        return EnginePagesSave(saver.save(table, checked=True), keys, st)   # type: ignore[arg-type]

    # -- sessions ----------------------------------------------------------------------
    def pin(self, session: str, keys: Sequence[BlockKey], ttl: float, tier: int | str | None = None) -> int:
        """Keep a session's prefix in `tier` or above for `ttl` seconds (default tier: the
        last memory tier, so a pinned prefix may leave the GPU but not memory)."""
        if tier is None:
            tiers = self.store.tiers
            mem = [i for i, t in enumerate(tiers) if not t.persistent]
            tier = mem[-1] if mem else 0
            if tier == 0 and isinstance(tiers[0], DeviceTier) and len(tiers) > 1:
                tier = len(tiers) - 1      # not into the engine's own pages: that would shrink them
        return self.store.pin(session, keys, ttl, tier)

    def unpin(self, session: str) -> int:
        return self.store.unpin(session)

    def close(self) -> None:
        """Stop the loader threads (after the loads in flight). Later loads and saves raise
        ClosedError; lookups, pins and free() still reach the store until it is closed."""
        with self._copiers_lock:
            self._closed = True
            loaders = (self._pool_loader, self._loader)
            self._pool_loader = self._paged = self._loader = self._saver = None
        for loader in loaders:
            if loader is not None:
                loader.close()
