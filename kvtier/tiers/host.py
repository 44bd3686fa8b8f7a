"""Host-memory tier: one page-aligned (pinned when CUDA is here) allocation cut into slots.

The allocation is made and prefaulted when a store binds the tier (kvtier/tiers/memory.py):
more than the machine's available memory is a ConfigError, a large one shows its progress."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from kvtier.ids import BlockKey, SlotId
from kvtier.tiers.base import Demand, Tier, rows_into_slots, slots_into_rows
from kvtier.tiers.memory import HostBuffer, allocate_host, memory_demand


class HostTier(Tier):
    """Blocks in host RAM. `HostTier(capacity="8GiB")` or `HostTier(blocks=1024)`."""

    kind = "host"

    def __init__(self, capacity: int | str | None = None, *, blocks: int | None = None,
                 name: str | None = None, pin: bool | None = None) -> None:
        super().__init__(capacity, blocks=blocks, name=name)
        self.pin = pin
        self._buf: HostBuffer | None = None
        self.slots: np.ndarray | None = None   # [capacity_blocks, block_bytes] view of the pool
        self._memory: torch.Tensor | None = None   # the same as a tensor (memory())

    def demand(self, block_bytes: int) -> Demand:
        return memory_demand(self.slots_for(block_bytes) * block_bytes, self._what())

    def _what(self) -> str:
        return f"host memory (tier {self.name!r})"

    def _allocate(self, slots: int, block_bytes: int) -> None:
        self._buf = allocate_host(slots * block_bytes, self.pin, self._what())
        self.slots = self._buf.array[: slots * block_bytes].reshape(slots, block_bytes)
        # Made once: a view per call cost ~3 us, and a load asks once per block it plans.
        self._memory = self._buf.tensor[: self.slots.size].view(self.slots.shape)

    # Speed: numpy row assignment is a plain memcpy (about raw speed even for 64 KiB
    # rows here, where torch.index_copy_ ran ~9x slower), and runs of consecutive slots
    # that match consecutive rows are copied as one range. The index hands out slots
    # so that a chain put tail-first fills ascending slots: a put and a later get of
    # the same prefix are then a few large copies instead of one per block.
    def write(self, slots: Sequence[SlotId], rows: Sequence[np.ndarray],
              idx: Sequence[int] | None = None, keys: Sequence[BlockKey] | None = None) -> None:
        rows_into_slots(self.slots, slots, rows, idx)

    def read(self, slots: Sequence[SlotId], rows: Sequence[np.ndarray],
             idx: Sequence[int] | None = None, keys: Sequence[BlockKey] | None = None) -> list[int]:
        slots_into_rows(self.slots, slots, rows, idx)
        return []

    def block(self, slot: SlotId) -> np.ndarray:
        return self.slots[slot]

    def memory(self) -> torch.Tensor | None:
        return self._memory

    def info(self) -> dict[str, Any]:
        if self._buf is None:
            return {"memory": "unallocated"}
        return {"memory": self._buf.memory, "memory_note": self._buf.note, "allocated_bytes": self._buf.nbytes,
                "prefault_s": round(self._buf.prefault_s, 3)}

    def close(self) -> None:
        self.slots = self._memory = None
        if self._buf is not None:
            self._buf.close()
            self._buf = None
