"""Eviction and admission policies, selectable by name in the store and the CLI."""
from __future__ import annotations

from typing import Callable

from kvtier.errors import ConfigError
from kvtier.policies.base import BlockInfo, EvictionPolicy
from kvtier.policies.lru import LRUPolicy

PolicyFactory = Callable[[int], EvictionPolicy]

#: name -> factory(capacity_blocks). Online policies only: the store may use any of them.
POLICIES: dict[str, PolicyFactory] = {
    "lru": LRUPolicy,
}
#: The store's default.
DEFAULT_POLICY = "lru"


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make a policy selectable by name (e.g. Store(policy=name))."""
    POLICIES[name] = factory


def make_policy(name: str, capacity_blocks: int) -> EvictionPolicy:
    """A fresh policy instance for one tier of `capacity_blocks` blocks."""
    if name == "recommended":
        name = DEFAULT_POLICY
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))} or 'recommended'")
    return POLICIES[name](capacity_blocks)


__all__ = ["BlockInfo", "EvictionPolicy", "LRUPolicy", "POLICIES", "DEFAULT_POLICY",
           "make_policy", "register_policy"]
