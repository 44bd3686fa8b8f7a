"""kvtier: a tiered KV-cache store for LLM inference.

    tokens -> keys -> lookup -> load into the engine's pages -> compute the rest
    engine pages -> save -> top tier -> (evicted) -> next tier down -> ... -> dropped
"""
from __future__ import annotations

__version__ = "0.1.0"

from kvtier.errors import (CapacityError, ClosedError, ConfigError, ForeignKeysError, KeyNotCachedError,
                           KvtierError, LayoutError, TierSizeError, TraceError, TransferError)
from kvtier.handles import Transfer
from kvtier.keys import BlockKeys, KeyOrigin, Keyer, Namespace
from kvtier.layout import KVLayout, preset_layout
from kvtier.stats import StoreStats, TierStats
from kvtier.store import Hit, Store
from kvtier.net import Node, PeerList, RedisDirectory
from kvtier.tiers import DeviceTier, DiskTier, HostTier, Tier
from kvtier.tiers.remote import RemoteTier

__all__ = [
    "Store", "Hit", "Transfer", "KVLayout", "preset_layout", "Namespace", "BlockKeys", "KeyOrigin", "Keyer",
    "DeviceTier", "HostTier", "DiskTier", "RemoteTier", "Node", "PeerList", "RedisDirectory", "Tier", "StoreStats", "TierStats",
    "KvtierError", "ConfigError", "LayoutError", "CapacityError", "KeyNotCachedError", "ClosedError",
    "TransferError", "TraceError", "ForeignKeysError", "TierSizeError",
]
