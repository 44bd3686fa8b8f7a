"""Carries out what the BlockIndex decides, so the Store façade only decides when.

The index moves no bytes: it answers with Moves (a block's last copy demoted one tier
down, or a copy dropped) and Reservations (slots for new blocks or copies). This class
runs them against the tiers: moves under the store's lock before a freed slot is reused,
writes that make their blocks readable only once every byte is in (or forget them if
the write fails), and the dropping of copies whose bytes failed verification.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from kvtier.errors import TransferError, WriteInterrupted
from kvtier.ids import BlockKey, SlotId, TierId
from kvtier.index import BlockIndex, Move, Reservation
from kvtier.stats import StoreCounters
from kvtier.throttle import Throttle
from kvtier.tiers.base import PendingWrite, Tier

log = logging.getLogger("kvtier.store")
WARN_EVERY_S = 60.0     # failed demotions are logged at most this often (a failing disk fails every put)


class Mover:
    """The tiers, the index and the lock of one store, and the operations that move bytes
    between tiers on the index's behalf."""

    def __init__(self, tiers: list[Tier], index: BlockIndex, lock: threading.Lock, counters: StoreCounters) -> None:
        self.tiers = tiers
        self.index = index
        self._lock = lock
        self.counters = counters
        self._warn = Throttle(WARN_EVERY_S)
        self._unlogged = 0          # blocks dropped for a failed demotion since the last warning

    def apply(self, res: Reservation) -> None:
        """Carry out a reservation's moves (caller holds the lock). If one fails, the blocks
        it was moving are forgotten where they were going (their bytes may not be there) and
        the reservation is undone: the index never claims bytes that did not arrive."""
        try:
            interrupt = self._move(res.moves)
        except BaseException as e:
            for m in res.moves:
                if m.dst_tier is not None:
                    gone = self.index.discard(m.key, m.dst_tier)
                    if gone is not None:
                        self.tiers[m.dst_tier].release([gone.src_slot], [m.key])
            self.index.abort(res)
            if not isinstance(e, Exception):
                raise                         # (a Ctrl-C outside a write: the same undo, then on)
            raise TransferError(f"moving evicted blocks to a lower tier failed: {e}") from e
        if interrupt is not None:             # every move carried out or dropped: only the put stops
            self.index.abort(res)
            raise interrupt

    def _move(self, moves: list[Move]) -> BaseException | None:
        """Carry out demotions and drops chosen by the index (under the lock, before slots are reused).

        Moves run in the order the index chose them (a block may move twice in one put, and
        a move into a slot must follow the move out of it). Consecutive demotions between
        the same two tiers that touch no slot or block twice are one batched write (one disk
        transaction); a drop independent of that batch may go first, as it moves no bytes.

        A demotion whose write fails (a full or failing disk) drops its blocks instead: they
        were being evicted, and a cache that loses them is a cache; failing the put (an
        engine's page allocation) for them stopped the engine for as long as the disk failed.
        A Ctrl-C is returned once every move is carried out, for the caller to raise (it
        skipped the rest and left the index claiming blocks in slots that held none, and the
        put's keys reserved for good): a write it came during was finished first
        (WriteInterrupted: the batch stands), or, where the tier could not finish it, is
        dropped as a failed one.
        """
        batch: list[Move] = []
        touched: set[tuple[int, int]] = set()      # (tier, slot) read or written by the batch
        keys: set[bytes] = set()
        drops: list[Move] = []                     # consecutive drops from one tier, released at once
        failed: list[Move] = []                    # demotions whose bytes did not arrive
        lost: set[bytes] = set()                   # their blocks: a later move of one moves nothing
        error: Exception | None = None
        interrupt: BaseException | None = None

        def release_drops() -> None:
            if drops:
                self.tiers[drops[0].src_tier].release([m.src_slot for m in drops], [m.key for m in drops])
                drops.clear()

        def flush() -> None:
            nonlocal error, interrupt
            if batch:
                src_slots, keys_ = [m.src_slot for m in batch], [m.key for m in batch]
                try:
                    self._copy(batch[0].src_tier, src_slots, batch[0].dst_tier, [m.dst_slot for m in batch], keys_)
                except WriteInterrupted as e:      # written and recorded: the batch stands
                    interrupt = interrupt or e
                except BaseException as e:
                    if isinstance(e, Exception):
                        error = error or e
                    else:
                        interrupt = interrupt or e
                    failed.extend(batch)
                    lost.update(keys_)
                self.tiers[batch[0].src_tier].release(src_slots, keys_)
                batch.clear()
                touched.clear()
                keys.clear()

        for m in moves:
            here = (m.src_tier, m.src_slot)
            if m.dst_tier is None:                 # a drop: forget the copy
                if here in touched or m.key in keys:
                    flush()
                if drops and drops[0].src_tier != m.src_tier:
                    release_drops()
                drops.append(m)
                continue
            release_drops()
            if m.key in lost:                      # its bytes never reached this move's source
                failed.append(m)
                self.tiers[m.src_tier].release([m.src_slot], [m.key])
                continue
            there = (m.dst_tier, m.dst_slot)
            if batch and ((m.src_tier, m.dst_tier) != (batch[0].src_tier, batch[0].dst_tier)
                          or here in touched or there in touched or m.key in keys):
                flush()
            batch.append(m)
            touched.update((here, there))
            keys.add(m.key)
        release_drops()
        flush()
        if failed:
            self._dropped_for(failed, error)
        return interrupt

    def _dropped_for(self, failed: list[Move], error: Exception | None) -> None:
        """Forget the copies that failed demotions were to make (their slots hold no block),
        so those blocks are dropped where they had no other copy; log it, sparsely."""
        for m in failed:
            gone = self.index.undo_demotion(m)
            if gone is not None:
                self.tiers[m.dst_tier].release([gone.src_slot], [m.key])
        if error is None:
            return                     # interrupted, not failing: nothing to warn of
        self._unlogged += len({m.key for m in failed})
        again = self._warn.last is not None
        if self._warn.due(time.monotonic()):
            log.warning("moving evicted blocks down failed (%s); dropped %d block(s)%s instead of failing the "
                        "request (next such warning in %.0f s at the earliest)", error, self._unlogged,
                        " since the last warning" if again else "", WARN_EVERY_S)
            self._unlogged = 0

    def discard(self, bad: list[tuple[bytes, int]]) -> None:
        """Drop copies whose bytes failed verification: they are misses from now on."""
        with self._lock:
            for key, tier in bad:
                m = self.index.discard(key, tier)
                if m is not None:
                    self.tiers[tier].release([m.src_slot], [key])
            self.counters.corrupt_blocks += len(bad)

    def copy_into(self, tier: TierId, keys: Sequence[BlockKey], rows: Sequence[np.ndarray] | None = None,
                   positions: list[int] | None = None, down_only: bool = False) -> int:
        """Give cached blocks a copy in `tier`: from `rows[positions[j]]` (their bytes, already
        in memory), or without rows from their primary copies (held while they are read).
        down_only: only blocks whose primary copy is in a faster tier (a backup must not copy
        a block that was demoted meanwhile back up)."""
        entries = self.index.entries
        with self._lock:
            if down_only:
                keys = [k for k in keys if k in entries and entries[k].tier < tier]
            res = self.index.reserve_copies(keys, tier)
            self.apply(res)
            locs = [(entries[k].tier, entries[k].slot) for k in res.keys]
        if not res.keys:
            return 0
        if rows is not None:
            self.fill(res, rows, [positions[j] for j in res.positions])   # type: ignore[index]
            return len(res.keys)
        with self.committing(res):
            for t, src_slots, idx in group_by_tier(locs):
                self._copy(t, src_slots, tier, [res.slots[j] for j in idx], [res.keys[j] for j in idx])
        return len(res.keys)

    def _copy(self, src_tier: TierId, src_slots: Sequence[SlotId], dst_tier: TierId, dst_slots: Sequence[SlotId],
              keys: Sequence[BlockKey]) -> None:
        """Blocks' bytes from slots of one tier into slots of another: straight into the
        destination's memory where the source can (a GPU tier into pinned host slots),
        else the source's rows written."""
        src, dst = self.tiers[src_tier], self.tiers[dst_tier]
        memory = dst.memory()
        if memory is None or not src.copy_to(src_slots, memory, dst_slots):
            dst.write(dst_slots, src.blocks(src_slots), None, keys)

    def fill(self, res: Reservation, rows: Sequence[np.ndarray], idx: Sequence[int] | None) -> None:
        """Write a reservation's bytes into its tier, then make them readable (undone if the write fails)."""
        with self.committing(res):
            self.tiers[res.tier].write(res.slots, rows, idx, res.keys)

    def fill_parts(self, parts: Sequence[Reservation], started: PendingWrite, rows: Sequence[np.ndarray]) -> None:
        """Finish a put reserved in parts (Store._store): parts[0]'s bytes are being written
        (`started`); start the other parts' writes, in order, then make every part readable
        at once. If any write fails, none is readable and all their slots are freed."""
        writes: list[PendingWrite | None] = [started]
        error: BaseException | None = None
        for res in parts[1:]:
            if error is not None or not res.keys:
                writes.append(None if error is not None else PendingWrite.done())
                continue
            try:
                writes.append(self.tiers[res.tier].begin_write(res.slots, rows, res.positions, res.keys))
            except BaseException as e:
                error = e
                writes.append(None)
        self.settle(parts, writes, error)

    def settle(self, parts: Sequence[Reservation], writes: Sequence[PendingWrite | None],
               error: BaseException | None = None) -> None:
        """Finish each part's write (None: never started) in order and commit them together;
        or, if one failed (or `error`: starting one, or reserving a later part), forget them
        all. A part whose bytes did land is released from its tier first (a disk tier drops
        its records), before its slots can be reused."""
        landed: list[Reservation] = []
        interrupt: WriteInterrupted | None = None
        for res, w in zip(parts, writes):
            if w is None:
                continue
            try:
                w.wait()
                landed.append(res)
            except WriteInterrupted as e:     # written and recorded: committed, then raised
                landed.append(res)
                interrupt = interrupt or e
            except BaseException as e:
                error = error or e
        if error is None:
            self.commit(parts)
            if interrupt is not None:
                raise interrupt
            return
        for res in landed:
            if res.keys:
                self.tiers[res.tier].release(res.slots, res.keys)
        self.abort(parts)
        raise error

    def commit(self, parts: Sequence[Reservation]) -> Reservation:
        """Make the written parts of one save readable at once; returns them as one reservation.
        Blocks past the save's gap (a part nearer the root found no room) are forgotten
        instead: their bytes landed, but no lookup could reach them."""
        res = Reservation.joined(parts)
        drop = res.unreachable()
        if drop.keys:
            self.tiers[drop.tier].release(drop.slots, drop.keys)   # a disk tier drops their records
        with self._lock:
            if drop.keys:
                self.index.drop_unreachable(drop)
                self.counters.put_rejected += len(drop.keys)
            res = res.without(drop)
            self.index.commit(res)
        return res

    def abort(self, parts: Sequence[Reservation]) -> None:
        """Forget every part of a save that failed and free their slots."""
        with self._lock:
            for res in parts:
                self.index.abort(res)

    @contextmanager
    def committing(self, res: Reservation) -> Iterator[None]:
        """The reserved blocks become readable once the `with` body has written them; if it
        raises, they are forgotten and their slots freed."""
        try:
            yield
        except WriteInterrupted:        # written and recorded: they stand
            self.commit([res])
            raise
        except BaseException:
            self.abort([res])
            raise
        self.commit([res])


def group_by_tier(locs: Sequence[tuple[TierId, SlotId]]) -> list[tuple[TierId, list[SlotId], list[int]]]:
    """(tier, slots, positions) for each tier that holds some of `locs`, in order of first appearance."""
    if locs and all(t == locs[0][0] for t, _ in locs):
        # Speed: one tier (a host hit's blocks, the usual case) in two comprehensions
        return [(locs[0][0], [s for _, s in locs], list(range(len(locs))))]
    by: dict[TierId, tuple[list[SlotId], list[int]]] = {}
    for i, (t, s) in enumerate(locs):
        slots, idx = by.setdefault(t, ([], []))
        slots.append(s)
        idx.append(i)
    return [(t, slots, idx) for t, (slots, idx) in by.items()]
