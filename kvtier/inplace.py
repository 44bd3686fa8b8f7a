"""Where a save writes and a load reads a store's bytes in place: what Store.write_in_place()
hands its writer and Store.reading() yields, so an engine's pages move to and from tier
memory in one copy.

Both describe tier memory as a [slots, block_bytes] uint8 tensor plus the rows (slots)
that matter, which is what kvtier.transfer.pages.copy(..., rows=) takes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.ids import TierId


@dataclass
class WriteSlots:
    """Top-tier slots reserved for the new blocks among a save's keys: write block
    `positions[j]` of the save into row `slots[j]` of `memory`. Blocks already cached or not
    admitted have no slot (nothing to write). The blocks become readable when
    Store.write_in_place returns (a large save with an async writer hands it one of these per
    part, tail first); an error in the writer frees every slot of the save."""

    memory: torch.Tensor          # the top tier's slots, [capacity_blocks, block_bytes] uint8
    slots: torch.Tensor           # int64 [k]
    positions: list[int]          # index into the save's keys of each slot's block
    present: int = 0              # blocks of the save already cached (refreshed only)
    rejected: int = 0             # blocks not admitted, or no room


@dataclass
class ReadGroup:
    """Blocks `positions` of a read, at rows `rows` of `memory`."""

    memory: torch.Tensor          # [rows, block_bytes] uint8: a memory tier's slots, or a read buffer
    rows: torch.Tensor            # int64
    positions: list[int]


@dataclass
class HeldBlocks:
    """The leading `blocks` cached blocks of a read's keys, held while the `with` block that
    got this runs (never evicted or overwritten meanwhile). Blocks in a memory tier are
    read in place; blocks from disk were read (and verified) into a buffer of the store's."""

    blocks: int
    groups: list[ReadGroup] = field(default_factory=list)
    tiers: list[TierId] = field(default_factory=list)  # the tier each block came from

    def rows(self) -> list[np.ndarray]:
        """Each held block's bytes in order (views, valid inside the `with` block)."""
        out: list[np.ndarray] = [None] * self.blocks     # type: ignore[list-item]
        for g in self.groups:
            mem = g.memory.numpy()
            for r, i in zip(g.rows.tolist(), g.positions):
                out[i] = mem[r]
        return out
