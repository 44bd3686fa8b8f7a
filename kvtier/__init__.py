"""kvtier: a tiered KV-cache store for LLM inference.

    tokens -> keys -> lookup -> load into the engine's pages -> compute the rest
    engine pages -> save -> top tier -> (evicted) -> next tier down -> ... -> dropped

The public names below are imported on first use (PEP 562), so `import kvtier.errors`
or the `kvtier` command's --help and usage errors do not pay for importing torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(["CapacityError", "ClosedError", "ConfigError", "ForeignKeysError", "KeyNotCachedError",
                     "KvtierError", "LayoutError", "TierInUseError", "TierSizeError", "TraceError", "TransferError",
                     "WriteInterrupted"],
                    "kvtier.errors"),
    "Transfer": "kvtier.handles",
    **dict.fromkeys(["BlockKeys", "KeyOrigin", "Keyer", "Namespace"], "kvtier.keys"),
    **dict.fromkeys(["KVLayout", "preset_layout"], "kvtier.layout"),
    **dict.fromkeys(["StoreStats", "TierStats"], "kvtier.stats"),
    **dict.fromkeys(["Hit", "Store"], "kvtier.store"),
    "StoreConfig": "kvtier.config",
    **dict.fromkeys(["Node", "NodeLimits", "PeerClient", "PeerError", "PeerList", "RedisDirectory", "Tls"],
                    "kvtier.net"),
    "Remote": "kvtier.net.remote",
    **dict.fromkeys(["DeviceTier", "DiskTier", "HostTier", "Tier"], "kvtier.tiers"),
}
__all__ = sorted(_EXPORTS)
# Subpackages the docs reach as attributes (`kvtier.adapter.KVAdapter`, `kvtier.engine.LLM`):
# imported on first use like the names above.
_SUBMODULES = frozenset({"adapter", "engine", "transfer"})


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"kvtier.{name}")     # (the import binds it in globals)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value          # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})


if TYPE_CHECKING:   # for type checkers and IDEs: the same names, imported eagerly  # noqa: F401
    from kvtier.errors import (CapacityError, ClosedError, ConfigError, ForeignKeysError, KeyNotCachedError,
                               KvtierError, LayoutError, TierInUseError, TierSizeError, TraceError, TransferError,
                               WriteInterrupted)
    from kvtier.handles import Transfer
    from kvtier.keys import BlockKeys, KeyOrigin, Keyer, Namespace
    from kvtier.layout import KVLayout, preset_layout
    from kvtier.net import Node, NodeLimits, PeerClient, PeerError, PeerList, RedisDirectory, Tls
    from kvtier.net.remote import Remote
    from kvtier.stats import StoreStats, TierStats
    from kvtier.store import Hit, Store
    from kvtier.config import StoreConfig
    from kvtier.tiers import DeviceTier, DiskTier, HostTier, Tier
