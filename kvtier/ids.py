"""The names of things the store hands around, typed once for the whole library.

A block is named by a `BlockKey` (16 bytes, from kvtier.keys.Keyer); a tier by its
position in a store's tier list (`TierId`, 0 = fastest); a block's place in a tier by a
`SlotId`. "No slot" is `None`, never -1. The index and the eviction policies also run
on a trace's block ids in the hit-ratio replay, so they take any `IndexKey`.
"""
from __future__ import annotations

from typing import Hashable, NewType

BlockKey = NewType("BlockKey", bytes)     # 16 bytes: one block of tokens, chained to its prefix
TierId = NewType("TierId", int)           # a tier's position in a store, 0 = fastest
SlotId = NewType("SlotId", int)           # a block's place in one tier, 0 .. capacity_blocks - 1
IndexKey = Hashable                       # a BlockKey in a store; a trace's block id in a replay

KEY_BYTES = 16
TOP_TIER = TierId(0)                      # the fastest tier: an engine's pages when they are kvtier's
