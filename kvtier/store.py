"""The tiered store an engine calls: keys, lookup, get, put, pin, stats.

    tokens -> keys() -> lookup() -> get() into the engine's buffers
    engine buffers -> put() -> top tier -> (evicted) -> next tier down -> ... -> dropped

Decisions (which slot, which victim, who may be evicted) belong to the BlockIndex;
bytes live in the tiers; this class ties the two together under one lock and copies
bytes outside it. A block being read is held (never evicted or overwritten); a block
being written is invisible until its bytes are all in place. Blocks read from a tier
that verifies (disk) and fail verification are misses: the get reports how many leading
blocks it loaded, and the bad copies are dropped.
"""
from __future__ import annotations

import atexit
import gc
import itertools
import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, Sequence

import numpy as np
import torch

from kvtier.backup import AUTO_MIN_RATIO, Backup, backup_wanted, valid_backup
from kvtier.checksum import block_checksum
from kvtier.errors import ClosedError, ConfigError, LayoutError
from kvtier.handles import Transfer
from kvtier.ids import BlockKey, SlotId, TierId
from kvtier.index import BlockIndex, ChangeLog, Reservation
from kvtier.inplace import HeldBlocks, ReadGroup, WriteSlots
from kvtier.interrupts import deferred
from kvtier.keys import HASHES, KEY_BYTES, BlockKeys, Keyer, Namespace
from kvtier.layout import KVLayout
from kvtier.moves import Mover, group_by_tier
from kvtier.payload import as_rows
from kvtier.pool import PagePool
from kvtier.policies import DEFAULT_POLICY, policy_names
from kvtier.stats import StoreCounters, StoreStats, TierStats
from kvtier.submit import submit
from kvtier.tiers.base import PendingWrite, Tier, check_fit
from kvtier.net.remote import Remote

log = logging.getLogger("kvtier.store")

FEED_LIMIT = 1 << 16         # changes a watcher's feed keeps unread before it must start over
_SPARE_MAX_BYTES = 256 << 20    # the largest disk-read buffer a store keeps between reads
PIPELINE_HEAD_BYTES = 32 << 20  # a large put's first part, written while the rest is reserved (_store)
FLUSH_PART_BYTES = 64 << 20     # a flush writes blocks down in parts of this many bytes (_flush)

# Everything still open at interpreter exit is closed then, last registered first: every
# Store (so blocks held only in memory are written back to its disk tier even when nobody
# calls close()), and owners that must stop feeding or serving a store before it closes
# (the vLLM worker). Weak references: a store dropped without close() is not kept alive.
_AT_EXIT: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_exit_order = itertools.count()


def close_at_exit(obj: object) -> int:
    """Call `obj.close()` at interpreter exit if `obj` is still alive then; objects
    registered later close first. Returns a token for forget_at_exit()."""
    token = next(_exit_order)
    _AT_EXIT[token] = obj
    return token


def forget_at_exit(token: int) -> None:
    _AT_EXIT.pop(token, None)


def _close_all_at_exit() -> None:
    # An atexit hook runs after every non-daemon thread finished and after Python shut
    # the thread pools down; the disk tier then does its I/O on this thread.
    for token in sorted(_AT_EXIT.keys(), reverse=True):
        obj = _AT_EXIT.pop(token, None)
        if obj is None:
            continue
        try:
            obj.close()     # type: ignore[attr-defined]
        except Exception:
            log.exception("closing %s at interpreter exit failed: blocks it held only in memory were "
                          "not written to disk. Call close() before exiting to handle such errors",
                          type(obj).__name__)


atexit.register(_close_all_at_exit)


@dataclass
class Hit:
    """The answer of lookup(): the longest cached prefix and where each of its blocks lives."""

    blocks: int
    block_tokens: int
    tiers: list[TierId]       # tier index of each hit block (0 = top)
    tier_names: list[str]

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_tokens

    def by_tier(self) -> dict[str, int]:
        """How many of the hit blocks each tier holds."""
        counts = {name: 0 for name in self.tier_names}
        for t in self.tiers:
            counts[self.tier_names[t]] += 1
        return counts



def put_cuts(n: int, head: int) -> list[tuple[int, int]]:
    """(lo, hi) parts of a large put (n >= 2 * head), tail first: the last `head` blocks,
    written while the rest is reserved; then, from 3 * head blocks on, the middle and the
    first `head` blocks apart, so that the last write to land carries few records and the
    middle's are committed while it crosses (a disk tier's commit of 480 records took 0.3
    ms after the last byte; of 32, under 0.1)."""
    if n >= 3 * head:
        return [(n - head, n), (head, n - head), (0, head)]
    return [(n - head, n), (0, n - head)]


