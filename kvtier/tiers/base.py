"""What every tier is: a fixed number of equal slots holding whole blocks' bytes.

A tier knows nothing about keys: the BlockIndex decides which block goes in which slot;
a tier only moves bytes in and out of slots. Payload arrives as rows: a 2-D uint8 numpy
array of one block per row, or a list of 1-D one-block views (see kvtier/payload.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

from kvtier.errors import ConfigError, TierSizeError
from kvtier.ids import BlockKey, SlotId
from kvtier.submit import submit
from kvtier.units import format_bytes, parse_bytes


@dataclass(frozen=True)
class Demand:
    """What a tier will take once bound: `nbytes` of `where` (one name per pool that tiers
    share: "CPU memory", "GPU memory of cuda:N", "disk space on device N" for a filesystem),
    and how to tell whether a total fits there (an error naming what is short, or None)."""

    where: str
    nbytes: int
    check: Callable[[str, int], TierSizeError | None]
    what: str = ""          # this tier's own name for it, as its allocation's error says it


@dataclass(frozen=True)
class PendingWrite:
    """A write under way (Tier.begin_write). wait() finishes it and raises its error;
    call it exactly once, and before the slots or the rows are used again."""

    wait: Callable[[], None]

    @staticmethod
    def done() -> PendingWrite:
        return PendingWrite(lambda: None)


class Tier(ABC):
    """A slot pool. Construct with a capacity; the store binds it to a block size."""

    kind: str = "tier"
    #: True for tiers whose blocks survive a restart (the store adopts them when it opens).
    persistent: bool = False
    #: True where a tier given no size takes the one it had (a disk tier's directory records it).
    keeps_size: bool = False

    def __init__(self, capacity: int | str | None = None, *, blocks: int | None = None,
                 name: str | None = None) -> None:
        if capacity is not None and blocks is not None or (capacity is None and blocks is None
                                                           and not self.keeps_size):
            raise ConfigError(f"{type(self).__name__} needs exactly one of capacity (bytes, e.g. '8GiB') or blocks=N")
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks <= 0):
            raise ConfigError(f"blocks must be a positive int, got {blocks!r}")
        self.capacity_bytes = None if capacity is None else parse_bytes(capacity)
        self.capacity_spec = blocks
        self.name = name or self.kind
        self.block_bytes = 0
        self.capacity_blocks = 0

    def bind(self, block_bytes: int, identity: dict[str, Any] | None = None) -> int:
        """Size the tier for blocks of `block_bytes`, allocate it, and return its slot count.

        `identity` (layout and namespace) lets a persistent tier refuse blocks of another store.
        """
        if self.block_bytes:
            raise ConfigError(f"tier {self.name!r} is already in use by a store: give each store its own tiers")
        n = self.slots_for(block_bytes)
        self.block_bytes = block_bytes
        self.capacity_blocks = n
        self._allocate(n, block_bytes)
        return n

    def slots_for(self, block_bytes: int) -> int:
        """How many slots this tier takes for blocks of `block_bytes` (its capacity's)."""
        if self.capacity_spec is not None:
            return self.capacity_spec
        if self.capacity_bytes is None:
            return self._kept_slots(block_bytes)
        slot = self.slot_size(block_bytes)
        n = self.capacity_bytes // slot
        if n == 0:
            raise TierSizeError(
                f"tier {self.name!r}: capacity {format_bytes(self.capacity_bytes)} is smaller than one "
                f"block ({slot} bytes = {format_bytes(slot)}); give it at least that much")
        return n

    def _kept_slots(self, block_bytes: int) -> int:
        """The slots a tier given no size had before (keeps_size tiers only)."""
        raise NotImplementedError

    def record_order(self, slots: Sequence[SlotId], newest: bool = False) -> None:
        """The blocks in these slots were last used in this order (oldest first), and, if
        `newest`, after every other block: a persistent tier keeps it for the order it adopts
        and shrinks in (BlockIndex.order_in, copies_above). Memory tiers need not."""

    def demand(self, block_bytes: int) -> Demand | None:
        """What binding this tier for `block_bytes` will take (None: nothing checked ahead)."""
        return None

    def slot_size(self, block_bytes: int) -> int:
        """Bytes one block takes in this tier: a capacity in bytes holds capacity // this."""
        return block_bytes

    @abstractmethod
    def _allocate(self, slots: int, block_bytes: int) -> None: ...

    @abstractmethod
    def write(self, slots: Sequence[SlotId], rows: Sequence[np.ndarray],
              idx: Sequence[int] | None = None, keys: Sequence[BlockKey] | None = None) -> None:
        """Copy rows[idx[j]] (rows[j] without idx) into slots[j]; keys[j] is that block's key."""

    def begin_write(self, slots: Sequence[SlotId], rows: Sequence[np.ndarray], idx: Sequence[int] | None = None,
                    keys: Sequence[BlockKey] | None = None, *, executor: Executor | None = None) -> PendingWrite:
        """write(), started so the caller can do other work while it goes on (a large put
        reserves its remaining slots meanwhile: Store._store). Tiers with I/O threads of
        their own (disk) start it there; by default it runs on `executor`, or here, now,
        when none is given."""
        if executor is None:
            self.write(slots, rows, idx, keys)
            return PendingWrite.done()
        return PendingWrite(submit(executor, self.write, slots, rows, idx, keys).result)

    @abstractmethod
    def read(self, slots: Sequence[SlotId], rows: Sequence[np.ndarray],
             idx: Sequence[int] | None = None, keys: Sequence[BlockKey] | None = None) -> list[int]:
        """Copy slots[j] into rows[idx[j]] (rows[j] without idx).

        Returns the positions j whose bytes failed verification (always empty for memory).
        """

    @abstractmethod
    def block(self, slot: SlotId) -> np.ndarray:
        """One slot's bytes: a view for memory tiers (valid while the block stays), a copy otherwise."""

    def blocks(self, slots: Sequence[SlotId]) -> Sequence[np.ndarray]:
        """Several slots' bytes, as block() gives each (a demotion reads its batch with this)."""
        return [self.block(s) for s in slots]

    def memory(self) -> torch.Tensor | None:
        """The slots as one [capacity_blocks, block_bytes] uint8 tensor that callers may read
        and write in place (memory tiers on the host), or None (disk, or GPU memory). Bytes
        written there bypass write() (a demotion from a GPU tier, write_in_place): a tier
        whose write() does more than copy must return None."""
        return None

    def copy_to(self, slots: Sequence[SlotId], memory: torch.Tensor, dst_slots: Sequence[SlotId]) -> bool:
        """Copy the blocks in `slots` straight into rows `dst_slots` of `memory` (a lower
        tier's memory()); False where this tier has no better way than blocks() then the
        other tier's write() (a demotion tries this first)."""
        return False

    def release(self, slots: Sequence[SlotId], keys: Sequence[BlockKey]) -> None:
        """These blocks left the tier (a persistent tier forgets their records)."""

    def recover(self) -> list[tuple[BlockKey, SlotId]]:
        """(key, slot) of the blocks a persistent tier already holds, least recent first."""
        return []

    def flush(self) -> None:
        """Make every completed write durable (persistent tiers)."""

    def info(self) -> dict[str, Any]:
        """Static facts for stats (memory kind, pinned or not, ...)."""
        return {}

    def close(self) -> None:
        """Release the tier's memory or files."""


def copy_runs(slots: Sequence[SlotId], idx: Sequence[int] | None, mergeable: bool) -> Iterator[tuple[int, int, int]]:
    """(first slot, first row, length) of each run where slots and rows both step by +1
    or both by -1, as ascending ranges; single pairs when the rows cannot be sliced."""
    rows = range(len(slots)) if idx is None else idx
    if not mergeable:
        for s, i in zip(slots, rows):
            yield s, i, 1
        return
    n = len(slots)
    j = 0
    while j < n:
        s0, i0, k = slots[j], rows[j], 1
        if j + 1 < n:
            d = slots[j + 1] - s0
            if d in (1, -1) and rows[j + 1] - i0 == d:
                while j + k < n and slots[j + k] - slots[j + k - 1] == d and rows[j + k] - rows[j + k - 1] == d:
                    k += 1
                if d == -1:
                    s0, i0 = s0 - k + 1, i0 - k + 1
        yield s0, i0, k
        j += k


def rows_into_slots(pool: np.ndarray, slots: Sequence[SlotId], rows: Sequence[np.ndarray],
                    idx: Sequence[int] | None) -> None:
    """pool[slots[j]] = rows[idx[j]], one copy per run of consecutive slots and rows."""
    for s, i, n in copy_runs(slots, idx, isinstance(rows, np.ndarray)):
        if n == 1:
            pool[s] = rows[i]
        else:
            pool[s:s + n] = rows[i:i + n]


def slots_into_rows(pool: np.ndarray, slots: Sequence[SlotId], rows: Sequence[np.ndarray],
                    idx: Sequence[int] | None) -> None:
    """rows[idx[j]] = pool[slots[j]], one copy per run of consecutive slots and rows."""
    for s, i, n in copy_runs(slots, idx, isinstance(rows, np.ndarray)):
        if n == 1:
            rows[i][...] = pool[s]
        else:
            rows[i:i + n] = pool[s:s + n]


def check_fit(tiers: Sequence[Tier], block_bytes: int) -> None:
    """Refuse tiers that cannot all be had before any is allocated: each fitting alone is not
    enough where they share memory or a disk, and a tier refused after another was allocated
    (and its memory touched) wasted the time that took."""
    shared: dict[str, list[tuple[Tier, Demand]]] = {}
    for t in tiers:
        if t.block_bytes:
            continue                   # bound to another store: bind() says so
        d = t.demand(block_bytes)
        if d is not None:
            shared.setdefault(d.where, []).append((t, d))
    for where, items in shared.items():
        total = sum(d.nbytes for _, d in items)
        if len(items) == 1:
            what = items[0][1].what or f"{where} (tier {items[0][0].name!r})"
        else:
            what = (f"{where} (tiers {', '.join(repr(t.name) for t, _ in items)}: "
                    f"{' + '.join(format_bytes(d.nbytes) for _, d in items)})")
        err = items[0][1].check(what, total)
        if err is not None:
            raise err
