"""The engine's KV cache: a kvtier Store whose top tier is the engine's pages.

    device tier (KV pages, `kv_cache`) -> host memory (`host_cache`) -> disk (`disk_path`)

Blocks a finished request leaves behind stay in the device tier until the space is
needed, then move down; a later request finds them in whichever tier they reached.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.keys import Namespace
from kvtier.layout import KVLayout
from kvtier.policies import DEFAULT_POLICY
from kvtier.store import Store
from kvtier.tiers import DeviceTier, DiskTier, HostTier, Tier


@dataclass
class CacheConfig:
    block_tokens: int = 16                 # tokens per page and per kvtier block
    kv_cache: int | str = "256MiB"         # device tier: the engine's KV pages
    host_cache: int | str | None = "1GiB"  # host-memory tier below it (None: none)
    disk_path: str | None = None           # a disk tier below that (None: none); kept across runs
    disk_cache: int | str = "4GiB"         # its size, allocated when the folder is first used
    policy: str = DEFAULT_POLICY


def build_store(layout: KVLayout, namespace: Namespace, cache: CacheConfig, device: torch.device | str | None = None) -> Store:
    tiers: list[Tier] = [DeviceTier(cache.kv_cache, device=device, name="device")]
    if cache.host_cache:
        tiers.append(HostTier(cache.host_cache, name="host"))
    if cache.disk_path:
        tiers.append(DiskTier(cache.disk_path, cache.disk_cache, name="disk"))
    return Store(layout, tiers, namespace, policy=cache.policy)