def pipeline_cuts(n: int, head: int) -> Iterator[tuple[int, int]]:
    """(lo, hi) parts of a save of n blocks, tail first: `head` blocks, then twice as many as
    the part before, the last one taking what would leave less than `head`. A part's
    copies run while the next, twice as big, is reserved: the index's work hides behind
    the copies in a few parts (6 for 512 blocks and a head of 16)."""
    hi, size = n, head
    while hi > 0:
        lo = hi - size
        if lo < head:
            lo = 0
        yield lo, hi
        hi, size = lo, 2 * size


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cycle collector off inside the block (back on after, if it was on).

    Speed: a store opened over a disk tier makes several objects per block it finds (its
    record, index entry, policy info), none of them in a cycle, and the collector ran over
    all of them again and again as they piled up: 1,000,000 blocks opened in 8.6-8.9 s,
    5.2-5.5 s with it paused (4 KiB blocks, records only)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Store:
    """A KV-cache store over an ordered list of tiers (fastest first)."""

    def __init__(self, layout: KVLayout, tiers: Sequence[Tier], namespace: Namespace, *,
                 remote: Remote | None = None,
                 policy: str | Sequence[str] = DEFAULT_POLICY, hash: str = "xxh3", pin_budget: float = 0.5,
                 write_through: bool = False, promote: bool = True, backup: bool | str = "auto",
                 io_threads: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(layout, KVLayout):
            raise ConfigError(f"layout must be a kvtier.KVLayout (KVLayout.mha/.mla), not {type(layout).__name__}")
        if not isinstance(namespace, Namespace):
            raise ConfigError("namespace must be a kvtier.Namespace(model=..., revision=..., salt=b'')")
        if isinstance(tiers, Tier) or not isinstance(tiers, Sequence) or not tiers:
            raise ConfigError("tiers must be a non-empty list of tiers, fastest first, e.g. [kvtier.HostTier(capacity='8GiB')]")
        tiers = list(tiers)
        if any(isinstance(t, Remote) for t in tiers):
            raise ConfigError("a Remote is not a tier: pass it as Store(layout, tiers, namespace, remote=Remote(...))")
        if not all(isinstance(t, Tier) for t in tiers):
            raise ConfigError("tiers must be local tiers (DeviceTier, HostTier, DiskTier), fastest first: "
                              "e.g. [HostTier(capacity='8GiB'), DiskTier('/nvme/kv', '200GiB')]")
        speed = {"device": 0, "host": 1, "disk": 2}
        ranks = [speed.get(t.kind, 1) for t in tiers]
        if ranks != sorted(ranks):
            # Blocks only move down: a disk above host memory kept blocks where nothing reads them
            # back after a restart (the host tier's were lost at close).
            raise ConfigError("tiers go fastest first: device, then host, then disk; got "
                              f"{', '.join(f'{t.name} ({t.kind})' for t in tiers)}")
        if not isinstance(policy, str) and (not isinstance(policy, Sequence)
                                            or not all(isinstance(p, str) for p in policy)):
            raise ConfigError(f"policy must be a policy name like {DEFAULT_POLICY!r} or one name per tier, "
                              f"got {policy!r} (one of {', '.join(policy_names())}; docs/policies.md)")
        if remote is not None and not isinstance(remote, Remote):
            raise ConfigError(f"remote must be a kvtier.Remote(peers, secret), not {type(remote).__name__}")
        self.remote = remote                # blocks past the local prefix are fetched from peers
        names = [t.name for t in tiers] + ([remote.name] if remote else [])
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}: pass name=... to tell them apart")
        if hash not in HASHES:
            raise ConfigError(f"unknown hash {hash!r}; choose one of {', '.join(HASHES)}")
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ConfigError(f"io_threads must be an int >= 1, got {io_threads!r}")
        for name, v in (("write_through", write_through), ("promote", promote)):
            if not isinstance(v, bool):
                raise ConfigError(f"{name} must be True or False, got {v!r}")
        if not valid_backup(backup):
            raise ConfigError(f"backup must be True, False or 'auto' (where the tier below holds "
                              f"{AUTO_MIN_RATIO:g}x the top tier's blocks), got {backup!r}")
        # Asked for with nothing to do it on: a setting silently doing nothing is a mistake's sign.
        if write_through and not any(t.persistent for t in tiers):
            raise ConfigError("write_through=True writes new blocks to a disk tier at once, and this store has "
                              "none: add a DiskTier (StoreConfig(disk_path=...)) or leave write_through off")
        if backup is True and len(tiers) < 2:
            raise ConfigError("backup=True copies the top tier's blocks one tier down, and this store has one "
                              "tier: add a tier below it or leave backup at 'auto'")
        self.layout = layout
        self.namespace = namespace
        self.tiers = tiers                  # local tiers; self.remote is consulted after them
        self.tier_names = names
        self.keyer = Keyer(namespace, layout, hash)
        self.write_through = write_through
        self.promote = promote
        identity = {"layout": layout.to_dict(), "namespace_seed": self.keyer.seed.hex(),
                    "namespace": {"model": namespace.model, "revision": namespace.revision,
                                  "shard": namespace.shard}, "hash": hash}
        for t in self.tiers:
            if getattr(t, "read_only", False):
                raise ConfigError(f"tier {t.name!r} is read-only: a store writes to its tiers "
                                  "(use `kvtier inspect PATH` to look inside a disk tier)")
        check_fit(self.tiers, layout.block_bytes)     # all of them, before any is allocated
        self._persistent = any(t.persistent for t in self.tiers)
        bound: list[Tier] = []
        try:
            with _gc_paused():
                for t in self.tiers:
                    t.bind(layout.block_bytes, identity)
                    bound.append(t)
                self.index = BlockIndex([(t.name, t.capacity_blocks) for t in self.tiers], policy,
                                        layout.block_tokens, pin_budget, clock)
                self.recovered = 0   # blocks found in persistent tiers when the store opened
                for i, t in enumerate(self.tiers):
                    if t.persistent:
                        self.recovered += self.index.adopt(i, t.recover())
        except BaseException:
            for t in bound:       # nothing stays locked or mapped by a store that never opened
                t.close()
            raise
        if self.remote is not None:
            self.remote.attach(self.keyer.seed, layout.block_bytes)
        self.counters = StoreCounters()
        self._lock = threading.Lock()
        self._mover = Mover(self.tiers, self.index, self._lock, self.counters)   # runs the index's moves
        self._io_threads = io_threads
        self._executor: ThreadPoolExecutor | None = None
        self._ahead: ThreadPoolExecutor | None = None   # writes a large put's first part (_store)
        self._spare: torch.Tensor | None = None   # a reused buffer for disk reads (reading())
        self._feeds: dict[str, ChangeLog] = {}   # watch(): changes not yet taken, per feed
        self._closed = False
        self.pages = PagePool(self)     # who holds each top-tier slot, for an engine whose pages they are
        # Blocks an engine caches in its pages (PagePool.cache) are copied one tier down in
        # the background, so their eviction at a later admission moves no bytes (kvtier.backup).
        self.backup = (Backup(self._mover, 1, self.tiers[0].capacity_blocks)
                       if backup_wanted(backup, [t.capacity_blocks for t in self.tiers]) else None)
        self._exit_token = close_at_exit(self)   # write-back blocks reach disk at exit without close()

    # -- tokens -> keys -> lookup ----------------------------------------------------
    def keys(self, tokens: object, parent: BlockKeys | None = None) -> BlockKeys:
        """Chained keys of the full blocks of `tokens` (continuing `parent` if given), tagged
        with this store's origin: a store of another namespace, layout or hash refuses them."""
        return self.keyer(tokens, parent)

    def lookup(self, keys: Sequence[BlockKey], *, local: bool = False) -> Hit:
        """The longest cached prefix of `keys` and the tier of each block; moves no data.
        With a remote, the peers are asked for what follows the local prefix, unless
        `local` (what a node answers its peers: asking its own peers in turn would send
        two nodes that list each other round in a loop until the deadline)."""
        self._check_keys(keys)
        with self._lock:
            self._check_open()
            n, locs = self.index.lookup(keys)
        if self.remote is not None and n < len(keys) and not local:
            m = len(self.remote.locate(keys[n:]))       # one round trip (directory or each peer)
            locs += [len(self.tiers)] * m
            n += m
        with self._lock:
            c = self.counters
            c.lookups += 1
            c.lookup_blocks += len(keys)
            c.lookup_hit_blocks += n
        return Hit(n, self.layout.block_tokens, locs, self.tier_names)

    # -- load ------------------------------------------------------------------------
    def get(self, keys: Sequence[BlockKey], out: object, *, blocking: bool = True,
            promote: bool | None = None) -> Transfer:
        """Copy the blocks of `keys` into `out` ([n, block_bytes] uint8, [n, *block_shape], or a list).

        Every key must be cached (get what lookup() returned); with a remote, the keys
        past the local prefix are fetched from peers. With blocking=False the copy runs
        on an I/O thread; wait() on the handle before reading `out`. The handle's `loaded`
        says how many leading blocks arrived intact. `promote` (default: the store's) copies
        blocks found in lower tiers up into the top tier.
        """
        self._check_keys(keys)
        rows = as_rows(out, len(keys), self.layout, "out", writable=True)
        with self._lock:
            self._check_open()
            n_local = self.index.lookup(keys)[0] if self.remote is not None else len(keys)
            locs = self.index.acquire(keys[:n_local])
            c = self.counters
            c.gets += 1
            c.get_blocks += len(keys)
            c.get_bytes += len(keys) * self.layout.block_bytes
        transfer = Transfer("get", len(keys), len(keys) * self.layout.block_bytes)
        promote = self.promote if promote is None else promote
        with self._uninterrupted():    # a promotion demotes evicted blocks, as a put does
            return self._run(transfer, lambda: self._load(keys, rows, n_local, locs, transfer, promote), blocking)

    def _load(self, keys: Sequence[BlockKey], rows: Sequence[np.ndarray], n_local: int,
              locs: list[tuple[TierId, SlotId]], transfer: Transfer, promote: bool) -> None:
        """Read the held blocks keys[:n_local] (locs), fetch the rest from peers, promote.

        Sets transfer.loaded to the leading blocks that arrived intact; releases the holds."""
        local = keys[:n_local]
        bad: list[tuple[int, int]] = []          # (position, tier) of blocks that failed
        try:
            if len(self.tiers) == 1:   # speed: one tier needs no grouping (a 128k prompt is 8,192 blocks)
                bad = [(j, 0) for j in self.tiers[0].read([s for _, s in locs], rows, None, local)]
            else:
                for t, slots, idx in group_by_tier(locs):
                    got = self.tiers[t].read(slots, rows, idx, [keys[i] for i in idx])
                    bad += [(idx[j], t) for j in got]
        finally:
            with self._lock:
                self.index.release(local)
        loaded = min((j for j, _ in bad), default=n_local)
        if bad:
            self._mover.discard([(keys[j], t) for j, t in bad])
        if loaded == n_local < len(keys) and self.remote is not None:
            loaded += self._fetch_remote(keys[n_local:], rows[n_local:])   # straight into `out`
        transfer.loaded = loaded
        if promote and len(self.tiers) > 1:
            lower = [i for i in range(min(loaded, n_local)) if locs[i][0] > 0]
            if lower:
                self._mover.copy_into(0, [keys[i] for i in lower], rows, lower)

    # -- save ------------------------------------------------------------------------
    def put(self, keys: Sequence[BlockKey], blocks: object, *, blocking: bool = True) -> Transfer:
        """Store blocks under `keys` (prefix order). Cached ones are refreshed, not rewritten.

        Blocks become visible to lookup() once written; with blocking=False the copy
        runs on an I/O thread and `blocks` must stay unchanged until wait() returns.
        """
        self._check_keys(keys)
        rows = as_rows(blocks, len(keys), self.layout, "blocks")
        with self._uninterrupted():
            return self._store(keys, rows, blocking)

    def _uninterrupted(self) -> ContextManager[None]:
        """Where a persistent tier is: a Ctrl-C waits until the operation is done, so it never
        lands between the index and the bytes of a demotion (kvtier.interrupts.deferred)."""
        return deferred() if self._persistent else nullcontext()

    def _store(self, keys: Sequence[BlockKey], rows: Sequence[np.ndarray], blocking: bool = True) -> Transfer:
        """put() after validation: `rows` are checked one-block uint8 rows."""
        n = len(keys)
        head = max(1, PIPELINE_HEAD_BYTES // self.layout.block_bytes)
        if n < 2 * head or n > self.index.tiers[0].capacity:
            whole = self._reserve(keys)
            if not whole.keys:
                return Transfer("put", 0, 0, whole.present, whole.rejected)
            res = whole.without(whole.unreachable())     # what Mover.commit keeps

            def save() -> None:
                self._mover.fill(whole, rows, whole.positions)
                self._written(res, rows)
            return self._run(self._put_transfer(res), save, blocking)
        # Speed: the index's work for a put (about 5 us a block in Python: 3 ms for 512
        # blocks) would all come before the first byte moves. A large put reserves its tail
        # part first (the order the index walks a put anyway: the same policy calls) and
        # starts writing it (Tier.begin_write: a disk on its I/O threads, memory on the
        # put-ahead thread), then reserves the rest meanwhile (put_cuts). All of it becomes
        # readable at once, as before. Disk tier, 512 x 1 MiB blocks, paired with raw O_DIRECT over
        # 40 rounds: 0.90 -> 0.92 of raw (session 9, the head on the put-ahead thread, which
        # waited for the GIL until the rest was reserved), 0.91 -> 0.94 (session 11, the
        # head started by the disk tier's own threads before the rest is reserved).
        cuts = put_cuts(n, head)
        first = self._reserve(keys, cuts[0])
        if self._ahead is None:
            # Its own thread, not the I/O pool: a put made on an I/O thread (a non-blocking
            # get keeping what it fetched from peers) must not wait on work queued behind it.
            self._ahead = ThreadPoolExecutor(1, thread_name_prefix="kvtier-put-ahead")
        try:
            started = self.tiers[0].begin_write(first.slots, rows, first.positions, first.keys,
                                                executor=self._ahead) if first.keys else PendingWrite.done()
        except BaseException:       # (a Ctrl-C while it started: the tier waited for its runs)
            self._mover.abort([first])
            raise
        parts = [first]
        try:
            for cut in cuts[1:]:
                parts.append(self._reserve(keys, cut))
        except BaseException as e:
            self._mover.settle(parts, [started] + [None] * (len(parts) - 1), e)   # waits, forgets all, raises e
            raise
        whole = Reservation.joined(parts)
        if not whole.keys:
            return Transfer("put", 0, 0, whole.present, whole.rejected)
        res = whole.without(whole.unreachable())         # what Mover.commit keeps

        def save_parts() -> None:
            self._mover.fill_parts(parts, started, rows)
            self._written(res, rows)
        return self._run(self._put_transfer(res), save_parts, blocking)

    def _put_transfer(self, res: Reservation) -> Transfer:
        return Transfer("put", len(res.keys), len(res.keys) * self.layout.block_bytes, res.present, res.rejected)

    def _reserve(self, keys: Sequence[BlockKey], part: tuple[int, int] | None = None) -> Reservation:
        """Top-tier slots for a save's new blocks, evictions carried out. A put counts once:
        a put reserved in parts (tail part first) counts with the part that reaches its root."""
        with self._lock:
            self._check_open()
            res = self.index.reserve(keys, part=part)
            self._mover.apply(res)
            c = self.counters
            if part is None or part[0] == 0:
                c.puts += 1
            c.put_present += res.present
            c.put_rejected += res.rejected
        return res

    def _written(self, res: Reservation, rows: Sequence[np.ndarray] | None = None) -> None:
        """A save's blocks are readable now: count them, and write them through to disk if the
        store is set so (from `rows`, or from their top-tier copies)."""
        with self._lock:
            self.counters.put_blocks += len(res.keys)
            self.counters.put_bytes += len(res.keys) * self.layout.block_bytes
        if self.write_through and res.keys:
            for i, tier in enumerate(self.tiers):
                if i > 0 and tier.persistent:
                    if rows is None:
                        self._mover.copy_into(i, res.keys)
                    else:
                        self._mover.copy_into(i, res.keys, rows, res.positions)

    def _run(self, transfer: Transfer, work: Callable[[], None], blocking: bool) -> Transfer:
        if blocking:
            work()
            return transfer
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._io_threads, thread_name_prefix="kvtier-io")
        transfer._future = submit(self._executor, work)
        return transfer

    def write_in_place(self, keys: Sequence[BlockKey], write: Callable[[WriteSlots], None],
                       wait: Callable[[], None] | None = None) -> Transfer:
        """A save written in place: reserve top-tier slots for the blocks of `keys` (prefix
        order) not cached yet and call `write` with them; it writes each block's bytes
        straight into its slot (e.g. gathers an engine's pages there: one copy, no staging
        buffer). `write` may only queue its copies (a GPU's DMAs) if `wait` waits for them.
        Then the blocks become readable (and are written through to disk if the store is set
        so); if `write` or `wait` raises, none of them is and the slots are freed.
        Needs a memory top tier (host or device memory), not a disk.

        Speed: with `wait` (a writer that only queues its copies), a large save is reserved
        in parts, tail first (pipeline_cuts: PIPELINE_HEAD_BYTES, then twice as much each
        time), and each part's copies are queued before the next part is reserved: the
        index's work (3 ms for 512 blocks with evictions, on an H200 a seventh of a 1 GiB
        save's DMA time) runs while earlier parts cross. A synchronous writer gets one part."""
        self._check_keys(keys)
        memory = self.tiers[0].memory()
        if memory is None:
            raise ConfigError(f"write_in_place() needs a memory top tier; this store's is {self.tiers[0].name}: "
                              "use put()")
        with self._uninterrupted():    # a Ctrl-C waits until it is committed or aborted
            return self._write_in_place(keys, write, wait, memory)

    def _write_in_place(self, keys: Sequence[BlockKey], write: Callable[[WriteSlots], None],
                        wait: Callable[[], None] | None, memory: torch.Tensor) -> Transfer:
        n = len(keys)
        head = max(1, PIPELINE_HEAD_BYTES // self.layout.block_bytes)
        cuts: list[tuple[int, int] | None] = [None]
        if wait is not None and 2 * head <= n <= self.index.tiers[0].capacity:
            cuts = list(pipeline_cuts(n, head))
        parts: list[Reservation] = []
        try:
            for cut in cuts:
                res = self._reserve(keys, cut)
                parts.append(res)
                if res.keys:
                    write(WriteSlots(memory, torch.tensor(res.slots, dtype=torch.int64), list(res.positions),
                                     res.present, res.rejected))
            if wait is not None:
                wait()
        except BaseException:
            if wait is not None and any(r.keys for r in parts):
                try:
                    wait()           # no copy may still be landing in a slot once it is freed
                except BaseException:
                    pass             # the first error is the one raised
            self._mover.abort(parts)
            if parts and len(parts) < len(cuts):
                with self._lock:
                    self.counters.puts += 1     # the part that reaches the root (which counts it) never came
            raise
        res = self._mover.commit(parts)
        self._written(res)
        return self._put_transfer(res)

    @contextmanager
    def reading(self, keys: Sequence[BlockKey], promote: bool | None = None, *,
                local: bool = False) -> Iterator[HeldBlocks]:
        """A load read in place: hold the longest locally cached prefix of `keys` and yield
        where each block's bytes are. Blocks in memory tiers are their slots (no copy);
        blocks on disk are read into a buffer of the store's and verified (the prefix ends
        at the first that fails; with `promote`, default the store's, they are also copied
        up into the top tier). With a remote, blocks past the local prefix are fetched from
        peers unless `local`. Nothing held is evicted or overwritten until the block exits."""
        self._check_keys(keys)
        with self._lock:
            self._check_open()
            n, _ = self.index.lookup(keys)
            held = keys[:n]
            locs = self.index.acquire(held)
            c = self.counters
            c.gets += 1
            c.get_blocks += n
            c.get_bytes += n * self.layout.block_bytes
        with self._held_reads(held, locs, promote) as blocks:
            if self.remote is None or local or blocks.blocks < n or n == len(keys):
                yield blocks
                return
            buffer = self._read_buffer(len(keys) - n)     # the rest from peers, verified
            try:
                got = self._fetch_remote(keys[n:], list(buffer.numpy()[:len(keys) - n]))
                if got:
                    with self._lock:
                        self.counters.get_blocks += got
                        self.counters.get_bytes += got * self.layout.block_bytes
                    blocks.groups.append(ReadGroup(buffer, torch.arange(got, dtype=torch.int64),
                                                   list(range(n, n + got))))
                    blocks.blocks += got
                    blocks.tiers += [len(self.tiers)] * got
                yield blocks
            finally:
                self._buffer_back(buffer)

    def _fetch_remote(self, keys: Sequence[BlockKey], rows: Sequence[np.ndarray]) -> int:
        """Fetch the longest prefix of `keys` peers hold into `rows` (verified), count it, and
        keep a copy in the local tiers if the remote is set to; how many arrived."""
        assert self.remote is not None
        fetched = self.remote.fetch(keys, rows)
        with self._lock:
            self.counters.remote_blocks += fetched
        if fetched and self.remote.promote:
            self._store(keys[:fetched], rows[:fetched])
        return fetched

    @contextmanager
    def _held_reads(self, keys: Sequence[BlockKey], locs: list[tuple[TierId, SlotId]],
                    promote: bool | None = None) -> Iterator[HeldBlocks]:
        """reading() after the lookup: `keys`, held (index.acquire) at `locs`, are read where
        they lie (disk: verified, into the reused buffer) and released when the block exits."""
        n, held = len(keys), keys
        bad: list[tuple[bytes, int]] = []
        buffer = None
        try:
            groups, tiers, stored = [], [t for t, _ in locs], []
            for t, slots, idx in group_by_tier(locs):
                memory = self.tiers[t].memory()
                if memory is not None:
                    groups.append(ReadGroup(memory, torch.tensor(slots, dtype=torch.int64), idx))
                    continue
                buffer = self._read_buffer(len(slots))
                rows = list(buffer.numpy()[:len(slots)])
                failed = self.tiers[t].read(slots, rows, None, [keys[i] for i in idx])
                bad += [(keys[idx[j]], t) for j in failed]
                n = min([n, *(idx[j] for j in failed)])
                groups.append(ReadGroup(buffer, torch.arange(len(slots), dtype=torch.int64), idx))
                stored += [(i, rows[j]) for j, i in enumerate(idx)]
            for g in groups if n < len(keys) else ():   # the prefix ends at the first block that failed
                keep = [j for j, i in enumerate(g.positions) if i < n]
                if len(keep) < len(g.positions):
                    g.rows, g.positions = g.rows[keep], [g.positions[j] for j in keep]
            groups = [g for g in groups if g.positions]
            if (self.promote if promote is None else promote) and len(self.tiers) > 1:
                up = [(i, r) for i, r in stored if i < n]
                if up:
                    with self._uninterrupted():    # it demotes evicted blocks, as a put does
                        self._mover.copy_into(0, [keys[i] for i, _ in up], [r for _, r in up],
                                              list(range(len(up))))
            yield HeldBlocks(n, groups, tiers[:n])
        finally:
            with self._lock:
                self.index.release(held)
            if buffer is not None:
                self._buffer_back(buffer)
            if bad:
                self._mover.discard(bad)

    def _release(self, keys: Sequence[BlockKey]) -> None:
        """End holds taken for reading (index.acquire) that no read will end: released, and
        not counted as hits (nothing was served)."""
        with self._lock:
            self.index.unacquire(keys)

    def _read_buffer(self, rows: int) -> torch.Tensor:
        """A page-aligned [>= rows, block_bytes] buffer for disk reads, reused between calls
        (the first touch of fresh memory is slow); a second reader at once gets its own."""
        with self._lock:
            buf, self._spare = self._spare, None
        if buf is None or buf.shape[0] < rows:
            from kvtier.tiers.memory import allocate_host
            size = 1 << max(0, rows - 1).bit_length()          # powers of two: few regrowths
            host = allocate_host(size * self.layout.block_bytes)
            buf = host.tensor[: size * self.layout.block_bytes].view(size, self.layout.block_bytes)
        return buf

    def _buffer_back(self, buf: torch.Tensor) -> None:
        """Keep the larger of two read buffers for the next read, up to _SPARE_MAX_BYTES: one
        very long disk read (or a peer's) must not pin its buffer for the store's lifetime."""
        if buf.numel() > _SPARE_MAX_BYTES:
            return
        with self._lock:
            if self._spare is None or self._spare.shape[0] < buf.shape[0]:
                self._spare = buf

    @contextmanager
    def hold(self, keys: Sequence[BlockKey]) -> Iterator[tuple[list[np.ndarray], list[int]]]:
        """Hold the longest locally cached prefix of `keys` (never fetched from peers: this
        is what a node serves them) and yield its blocks' bytes and xxh3-64 checksums: views
        of slot memory for memory tiers (no copy: a node sends them straight to a peer),
        verified copies for disk. Nothing held is evicted or overwritten until the block exits."""
        with self.reading(keys, promote=False, local=True) as held:
            rows = held.rows()
            with self._lock:
                entries = [self.index.entries[k] for k in keys[:held.blocks]]
            # Speed: a block's bytes never change under its key, so its checksum is computed
            # once and kept on its entry; a hot prefix served again costs no hashing.
            sums = []
            for e, r in zip(entries, rows):
                if e.checksum is None:
                    e.checksum = block_checksum(r)
                sums.append(e.checksum)
            yield rows, sums

    # -- an engine whose pages are the top tier (kvtier.adapter) ---------------------------
    def _write_through(self, keys: Sequence[BlockKey]) -> None:
        """Best effort: copy blocks that just became cached in the top tier down to the
        persistent tiers (the blocks are cached either way)."""
        for i, tier in enumerate(self.tiers):
            if i > 0 and tier.persistent:
                try:
                    self._mover.copy_into(i, keys)
                except Exception as e:
                    log.warning("write-through of %d blocks to %s failed: %s", len(keys), tier.name, e)

    # -- tiers: prefetch and durability ---------------------------------------------------
    def prefetch(self, keys: Sequence[BlockKey], *, blocking: bool = False) -> Transfer:
        """Copy the cached blocks of `keys` that live in lower tiers up into the top tier,
        verified, so a later get() is served from memory. Runs on an I/O thread by default."""
        self._check_keys(keys)
        with self._lock:
            self._check_open()
            n, tiers = self.index.lookup(keys)
            lower = [k for k, t in zip(keys[:n], tiers) if t > 0]
            locs = self.index.acquire(lower)
        bb = self.layout.block_bytes
        transfer = Transfer("prefetch", len(lower), len(lower) * bb)
        staging = np.empty((len(lower), bb), dtype=np.uint8)
        return self._run(transfer, lambda: self._load(lower, staging, len(lower), locs, transfer, True), blocking)

    def flush(self) -> None:
        """Make every completed put durable in the persistent tiers (write-back blocks that
        have no copy there yet, then sync). Without a persistent tier this does nothing."""
        with self._uninterrupted():
            self._flush(whole_order=False)

    def _flush(self, whole_order: bool) -> None:
        """flush(); `whole_order` (at close) also records the order of every block of each
        persistent tier, not only of those in use above it (O(blocks) under the lock: about
        1.4 s for 2M blocks here, too long to stall a serving node's periodic flush)."""
        with self._lock:
            self._check_open()          # also without a persistent tier: a closed store says so
        for i, tier in enumerate(self.tiers):
            if not tier.persistent:
                continue
            with self._lock:
                self._check_open()
                keys = self.index.without_copy(i)
            # In parts: a copy holds its blocks until their bytes are in, and a host tier
            # full of blocks held by one long write refused every put meanwhile (a node's
            # periodic flush: `stored 0 rejected 4` while it wrote). A part is also at most a
            # quarter of the smallest tier above, so a small one is never all held by it.
            step = FLUSH_PART_BYTES // self.layout.block_bytes
            if i:
                step = min(step, min(t.capacity_blocks for t in self.tiers[:i]) // 4)
            step = max(1, step)
            for at in range(0, len(keys), step):
                self._mover.copy_into(i, keys[at:at + step])
            with self._lock:
                own = self.index.order_in(i) if whole_order else []
                above = self.index.copies_above(i)
            tier.record_order(own)
            tier.record_order(above, newest=True)
            tier.flush()

    # -- pins ------------------------------------------------------------------------
    def pin(self, session: str, keys: Sequence[BlockKey], ttl: float, tier: int | str = 0) -> int:
        """Keep a session's blocks in `tier` (name or index) or above for `ttl` seconds.

        Pins the longest prefix of `keys` that fits the tier's pinned budget
        (pin_budget x capacity) and returns how many blocks that is. Keys not cached
        yet are protected when they arrive. Pinning a session again replaces its pin.
        """
        if not isinstance(session, str) or not session:
            raise ConfigError("session must be a non-empty string")
        self._check_keys(keys)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
            raise ConfigError(f"ttl is a number of seconds, e.g. 600, not {ttl!r}")
        with self._lock:
            self._check_open()
            return self.index.pins.pin(session, keys, float(ttl), self._tier_index(tier))

    def unpin(self, session: str) -> int:
        """Release a session's pin; returns how many blocks it held (0 if none)."""
        with self._lock:
            self._check_open()
            return self.index.pins.unpin(session)

    def _tier_index(self, tier: int | str) -> int:
        if isinstance(tier, str):
            for i, t in enumerate(self.tiers):
                if t.name == tier:
                    return i
            raise ConfigError(f"no tier named {tier!r}; tiers are {[t.name for t in self.tiers]}")
        return tier

    # -- what the store holds, for a directory that tells other nodes ---------------------
    def watch(self, on: bool = True, feed: str = "directory") -> None:
        """Start (or stop) recording the keys that become readable or leave the store, for
        changes(feed). Off by default: nobody listening costs nothing. Each feed (a node's
        directory publisher, a server's KV event log) gets every change once."""
        with self._lock:
            if on:
                self._feeds.setdefault(feed, ChangeLog(FEED_LIMIT))
            else:
                self._feeds.pop(feed, None)
            if not self._feeds:
                self.index.changes = None
            elif self.index.changes is None:
                self.index.changes = ChangeLog(FEED_LIMIT)

    def changes(self, feed: str = "directory") -> list[tuple[str, bytes]] | None:
        """The ("+" | "-", key) changes recorded for `feed` since its last call, oldest first;
        None when more changed than a feed keeps (FEED_LIMIT) since then: start over from
        cached_keys()."""
        with self._lock:
            new = self.index.changes
            if new is not None and (new or new.overflowed):
                self.index.changes = ChangeLog(FEED_LIMIT)
                for pending in self._feeds.values():
                    if new.overflowed:
                        pending.clear()
                        pending.overflowed = True
                    else:
                        pending.extend(new)
            out = self._feeds.get(feed)
            if out is None:
                return []
            self._feeds[feed] = ChangeLog(FEED_LIMIT)
            return None if out.overflowed else list(out)

    def cached_keys(self) -> list[BlockKey]:
        """Every readable block's key (a snapshot)."""
        with self._lock:
            return list(self.index.ready)

    # -- stats and lifetime -------------------------------------------------------------
    def stats(self) -> StoreStats:
        """Counters for the store and each tier (hits, evictions, bytes, pinned bytes)."""
        with self._lock:
            self.index.pins.expire()
            tiers = []
            for t, s, pinned in zip(self.tiers, self.index.tiers, self.index.pins.pinned):
                c = s.counters
                tiers.append(TierStats(t.name, t.kind, s.capacity, s.used, t.block_bytes, c.inserted, c.hits,
                                       c.evicted, c.demoted_in, c.dropped, c.rejected, pinned, t.info()))
            b = self.backup
            pins = self.index.pins
            return StoreStats(StoreCounters(**vars(self.counters)), tiers, pins.count(), pins.shed, self.recovered,
                              self.remote.info() if self.remote else None,
                              None if b is None else {"tier": self.tiers[b.tier].name, "copied": b.copied,
                                                      "failed": b.failed})

    def close(self) -> None:
        """Finish pending transfers, flush persistent tiers, and release every tier.

        A store still open at interpreter exit is closed then (see close_at_exit)."""
        forget_at_exit(self._exit_token)
        if self.backup is not None:
            self.backup.close()
        for pool in (self._executor, self._ahead):
            if pool is not None:
                pool.shutdown(wait=True)
        self._executor = self._ahead = None
        try:
            if not self._closed:
                with self._uninterrupted():
                    self._flush(whole_order=True)
        finally:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                for t in self.tiers:
                    t.close()
                if self.remote is not None:
                    self.remote.close()

    def __enter__(self) -> Store:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this store is closed; create a new Store")

    def _check_keys(self, keys: Sequence[BlockKey]) -> None:
        """Keys must be 16-byte keys; BlockKeys made by another store are refused."""
        if isinstance(keys, BlockKeys):
            # Made by a Keyer: the right type and size. Speed: one comparison, not one per key.
            if keys.origin is not None and keys.origin is not self.keyer.origin:
                self.keyer.check(keys)
            return
        if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
            raise LayoutError("keys must be a list of 16-byte block keys, e.g. from store.keys(tokens)")
        for i, k in enumerate(keys):
            if not isinstance(k, bytes) or len(k) != KEY_BYTES:
                raise LayoutError(f"keys[{i}] is not a {KEY_BYTES}-byte block key: use store.keys(tokens)")

