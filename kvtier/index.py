"""The one owner of block metadata: which key lives in which tier and slot, who reads
it, who pins it, and in which order each tier gives blocks up.

It moves no bytes. The Store pairs it with tiers that hold payload; the hit-ratio
replay drives it alone, through the same calls in the same order, so both see exactly
the same hits, misses and evictions.

A block has a primary copy in the fastest tier that holds it, and may have copies in
lower tiers (a disk copy written through, or left behind by a promotion). When a tier
needs a slot, its policy picks a victim among blocks nobody reads, writes or pins there:
a copy that exists elsewhere too is simply dropped; a block's only copy is demoted to the
next tier down (a Move the store carries out before reusing the slot) or, from the last
tier, dropped. A block or copy being written is invisible until commit().
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from kvtier.errors import CapacityError, ConfigError, KeyNotCachedError
from kvtier.ids import TOP_TIER, SlotId, TierId
from kvtier.ids import IndexKey as Key
from kvtier.pins import UNPINNED, Pins
from kvtier.policies import BlockInfo, EvictionPolicy, make_policy


class ChangeLog(list):
    """Changes ("+" | "-", key) not yet taken by a watcher (Store.watch), bounded: past `limit`
    entries it drops them all and is marked overflowed, and the watcher starts over from
    Store.cached_keys(). A watcher that stops reading (a router gone) then costs nothing more."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.overflowed = False

    def append(self, change: tuple[str, Key]) -> None:
        if not self.overflowed:
            super().append(change)
            self._bound()

    def extend(self, changes: Iterable[tuple[str, Key]]) -> None:
        if not self.overflowed:
            super().extend(changes)
            self._bound()

    def _bound(self) -> None:
        if len(self) > self.limit:
            self.clear()
            self.overflowed = True


class Entry:
    """Where one block is and who holds it."""

    __slots__ = ("tier", "slot", "refs", "ready", "info", "copies", "checksum")

    def __init__(self, tier: TierId, slot: SlotId, info: BlockInfo) -> None:
        self.tier = tier       # the primary (fastest) copy
        self.slot = slot
        self.refs = 1          # the writer holds a new block until commit
        self.ready = False
        self.info = info
        self.copies: dict[TierId, SlotId] | None = None   # lower tier -> slot of further copies
        self.checksum: int | None = None   # xxh3-64 of the bytes, once someone computed it (they never change)

    def slot_in(self, tier: TierId) -> SlotId | None:
        """The block's slot in `tier`, or None if it has no copy there."""
        if tier == self.tier:
            return self.slot
        return self.copies.get(tier) if self.copies else None



# How a block's copy may leave a tier (BlockIndex._eviction; EvictionPolicy.victims' kinds)
DROP, NOT_EVICTABLE, DEMOTE = 1, 0, -1


@dataclass(slots=True)
class Move:
    """A copy leaving (src_tier, src_slot): to (dst_tier, dst_slot), or dropped (dst_tier None)."""

    key: Key
    src_tier: TierId
    src_slot: SlotId
    dst_tier: TierId | None
    dst_slot: SlotId | None = None


@dataclass(slots=True)
class Reservation:
    """Slots given to a put's new blocks, and the moves to run before writing them."""

    keys: list[Key] = field(default_factory=list)      # new blocks, tail-first
    slots: list[SlotId] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # index of each new block in the put
    moves: list[Move] = field(default_factory=list)
    present: int = 0        # blocks already cached (refreshed, not written)
    rejected: int = 0       # blocks not admitted or with no room
    tier: TierId = TOP_TIER
    copy: bool = False      # copies of cached blocks into `tier` (not new blocks)
    gap: int | None = None  # a put's head-most position left uncached: blocks after it are unreachable

    @staticmethod
    def joined(parts: Sequence[Reservation]) -> Reservation:
        """The parts of one put (reserved in steps, their moves already run) as one."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        gaps = [p.gap for p in parts if p.gap is not None]
        return Reservation([k for p in parts for k in p.keys], [s for p in parts for s in p.slots],
                           [i for p in parts for i in p.positions], [], sum(p.present for p in parts),
                           sum(p.rejected for p in parts), first.tier, first.copy, min(gaps, default=None))

    def unreachable(self) -> Reservation:
        """The reserved blocks past the gap (none when there is no gap): a put reserved in parts,
        tail part first, learns of a gap nearer the root only after its tail parts were given
        slots; a lookup stops at the gap, so those blocks could never be a hit."""
        drop = [j for j, i in enumerate(self.positions) if self.gap is not None and i > self.gap]
        return Reservation([self.keys[j] for j in drop], [self.slots[j] for j in drop],
                           [self.positions[j] for j in drop], [], 0, 0, self.tier, self.copy)

    def without(self, drop: Reservation) -> Reservation:
        """This reservation less the blocks of `drop` (counted as rejected)."""
        if not drop.keys:
            return self
        gone = set(drop.keys)
        keep = [j for j, k in enumerate(self.keys) if k not in gone]
        return Reservation([self.keys[j] for j in keep], [self.slots[j] for j in keep],
                           [self.positions[j] for j in keep], self.moves, self.present,
                           self.rejected + len(drop.keys), self.tier, self.copy, self.gap)


@dataclass(slots=True)
class TierCounters:
    inserted: int = 0       # new blocks written into this tier
    hits: int = 0           # blocks served to readers from this tier
    evicted: int = 0        # blocks that left this tier to make room
    demoted_in: int = 0     # blocks that arrived from the tier above
    dropped: int = 0        # blocks that left the store from this tier
    rejected: int = 0       # new blocks refused (admission filter or no room)


def _in_chain_order(slots: list[SlotId], descending: bool) -> bool:
    """Sort a reservation's slots in place so a chain's consecutive blocks get consecutive
    slots wherever the set allows; True if the order changed (the caller re-pairs them).

    Speed: the free list's order after evictions is arbitrary, and a GPU load or backup moves
    one DMA per run of consecutive host slots: a kimi-tiny host hit issued 239 of them for
    254 blocks (session 16, an H200). Which slot a block gets does not matter otherwise:
    none holds its bytes before the reservation is written.
    """
    ordered = sorted(slots, reverse=descending)
    if ordered == slots:
        return False
    slots[:] = ordered
    return True


def _demotions_in_chain_order(moves: list[Move], entries: dict) -> None:
    """Give the demotions into each tier their destination slots ascending in chain order:
    victims leave tail-first (least recently used first) and took the lowest free slot each,
    which put a chain's copy below in descending slots (one DMA or disk write per block).
    Only where every such slot came from the free list: a slot a later move vacates must
    keep its place in the order (a move into a slot follows the move out of it)."""
    vacated = {(m.src_tier, m.src_slot) for m in moves}
    by_tier: dict[int, list[Move]] = {}
    for m in moves:
        if m.dst_tier is not None:
            by_tier.setdefault(m.dst_tier, []).append(m)
    for tier, group in by_tier.items():
        if len(group) < 2 or any((tier, m.dst_slot) in vacated for m in group):
            continue
        slots = sorted(m.dst_slot for m in group)                    # type: ignore[type-var]
        for m, slot in zip(reversed(group), slots):                  # chain order: the reverse of eviction
            m.dst_slot = slot
            e = entries[m.key]
            if e.tier == tier:
                e.slot = slot
            elif e.copies and tier in e.copies:
                e.copies[tier] = slot


class TierState:
    """Per-tier bookkeeping: capacity, free slots, policy, counters."""

    def __init__(self, name: str, capacity: int, policy: EvictionPolicy) -> None:
        self.name = name
        self.capacity = capacity
        # pop() hands out the lowest free slot first, so a chain cached in several calls
        # (an engine's chunks, a backup's batches) takes ascending ranges one after the
        # other; within a call _in_chain_order sorts them: one run for DMA and disk writes.
        self.free: list[SlotId] = list(range(capacity - 1, -1, -1))   # type: ignore[arg-type]
        self.policy = policy
        self.counters = TierCounters()

    @property
    def used(self) -> int:
        return self.capacity - len(self.free)

    def give_back(self, slots: Sequence[SlotId]) -> None:
        """Slots free again, pushed highest first so the free list hands them out lowest first:
        pages freed together and allocated again (a host hit's pages) come out ascending, as
        the chain's host slots do, and a load copies one run, not one block at a time (a
        request's pages freed in order came back descending: 61 copies for 61 blocks)."""
        self.free.extend(sorted(slots, reverse=True))


class BlockIndex:
    """Metadata of every cached block across an ordered list of tiers (0 = top)."""

    def __init__(self, tiers: Sequence[tuple[str, int]],
                 policy: str | EvictionPolicy | Sequence[str | EvictionPolicy] = "lru",
                 block_tokens: int = 16, pin_budget: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, allow_offline: bool = False) -> None:
        if not tiers:
            raise ConfigError("a store needs at least one tier")
        given = [policy] * len(tiers) if isinstance(policy, (str, EvictionPolicy)) else list(policy)
        if len(given) != len(tiers):
            raise ConfigError(f"got {len(given)} policies for {len(tiers)} tiers: give one or one per tier")
        self.tiers = [TierState(n, c, p if isinstance(p, EvictionPolicy) else make_policy(p, c))
                      for (n, c), p in zip(tiers, given)]
        for t in self.tiers:
            if t.policy.offline and not allow_offline:
                raise ConfigError(f"policy {t.policy.name!r} needs the future: it is for trace replay only")
        self.block_tokens = block_tokens
        self.clock = clock
        self.pins = Pins([c for _, c in tiers], pin_budget, clock)   # sessions' floors (kvtier/pins.py)
        self.entries: dict[Key, Entry] = {}
        # key -> tier of every readable block. Kept beside `entries` so lookup is one
        # C-level map over the keys (a 128k-token prompt has 8,192 of them).
        self.ready: dict[Key, TierId] = {}
        self._copying: set[tuple[Key, TierId]] = set()   # copies reserved but not committed yet
        # Keys that became readable (+) or left the store (-), for a directory that tells
        # other nodes what this one holds. None: nobody listens, nothing is recorded.
        self.changes: ChangeLog | None = None

    # -- lookup ----------------------------------------------------------------------
    def lookup(self, keys: Sequence[Key]) -> tuple[int, list[TierId]]:
        """Length of the longest cached prefix of `keys`, and the tier of each of its blocks."""
        locs = list(map(self.ready.get, keys))
        try:
            n = locs.index(None)
        except ValueError:
            return len(locs), locs
        del locs[n:]
        return n, locs

    # -- readers ---------------------------------------------------------------------
    def acquire(self, keys: Sequence[Key]) -> list[tuple[TierId, SlotId]]:
        """Hold `keys` for reading (not evictable until release) and refresh them tail-first.

        All or nothing: raises KeyNotCachedError, holding none, if any key is not readable.
        """
        self.pins.expire()
        found = list(map(self.entries.get, keys))
        for i, e in enumerate(found):
            if e is None or not e.ready:
                raise KeyNotCachedError(
                    f"block {i} of the {len(keys)} requested is not cached: get() only the "
                    "first lookup(keys).blocks keys, right after the lookup")
        for e in found:
            e.refs += 1
            self.tiers[e.tier].counters.hits += 1
        self._touch(keys[::-1])
        return [(e.tier, e.slot) for e in found]

    def release(self, keys: Sequence[Key]) -> None:
        """End one hold on each block (a read, a load, a page's reference): at none it may be
        evicted again."""
        entries = self.entries
        for k in keys:
            entries[k].refs -= 1

    def unacquire(self, keys: Sequence[Key]) -> None:
        """Undo acquire() of blocks that were not read after all (a load planned again, or
        shorter): released, and no longer counted as hits of the tier each is in."""
        entries = self.entries
        for k in keys:
            e = entries[k]
            e.refs -= 1
            self.tiers[e.tier].counters.hits -= 1

    def touch(self, keys: Sequence[Key]) -> None:
        """Refresh readable blocks among `keys` (prefix order) tail-first; others are ignored."""
        self._touch([k for k in reversed(keys) if k in self.ready])

    def _touch(self, keys: Sequence[Key]) -> None:
        if not keys:
            return
        if len(self.tiers) == 1:
            self.tiers[0].policy.touch(keys)
            return
        # Keep the order within each tier; tiers are independent orders.
        ready = self.ready
        groups: dict[TierId, list[Key]] = {}
        for k in keys:
            groups.setdefault(ready[k], []).append(k)
        for t, ks in groups.items():
            self.tiers[t].policy.touch(ks)

    # -- writers ---------------------------------------------------------------------
    def reserve(self, keys: Sequence[Key], *, prefix: Sequence[Key] | None = None,
                start: int | None = None, parent: Key | None = None,
                last_tokens: int | None = None, part: tuple[int, int] | None = None) -> Reservation:
        """Give slots in the top tier to the blocks of `keys` that are not cached yet.

        Walks the blocks tail-first: a cached one is refreshed, a new one is offered to
        the admission filter and given a slot (evicting as needed). Then the chain's
        `prefix` (default: what `keys` remembers of its chain) is refreshed tail-first,
        so after a put the root is the most recent block. New blocks stay invisible
        until commit().

        `part=(lo, hi)` walks only keys[lo:hi] (positions stay those in `keys`): a put
        reserved in steps, tail part first, makes the same policy calls in the same order
        as one call; the chain's prefix is refreshed by the part that reaches the root.
        """
        self.pins.expire()
        top = self.tiers[0]
        if len(keys) > top.capacity:
            raise CapacityError(
                f"a put of {len(keys)} blocks cannot fit in tier {top.name!r} of {top.capacity} blocks: "
                "put fewer blocks at a time or give the tier more capacity")
        if prefix is None:
            prefix = keys.prefix() if hasattr(keys, "prefix") else []
        if start is None:
            start = getattr(keys, "start", len(prefix))
        if parent is None:
            parent = getattr(keys, "parent", None)
        n = len(keys)
        lo, hi = (0, n) if part is None else part
        res = Reservation()
        entries, ready, policy, bt = self.entries, self.ready, top.policy, self.block_tokens
        # Speed: index a plain list, not BlockKeys (its __getitem__ is Python code).
        keys = list(keys)
        run: list[Key] = []          # consecutive cached blocks, refreshed in one call
        present_at: list[int] = []   # positions counted present (their blocks may become victims)
        for i in range(hi - 1, lo - 1, -1):
            k = keys[i]
            if k in entries:
                res.present += 1
                present_at.append(i)
                if k in ready:
                    run.append(k)
                continue             # being written by another put: leave it to that one
            if run:
                self._touch(run)
                run = []
            tokens = last_tokens if (i == n - 1 and last_tokens is not None) else bt
            info = BlockInfo(k, keys[i - 1] if i > 0 else parent, start + i, tokens, bt, start + n, start)
            if not policy.admit(info):
                self._give_back_tail(res, len(res.keys), i)      # all after i: unreachable
                res.rejected += 1
                top.counters.rejected += 1
                continue
            slot = self._take_slot(TOP_TIER, res.moves)
            if slot is None and res.keys:
                # No room, and the walk (tail-first) gave the chain's tail slots: the root
                # matters more. The tail gives back room for this block and the new ones
                # before it; the put keeps the longest prefix that fits.
                need = 1 + sum(1 for j in range(lo, i) if keys[j] not in entries)
                self._give_back_tail(res, need, n)
                slot = self._take_slot(TOP_TIER, res.moves)
            if slot is None:
                self._give_back_tail(res, len(res.keys), i)
                res.rejected += 1
                top.counters.rejected += 1
                continue
            entries[k] = Entry(0, slot, info)
            policy.insert(info)
            top.counters.inserted += 1
            res.keys.append(k)
            res.slots.append(slot)
            res.positions.append(i)
        if run:
            self._touch(run)
        if res.moves:
            self._lost_own_blocks(res, keys, present_at + list(range(hi, n)))
        if prefix and lo == 0:
            self._touch([k for k in reversed(prefix) if k in ready])
        if _in_chain_order(res.slots, descending=True):          # res.keys is tail-first
            for k, slot in zip(res.keys, res.slots):
                entries[k].slot = slot
        _demotions_in_chain_order(res.moves, entries)
        return res

    def _give_back_tail(self, res: Reservation, m: int, gap: int) -> None:
        """Free the slots of the `m` blocks a put's walk (tail-first) reserved first, the
        chain's tail, counted rejected; position `gap` and all after it are left uncached (a
        lookup stops there: nothing reserved after it could ever be a hit)."""
        gone = min(m, len(res.keys))
        if gone:
            gap = min(gap, res.positions[gone - 1])
        res.gap = gap if res.gap is None else min(res.gap, gap)
        if not gone:
            return
        top = self.tiers[res.tier]
        for k in res.keys[:gone]:
            top.policy.remove(k)
            del self.entries[k]
        top.give_back(res.slots[:gone])
        top.counters.inserted -= gone
        top.counters.rejected += gone
        res.rejected += gone
        del res.keys[:gone], res.slots[:gone], res.positions[:gone]

    def _lost_own_blocks(self, res: Reservation, keys: list[Key], counted: list[int]) -> None:
        """A put's cached blocks may be the victims of its own new ones (a full tier, the rest
        pinned): one dropped from the store is not present after all, and a lookup stops
        there. It counts as rejected, and the put's gap moves to it (Mover.commit then
        forgets the blocks reserved past it). `counted`: the positions counted present, by
        this walk or by the tail parts reserved before it (a put in parts); not those nearer
        the root that a later part walks (it finds a victim missing and reserves it anew), nor
        one this walk found missing already (counted rejected, or reserved, there)."""
        dropped = {m.key for m in res.moves if m.dst_tier is None}
        if not dropped:
            return
        for i in counted:
            k = keys[i]
            if k in dropped and k not in self.entries:
                res.present -= 1
                res.rejected += 1
                res.gap = i if res.gap is None else min(res.gap, i)

    def drop_unreachable(self, res: Reservation) -> None:
        """Forget blocks a put reserved past its gap (Reservation.unreachable) once no copy
        into their slots is landing: counted rejected, their slots free."""
        self.abort(res)
        self.tiers[res.tier].counters.rejected += len(res.keys)

    def commit(self, res: Reservation) -> None:
        """The reserved blocks (or copies) were written: make them readable."""
        entries, ready = self.entries, self.ready
        if res.copy:
            t = res.tier
            for k, slot in zip(res.keys, res.slots):
                self._copying.discard((k, t))
                e = entries[k]
                e.refs -= 1
                if e.copies is None:
                    e.copies = {}
                if t < e.tier:      # the new copy is faster: it becomes the primary
                    e.copies[e.tier] = e.slot
                    e.tier, e.slot = t, slot
                    ready[k] = t
                else:
                    e.copies[t] = slot
            return
        for k in res.keys:
            e = entries[k]
            e.refs -= 1
            e.ready = True
            ready[k] = e.tier
        if self.changes is not None:
            self.changes.extend(("+", k) for k in res.keys)

    def abort(self, res: Reservation) -> None:
        """The write failed: forget the reserved blocks (or copies) and free their slots."""
        t = self.tiers[res.tier]
        t.counters.inserted -= len(res.keys)      # counted at reserve; nothing arrived
        t.give_back(res.slots)
        for k in res.keys:
            t.policy.remove(k)
            if res.copy:
                self._copying.discard((k, res.tier))
                self.entries[k].refs -= 1
            else:
                del self.entries[k]

    def reserve_copies(self, keys: Sequence[Key], tier: TierId) -> Reservation:
        """Give slots in `tier` to copies of cached blocks that have none there.

        Used to promote blocks up (a disk hit copied into host memory) and to write
        blocks down (write-through, flush). The blocks are held until commit() or abort().
        Blocks not readable, or already in `tier`, are skipped (counted as present).
        """
        self.pins.expire()
        res = Reservation(tier=tier, copy=True)
        ts = self.tiers[tier]
        for i, k in enumerate(keys):
            e = self.entries.get(k)
            if e is None or not e.ready or e.slot_in(tier) is not None or (k, tier) in self._copying:
                res.present += 1    # (another thread may be writing that very copy)
                continue
            e.refs += 1             # held: not evictable while its copy is written
            slot = self._take_slot(tier, res.moves)
            if slot is None:
                e.refs -= 1
                res.rejected += 1
                ts.counters.rejected += 1
                continue
            ts.counters.inserted += 1
            self._copying.add((k, tier))
            res.keys.append(k)
            res.slots.append(slot)
            res.positions.append(i)
        # Into the policy tail-first, like reserve(): a chain's root ends most recent, so the
        # tier evicts the chain's tail first (and a later chain's demotions, taking those
        # slots one victim at a time, get them in chain order too). The copies are held:
        # no victim among them could have been chosen meanwhile.
        for k in reversed(res.keys):
            ts.policy.insert(self.entries[k].info)
        _in_chain_order(res.slots, descending=False)             # keys in the caller's (chain) order
        _demotions_in_chain_order(res.moves, self.entries)
        return res

    # -- slots lent to an engine whose pages are the top tier ---------------------------
    def allocate(self, tier: TierId, n: int, moves: list[Move]) -> list[SlotId] | None:
        """`n` empty slots of `tier` for the caller to write (evicting as needed), or None.

        An allocated slot belongs to the caller, outside every policy, until it is freed
        (free) or becomes a cached block (cache). All or nothing: when fewer than
        `n` can be had, the ones found go back to the free list (evictions already chosen
        stand: their moves are in `moves` and must still be carried out).
        """
        self.pins.expire()
        free = self.tiers[tier].free
        if len(free) >= n:
            # Speed: the free list's top n in one slice, as n pops would take them: a load of
            # 512 host blocks spent 0.3 ms here, one _take_slot call each. Sorted as below:
            # the free list is runs pushed at different times, not one ascending order.
            slots = sorted(free[len(free) - n:])
            del free[len(free) - n:]
            return slots
        slots = free[::-1]               # every free slot, as _take_slot would pop them
        free.clear()
        first = len(moves)
        slots += self._drop_many(tier, n - len(slots), moves)
        for _ in range(n - len(slots)):
            slot = self._take_slot(tier, moves)
            if slot is None:
                self.tiers[tier].give_back(slots)
                return None
            slots.append(slot)
        _demotions_in_chain_order(moves[first:], self.entries)
        # Ascending, like a chain's slots one tier down: the caller fills them in order (a
        # load, block j into slot j), so a run of host slots lands in a run of pages (one
        # copy). Victims come tail-first (their slots descending when the chain's were not).
        slots.sort()
        return slots

    def free(self, tier: TierId, slots: Sequence[SlotId]) -> None:
        """Allocated slots the caller no longer needs: free again."""
        self.tiers[tier].give_back(slots)

    def cache(self, tier: TierId, keys: Sequence[Key], slots: Sequence[SlotId | None]) -> list[bool]:
        """Allocated slots of `tier` whose bytes the caller wrote become the blocks of `keys`, held.

        The zero-copy save: for each key not cached in `tier` yet, its slot becomes the
        block's copy there (the primary, if the block lives only in slower tiers) and is
        held for the caller (release() it when done). A key already in `tier`, being
        written, or refused by the admission filter is not cached: False, and its slot
        stays the caller's; a None slot is skipped. `keys` should remember their chain
        (BlockKeys) for the policies.
        """
        self.pins.expire()
        ts = self.tiers[tier]
        start = getattr(keys, "start", 0)
        parent = getattr(keys, "parent", None)
        bt, n = self.block_tokens, len(keys)
        keys = list(keys)                   # Speed: as in reserve(), a plain list to index
        done = [False] * n
        for i in range(n - 1, -1, -1):      # tail-first, like reserve(): the root ends most recent
            k, slot = keys[i], slots[i]
            if slot is None:                 # the caller has no page to offer for this block
                continue
            e = self.entries.get(k)
            if e is None:
                info = BlockInfo(k, keys[i - 1] if i > 0 else parent, start + i, bt, bt, start + n, start)
                if not ts.policy.admit(info):
                    ts.counters.rejected += 1
                    continue
                e = Entry(tier, slot, info)
                e.ready = True               # refs = 1: held for the caller
                self.entries[k] = e
                self.ready[k] = tier
                if self.changes is not None:
                    self.changes.append(("+", k))
            elif e.ready and e.slot_in(tier) is None and (k, tier) not in self._copying and e.tier > tier:
                if e.copies is None:
                    e.copies = {}
                e.copies[e.tier] = e.slot    # the slower copy stays, as a copy
                e.tier, e.slot = tier, slot
                self.ready[k] = tier
                e.refs += 1
            else:
                continue
            ts.policy.insert(e.info)
            ts.counters.inserted += 1
            done[i] = True
        return done

    def discard(self, key: Key, tier: TierId | None = None) -> Move | None:
        """Drop one copy of a block nobody holds (default: its primary), e.g. because its
        bytes failed verification. Returns the dropped copy, or None if it was not dropped."""
        e = self.entries.get(key)
        if e is None or not e.ready or e.refs:
            return None
        t = e.tier if tier is None else tier
        slot = e.slot_in(t)
        if slot is None:
            return None
        ts = self.tiers[t]
        ts.policy.remove(key)
        ts.free.append(slot)
        ts.counters.dropped += 1
        self._drop_copy(key, e, t)
        return Move(key, t, slot, None)

    def undo_demotion(self, move: Move) -> Move | None:
        """A demotion whose bytes never arrived (the lower tier's write failed): forget the copy
        it made in `move.dst_tier`, counted as a drop from `move.src_tier` rather than a move
        in and a drop there (so what left a tier still entered the next or was dropped).
        Returns the forgotten copy, or None where the block is no longer there."""
        assert move.dst_tier is not None
        gone = self.discard(move.key, move.dst_tier)
        if gone is not None:
            dst = self.tiers[move.dst_tier].counters
            dst.dropped -= 1
            dst.demoted_in -= 1
            self.tiers[move.src_tier].counters.dropped += 1
        return gone

    def _drop_copy(self, key: Key, e: Entry, tier: TierId) -> None:
        """Forget `e`'s copy in `tier` (its slot is already free or reused)."""
        if tier != e.tier:
            del e.copies[tier]          # type: ignore[union-attr]
        elif e.copies:
            nxt = min(e.copies)         # the next fastest copy becomes the primary
            e.tier, e.slot = nxt, e.copies.pop(nxt)
            self.ready[key] = nxt
        else:
            del self.entries[key]
            del self.ready[key]
            if self.changes is not None:
                self.changes.append(("-", key))

    def adopt(self, tier: TierId, items: Iterable[tuple[Key, SlotId]]) -> int:
        """Register blocks a persistent tier already holds (after a restart), oldest first:
        (key, slot) pairs; what a policy knows of each is only its key (and full size).

        Returns how many were adopted; slots already in use are skipped.
        """
        ts = self.tiers[tier]
        free = set(ts.free)
        n = 0
        # Speed: a restart adopts every block of a disk tier (2M for a 2 TiB tier of 1 MiB
        # blocks) before the store serves: the loop's lookups are bound once.
        entries, ready, changes, insert = self.entries, self.ready, self.changes, ts.policy.insert
        bt = self.block_tokens
        for key, slot in items:
            if slot not in free:
                continue
            free.discard(slot)
            info = BlockInfo(key, None, 0, bt, bt, 0)
            e = entries.get(key)
            if e is None:
                e = Entry(tier, slot, info)
                e.refs, e.ready = 0, True
                entries[key] = e
                ready[key] = tier
                if changes is not None:
                    changes.append(("+", key))
            elif e.slot_in(tier) is None:
                if e.copies is None:
                    e.copies = {}
                e.copies[tier] = slot
            else:
                free.add(slot)
                continue
            insert(info)
            n += 1
        ts.free = sorted(free, reverse=True)     # lowest first, as at the start
        return n

    def order_in(self, tier: TierId) -> list[SlotId]:
        """The slots of `tier`'s own blocks (its primary copies), least recently used first,
        as its policy keeps them ([] for a policy keeping no such order). O(blocks):
        for a persistent tier's record at close (BlockIndex.copies_above for the rest)."""
        entries = self.entries
        out = []
        for k in self.tiers[tier].policy.order() or ():
            e = entries.get(k)
            if e is not None and e.tier == tier:
                out.append(e.slot)
        return out

    def copies_above(self, tier: TierId) -> list[SlotId]:
        """The slots in `tier` of copies of blocks whose primary is in a faster tier, least
        recently used first (a slower tier's before a faster one's; within a tier as its
        policy keeps them, else tails before roots). Their hits never reach `tier`: without
        this a restarted or shrunk tier kept old requests' tails and dropped the shared roots
        they had been hit through. O(blocks above) (LRU, ARC, LFU; S3-FIFO and reuse sort
        or merge theirs), cheap enough for every flush; a policy keeping no order has its
        blocks scanned and sorted by depth."""
        entries = self.entries
        out: list[SlotId] = []
        for t in reversed(range(tier)):
            keys = self.tiers[t].policy.order()
            if keys is None:
                keys = sorted((k for k, e in entries.items() if e.tier == t), key=lambda k: -entries[k].info.depth)
            for k in keys:
                e = entries.get(k)
                if e is not None and e.ready and e.tier == t and e.copies:
                    s = e.copies.get(tier)
                    if s is not None:
                        out.append(s)
        return out

    def without_copy(self, tier: TierId) -> list[Key]:
        """Readable blocks with no copy in `tier` or below it (what a flush must write down),
        newest first: a chain's blocks are indexed tail-first (reserve, cache), so each chain
        comes root first and its copies take ascending slots (one run to write and read).
        Only those that rank within `tier`'s capacity among the blocks above it (below)."""
        out = []
        copies = 0                                  # blocks above with a copy here already
        for k, e in reversed(self.entries.items()):
            if e.copies:
                copies += tier in e.copies
                if max(e.copies) >= tier:
                    continue
            if e.ready and e.tier < tier:
                out.append(k)
        if len(out) + copies <= self.tiers[tier].capacity:
            return out
        worth = self._worth_writing(tier)
        return out if worth is None else [k for k in out if k in worth]

    def _worth_writing(self, tier: TierId) -> set[Key] | None:
        """Of the blocks above `tier` that lack a copy in it, those among the `capacity` most
        valuable of all blocks above that have one there or would (the tiers' policy orders,
        a faster tier's first); None: all of them (a policy keeps no order).
        Writing the rest down would only evict more valuable copies: a disk tier smaller than
        one prompt's prefix had the prefix's tail written over the roots it had just been hit
        through, and hit and missed on alternate restarts. O(blocks above), like
        copies_above, and only where the blocks do not fit."""
        entries = self.entries
        worth: set[Key] = set()
        room = self.tiers[tier].capacity
        for t in range(tier):
            order = self.tiers[t].policy.order()
            if order is None:
                return None
            for k in reversed(order):                       # most valuable first
                e = entries.get(k)
                if e is None or e.tier != t or not e.ready or (e.copies and max(e.copies) > tier
                                                                and tier not in e.copies):
                    continue                                # (a copy only below needs no room here)
                if room <= 0:
                    return worth
                room -= 1
                if not (e.copies and tier in e.copies):
                    worth.add(k)
        return worth

    def _evictable(self, key: Key, tier: TierId) -> bool:
        return self._eviction(key, tier) != NOT_EVICTABLE

    def _eviction(self, key: Key, tier: TierId) -> int:
        """How `key`'s copy in `tier` may leave: DROP (another copy stays within its floor),
        DEMOTE (its bytes must move down, or out if unpinned), or NOT_EVICTABLE (held, being
        written, or pinned here with nowhere below)."""
        e = self.entries[key]
        if e.refs or not e.ready:
            return NOT_EVICTABLE
        floor = self.pins.floor(key)
        if self._has_other_copy(e, tier, floor):
            return DROP
        # A pinned block's only copy within its floor may move down to the floor, never out.
        return DEMOTE if floor == UNPINNED or (floor > tier and tier + 1 < len(self.tiers)) else NOT_EVICTABLE

    @staticmethod
    def _has_other_copy(e: Entry, tier: TierId, floor: int) -> bool:
        """Whether `e` has a copy outside `tier`, in `floor` or above."""
        if e.tier != tier and e.tier <= floor:
            return True
        if e.copies:
            for t in e.copies:       # Speed: a loop, not any(<generator>): this runs for every victim
                if t != tier and t <= floor:
                    return True
        return False

    def _drop_many(self, tier: TierId, n: int, moves: list[Move]) -> list[SlotId]:
        """Up to `n` slots of `tier` freed by evicting blocks with another copy within their
        floor (drops: no bytes move), in the order _take_slot would evict them, stopping at
        the first victim whose eviction would move bytes. Speed: one walk of the policy, not
        one per victim: 256 evictions (a host hit's pages) took 0.5 ms one _take_slot each."""
        ts = self.tiers[tier]
        eviction = self._eviction
        victims = ts.policy.victims(lambda k: eviction(k, tier), n) if n > 0 else None
        if not victims:
            return []
        out = []
        entries, remove, counters = self.entries, ts.policy.remove, ts.counters
        for k in victims:
            e = entries[k]
            slot = e.slot_in(tier)
            assert slot is not None
            remove(k)
            moves.append(Move(k, tier, slot, None))
            self._drop_copy(k, e, tier)
            out.append(slot)
        counters.evicted += len(out)
        counters.dropped += len(out)
        return out

    def _take_slot(self, tier: TierId, moves: list[Move]) -> SlotId | None:
        """A free slot in `tier`, evicting (and demoting) a victim if needed; None if impossible."""
        ts = self.tiers[tier]
        if ts.free:
            return ts.free.pop()
        below = tier + 1
        stuck: set[Key] = set()   # pinned victims that found no room below
        while True:
            victim = ts.policy.victim(lambda k: k not in stuck and self._evictable(k, tier))
            if victim is None:
                return None
            e = self.entries[victim]
            if self._eviction(victim, tier) == DROP:
                dst = None          # another copy stays readable: drop this one, no I/O
                break
            # The lower tier's admission filter decides whether the block is worth a slot
            # there (most blocks are never reused); a pinned block always moves down.
            admitted = below < len(self.tiers) and (victim in self.pins or self.tiers[below].policy.admit(e.info))
            dst = self._take_slot(below, moves) if admitted else None
            if dst is None and victim in self.pins:
                stuck.add(victim)   # a pinned block may move down but never out: try the next
                continue
            break
        slot = e.slot_in(tier)
        assert slot is not None
        ts.policy.remove(victim)
        ts.counters.evicted += 1
        if dst is not None:
            # Write-back: the block's only copy moves one tier down.
            moves.append(Move(victim, tier, slot, below, dst))
            e.tier, e.slot = below, dst
            self.ready[victim] = below
            lower = self.tiers[below]
            lower.policy.insert(e.info)
            lower.counters.demoted_in += 1
            return slot
        moves.append(Move(victim, tier, slot, None))
        ts.counters.dropped += 1
        self._drop_copy(victim, e, tier)
        return slot
